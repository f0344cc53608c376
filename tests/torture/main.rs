//! Crash torture: two apis, two dispatchers and a private nats-server as real
//! processes, killed with SIGKILL at random while publishers keep publishing
//! (retrying the same event id until it is accepted); then the checker:
//! every accepted event at every subscribed endpoint, each delivery's
//! schedule advanced once, nothing stuck, the state machine's invariants,
//! and every duplicate arrival explained by a crash.
//!
//! `RELAY_TORTURE_SECONDS` (default 30) is how long the killing goes on;
//! `RELAY_TORTURE_SEED` replays a run. `deploy/local/torture` runs a long one.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use relay_tests::{Options, PrivateNats, Process, Receiver, Rng, Stack, api_addrs};
use serde_json::json;
use uuid::Uuid;

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

/// Overrides (or adds) one setting in a process's environment.
fn with(mut env: Vec<(&'static str, String)>, key: &'static str, value: String) -> Vec<(&'static str, String)> {
    env.retain(|(k, _)| *k != key);
    env.push((key, value));
    env
}

/// What the publishers saw: ids answered 202, and ids still unanswered.
#[derive(Default)]
struct Ledger {
    accepted: HashSet<Uuid>,
    unconfirmed: HashSet<Uuid>,
    retries: u64,
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
    let ledger: Arc<Mutex<Ledger>> = Default::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publishers: Vec<_> = (0..4u64)
        .map(|p| {
            let (ledger, stop, urls, key) = (ledger.clone(), stop.clone(), rest_urls.clone(), tenant.api_key.clone());
            let mut rng = Rng(seed ^ (p + 1).wrapping_mul(0x5851_f42d_4c95_7f2d));
            tokio::spawn(async move {
                let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let id = Uuid::new_v4();
                    ledger.lock().expect("unpoisoned").unconfirmed.insert(id);
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while Instant::now() < deadline {
                        let url = &urls[rng.below(2)];
                        let sent = http
                            .post(format!("{url}/v1/events"))
                            .bearer_auth(&key)
                            .json(&json!({"id": id.to_string(), "type": "t", "payload": {"p": p}}))
                            .send()
                            .await;
                        if sent.is_ok_and(|r| r.status().as_u16() == 202) {
                            let mut l = ledger.lock().expect("unpoisoned");
                            l.unconfirmed.remove(&id);
                            l.accepted.insert(id);
                            break;
                        }
                        ledger.lock().expect("unpoisoned").retries += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    tokio::time::sleep(millis(&mut rng, 5, 40)).await;
                }
                anyhow::Ok(())
            })
        })
        .collect();

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
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for p in publishers {
        p.await??;
    }
    let killing = started.elapsed();

    // Settle: every accepted event at every endpoint, bounded.
    let (accepted, unconfirmed, retries) = {
        let l = ledger.lock().expect("unpoisoned");
        (l.accepted.clone(), l.unconfirmed.clone(), l.retries)
    };
    let pg = stack.pg().await?;
    // An id never answered 202 may still have been stored; if so it is owed too.
    let stored_unconfirmed: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM events WHERE id = ANY ($1)")
        .bind(unconfirmed.iter().copied().collect::<Vec<_>>())
        .fetch_all(&pg)
        .await?;
    let owed: HashSet<String> = accepted.iter().chain(&stored_unconfirmed).map(Uuid::to_string).collect();
    let arrivals = |path: &str| -> HashMap<String, Vec<Instant>> {
        let mut m: HashMap<String, Vec<Instant>> = HashMap::new();
        for r in receiver.at(path) {
            m.entry(r.header("relay-webhook-id")).or_default().push(r.at);
        }
        m
    };
    let settle_started = Instant::now();
    let settled = relay_tests::eventually(Duration::from_secs(180), || async {
        paths
            .iter()
            .all(|p| {
                let got = arrivals(p);
                owed.iter().all(|id| got.contains_key(id))
            })
            .then_some(())
    })
    .await
    .is_some();
    // Healthy receivers: every delivery ends delivered once its outcome
    // lands, and the outbox empties once claims of killed relays run out.
    let quiet = relay_tests::eventually(Duration::from_secs(90), || async {
        let (left, outbox): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM webhook_deliveries WHERE state <> 'delivered'), (SELECT count(*) FROM events WHERE published_at IS NULL)",
        )
        .fetch_one(&pg)
        .await
        .ok()?;
        (left == 0 && outbox == 0).then_some(())
    })
    .await
    .is_some();
    let settle = settle_started.elapsed();

    // The figures, then the verdicts.
    let mut missing = 0usize;
    let mut duplicates = 0usize;
    let mut unexplained: Vec<String> = Vec::new();
    for p in paths {
        let got = arrivals(p);
        missing += owed.iter().filter(|id| !got.contains_key(*id)).count();
        for (id, times) in &got {
            anyhow::ensure!(owed.contains(id), "{p}: {id} arrived but was never published");
            for w in times.windows(2) {
                duplicates += 1;
                // A crash between a POST and its recorded outcome (or a
                // broker losing track of an ack) re-sends: some kill must
                // fall between the first arrival (less an attempt) and the
                // second.
                let explained = kills.iter().any(|k| k.at + Duration::from_secs(3) >= w[0] && k.at <= w[1]);
                if !explained {
                    unexplained.push(format!("{p} {id} ({:?} apart)", w[1] - w[0]));
                }
            }
        }
    }
    let by_kind = |f: fn(&Victim) -> bool| kills.iter().filter(|k| f(&k.victim)).count();
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state <> 'delivered'").fetch_one(&pg).await?;
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NULL").fetch_one(&pg).await?;
    let advanced_twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries d WHERE d.attempt <> 1 OR (SELECT count(*) FROM delivery_attempts a WHERE a.delivery_id = d.id) <> 1",
    )
    .fetch_one(&pg)
    .await?;
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries").fetch_one(&pg).await?;
    println!(
        "torture: {:.0} s, kills: {} api, {} dispatcher, {} broker; events accepted {} (+{} stored unanswered, {} publish retries); \
         deliveries {deliveries}; missing {missing}; duplicates {duplicates} ({} unexplained); schedule advanced more than once {advanced_twice}; \
         not delivered {pending}; outbox left {outbox}; settled {:.1} s after the last kill",
        killing.as_secs_f64(),
        by_kind(|v| matches!(v, Victim::Api(_))),
        by_kind(|v| matches!(v, Victim::Dispatcher(_))),
        by_kind(|v| matches!(v, Victim::Broker)),
        accepted.len(),
        stored_unconfirmed.len(),
        retries,
        unexplained.len(),
        settle.as_secs_f64(),
    );
    anyhow::ensure!(!accepted.is_empty() && !kills.is_empty(), "the run published and killed nothing");
    anyhow::ensure!(settled && missing == 0, "{missing} (event, endpoint) pairs never arrived (seed {seed})");
    anyhow::ensure!(unexplained.is_empty(), "duplicates no crash explains (seed {seed}): {:?}", &unexplained[..unexplained.len().min(10)]);
    anyhow::ensure!(quiet && pending == 0 && outbox == 0, "{pending} deliveries undelivered, {outbox} events unpublished (seed {seed})");
    anyhow::ensure!(advanced_twice == 0, "{advanced_twice} deliveries advanced their schedule more than once (seed {seed})");
    pg.close().await;

    for v in [Victim::Dispatcher(0), Victim::Dispatcher(1), Victim::Api(0), Victim::Api(1)] {
        fleet.kill(v).await?;
    }
    stack.stop().await.context("the state machine's invariants")?;
    fleet.nats.stop().await
}
