//! Crash torture: two apis, two dispatchers and a private nats-server as real
//! processes, killed with SIGKILL at random while publishers keep publishing
//! (retrying the same event id until it is accepted); then the checker:
//! every accepted event at every subscribed endpoint, each delivery's
//! schedule advanced once, nothing stuck, the state machine's invariants,
//! and every duplicate arrival explained by a crash.
//!
//! `RELAY_TORTURE_SECONDS` (default 30) is how long the killing goes on;
//! `RELAY_TORTURE_SEED` replays a run. `deploy/local/torture` runs a long one.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use relay_tests::{
    Options, PrivateNats, Process, Receiver, Rng, Stack, api_addrs,
    load::{self, Pace, Publishers, with},
};

/// A random pause from `lo` to `hi` milliseconds.
fn millis(rng: &mut Rng, lo: usize, hi: usize) -> Duration {
    Duration::from_millis(rng.range(lo, hi) as u64)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Victim {
    Api(usize),
    Dispatcher(usize),
    Broker,
}

/// A process's settings, and the process when it runs.
type Member = (Vec<(&'static str, String)>, Option<Process>);

/// The processes under torture, each restartable with its own settings.
struct Fleet {
    apis: Vec<Member>,
    dispatchers: Vec<Member>,
    nats: PrivateNats,
}

impl Fleet {
    async fn kill(&mut self, v: Victim) -> Result<()> {
        match v {
            Victim::Api(i) => {
                if let Some(p) = self.apis[i].1.take() {
                    p.kill9().await?;
                }
            }
            Victim::Dispatcher(i) => {
                if let Some(p) = self.dispatchers[i].1.take() {
                    p.kill9().await?;
                }
            }
            Victim::Broker => self.nats.kill9().await?,
        }
        Ok(())
    }

    async fn start(&mut self, v: Victim) -> Result<()> {
        match v {
            Victim::Api(i) => {
                let (env, p) = &mut self.apis[i];
                *p = Some(Process::spawn("relay-api", env)?);
            }
            Victim::Dispatcher(i) => {
                let (env, p) = &mut self.dispatchers[i];
                *p = Some(Process::spawn("relay-dispatcher", env)?);
            }
            Victim::Broker => self.nats.resume().await?,
        }
        Ok(())
    }
}

/// A kill and when it happened, to explain duplicates.
#[derive(Debug, Clone, Copy)]
struct Kill {
    victim: Victim,
    at: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kill_9_of_apis_dispatchers_and_the_broker_loses_nothing() -> Result<()> {
    let seconds: u64 = std::env::var("RELAY_TORTURE_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let seed: u64 = std::env::var("RELAY_TORTURE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    println!("torture: {seconds} s of kills, RELAY_TORTURE_SEED={seed}");
    let mut rng = Rng(seed);

    let nats = PrivateNats::start().await?;
    let stack =
        Stack::start(Options { api: false, dispatcher: false, nats_url: nats.url(), endpoint_cap: 64, ..Options::default() }).await?;
    // Leases and ack waits short enough that a job lost in a crash comes
    // back within the test; quiet logs (the kills make the rest noisy).
    let api_env = |addrs: &relay_api::config::ListenAddrs| {
        let env = with(stack.api_env(), "RELAY_DELIVERY_LEASE_SECS", "10".into());
        let env = with(env, "RELAY_ATTEMPT_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_SEAM_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_LOG", "error".into());
        let env = with(env, "RELAY_GRPC_ADDR", addrs.grpc.to_string());
        let env = with(env, "RELAY_REST_ADDR", addrs.rest.to_string());
        with(env, "RELAY_INTERNAL_ADDR", addrs.internal.to_string())
    };
    let second = api_addrs().await?;
    let rest_urls = [stack.rest_url.clone(), format!("http://{}", second.rest)];
    let dispatcher_env = |internal: String| {
        let env = with(stack.dispatcher_env(), "RELAY_API_INTERNAL_URL", internal);
        let env = with(env, "RELAY_ATTEMPT_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_SEAM_TIMEOUT_MS", "2000".into());
        with(env, "RELAY_LOG", "error".into())
    };
    let mut fleet = Fleet {
        apis: vec![(api_env(&stack.addrs), None), (api_env(&second), None)],
        dispatchers: vec![
            (dispatcher_env(stack.internal_url.clone()), None),
            (dispatcher_env(format!("https://127.0.0.1:{}", second.internal.port())), None),
        ],
        nats,
    };
    for v in [Victim::Api(0), Victim::Api(1), Victim::Dispatcher(0), Victim::Dispatcher(1)] {
        fleet.start(v).await?;
    }
    stack.wait_for_api().await?;

    let tenant = stack.tenant("torture").await?;
    let receiver = Receiver::start().await?;
    let paths = ["/t1", "/t2", "/t3", "/t4"];
    let rest = relay_tests::Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for p in paths {
        rest.endpoint(&receiver.url(p), &["t"]).await?;
    }

    // Publishers: each picks an api, publishes a fresh id, and retries that
    // same id (on either api) until it is answered 202.
    let publishers = Publishers::start(4, &rest_urls, &tenant.api_key, "t", Pace::Random { seed, lo: 5, hi: 40 });

    // The killing.
    let started = Instant::now();
    let mut kills: Vec<Kill> = Vec::new();
    while started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(millis(&mut rng, 700, 2500)).await;
        let victim = match rng.below(10) {
            0..=2 => Victim::Api(rng.below(2)),
            3..=7 => Victim::Dispatcher(rng.below(2)),
            _ => Victim::Broker,
        };
        fleet.kill(victim).await?;
        kills.push(Kill { victim, at: Instant::now() });
        tokio::time::sleep(millis(&mut rng, 100, 1500)).await;
        fleet.start(victim).await?;
    }
    let ledger = publishers.stop().await?;
    let killing = started.elapsed();

    // Settle: every accepted event at every endpoint, bounded; healthy
    // receivers, so every delivery ends delivered once its outcome lands,
    // and the outbox empties once claims of killed relays run out.
    let pg = stack.pg().await?;
    let settled = load::settle(&pg, &ledger, &receiver, &paths).await?;
    let faults: Vec<(Victim, Instant)> = kills.iter().map(|k| (k.victim, k.at)).collect();
    let counted = load::account(&receiver, &paths, &settled.owed, &faults)?;
    let (missing, unexplained) = (counted.missing, &counted.unexplained);
    let duplicates = counted.duplicates.values().sum::<usize>() + unexplained.len();
    let (pending, outbox, advanced_twice) = (settled.pending, settled.outbox, settled.advanced_twice);
    let by_kind = |f: fn(&Victim) -> bool| kills.iter().filter(|k| f(&k.victim)).count();
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries").fetch_one(&pg).await?;
    println!(
        "torture: {:.0} s, kills: {} api, {} dispatcher, {} broker; events accepted {} (+{} stored unanswered, {} publish retries); \
         deliveries {deliveries}; missing {missing}; duplicates {duplicates} ({} unexplained); schedule advanced more than once {advanced_twice}; \
         not delivered {pending}; outbox left {outbox}; every owed event arrived {:.1} s and all settled {:.1} s after the last kill",
        killing.as_secs_f64(),
        by_kind(|v| matches!(v, Victim::Api(_))),
        by_kind(|v| matches!(v, Victim::Dispatcher(_))),
        by_kind(|v| matches!(v, Victim::Broker)),
        ledger.accepted.len(),
        settled.stored_unconfirmed,
        ledger.retries,
        unexplained.len(),
        settled.arrived_after.as_secs_f64(),
        settled.quiet_after.as_secs_f64(),
    );
    anyhow::ensure!(!ledger.accepted.is_empty() && !kills.is_empty(), "the run published and killed nothing");
    anyhow::ensure!(settled.all_arrived && missing == 0, "{missing} (event, endpoint) pairs never arrived (seed {seed})");
    anyhow::ensure!(unexplained.is_empty(), "duplicates no crash explains (seed {seed}): {:?}", &unexplained[..unexplained.len().min(10)]);
    anyhow::ensure!(
        settled.quiet && pending == 0 && outbox == 0,
        "{pending} deliveries undelivered, {outbox} events unpublished (seed {seed})"
    );
    anyhow::ensure!(advanced_twice == 0, "{advanced_twice} deliveries advanced their schedule more than once (seed {seed})");
    pg.close().await;

    for v in [Victim::Dispatcher(0), Victim::Dispatcher(1), Victim::Api(0), Victim::Api(1)] {
        fleet.kill(v).await?;
    }
    stack.stop().await.context("the state machine's invariants")?;
    fleet.nats.stop().await
}
