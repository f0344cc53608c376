//! Crash torture: two apis, two dispatchers and a private nats-server as real
//! processes, killed with SIGKILL at random while publishers keep publishing
//! (retrying the same event id until it is accepted) to five endpoints: two
//! healthy, one that refuses each webhook's first request and accepts its
//! retry, one that answers slowly, one that fails 30 % of requests at random
//! (so kills land on retries as well as first attempts). Then the checker:
//! every accepted event at every endpoint, each delivery's attempt log whole
//! (attempts 1..=n once each), nothing stuck, the state machine's
//! invariants, and every request beyond the recorded attempts explained by
//! a kill of the dispatcher that sent it (each sends from its own loopback
//! address) or of the api it reports to, around when it arrived. Every event
//! carries one of 32 ordering keys, and two more endpoints order per key
//! (one healthy, one failing 30 % at random): each must see every key's
//! events in publish order — 0 order violations: each event's first request
//! comes after the first requests of every earlier event of its key and
//! before any later one's, with a rising sequence number; any other request
//! must be a repeat of an event that had already arrived, with the same id
//! and number (a kill's duplicate, which a receiver drops by its id).
//!
//! `RELAY_TORTURE_SECONDS` (default 30) is how long the killing goes on;
//! `RELAY_TORTURE_SEED` replays a run. `deploy/local/torture` runs a long one.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use relay_tests::{
    Options, PrivateNats, Process, Receiver, Reply, Rng, Stack, api_addrs,
    flaky::{Behaviour, Flaky},
    load::{self, Arrival, Pace, Publishers, with},
};

/// Where each dispatcher sends from: the receiver tells them apart by it.
const SOURCES: [&str; 2] = ["127.0.0.2", "127.0.0.3"];
/// A request written just before its sender's kill is read by the receiver
/// up to this much after it (the test process is busy).
const READ_AFTER_KILL: Duration = Duration::from_secs(1);
/// From a request's arrival to its outcome recorded: the receiver's answer
/// (at most the slow endpoint's 100 ms), the report, the api's commit.
const OUTCOME_SPAN: Duration = Duration::from_secs(3);
/// How long a restarted api takes to answer its dispatcher again.
const API_START: Duration = Duration::from_secs(2);

/// The endpoints that order per key, and how many keys the events spread over.
const ORDERED: [&str; 2] = ["/ordered", "/ordered-fails-30"];
const KEYS: usize = 32;

/// The requests at an ordered endpoint that break its keys' order, in
/// words: each key's first requests for its events, in arrival order, name
/// them in their publish order (`events.ordering_sequence`) with rising
/// sequence numbers; every other request repeats an event that had
/// arrived before, with the number it came with then.
async fn order_violations(pg: &sqlx::PgPool, receiver: &Receiver, path: &str) -> Result<Vec<String>> {
    let numbers: std::collections::HashMap<String, (String, i64)> = sqlx::query_as::<_, (String, String, i64)>(
        "SELECT id::text, ordering_key, ordering_sequence FROM events WHERE ordering_key IS NOT NULL",
    )
    .fetch_all(pg)
    .await?
    .into_iter()
    .map(|(id, key, n)| (id, (key, n)))
    .collect();
    let mut arrivals = receiver.at(path);
    arrivals.sort_by_key(|r| r.at);
    // Per key: the latest event to arrive for the first time, its number and
    // its sequence header; per event: the sequence it first came with.
    let mut latest: std::collections::HashMap<String, (String, i64, u64)> = std::collections::HashMap::new();
    let mut first_sequence: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut found = Vec::new();
    for r in arrivals {
        let id = r.header("relay-webhook-id");
        let Some((key, n)) = numbers.get(&id).cloned() else {
            found.push(format!("{path}: {id} is not a keyed event"));
            continue;
        };
        let sequence: u64 = r.header("relay-webhook-sequence").parse().unwrap_or(0);
        if let Some(&first) = first_sequence.get(&id) {
            // A repeat of an event that arrived before: a kill's duplicate.
            if sequence != first {
                found.push(format!("{path} {key}: a repeat of {id} numbered {sequence}, first {first}"));
            }
            continue;
        }
        if let Some((last, last_n, last_sequence)) = latest.get(&key)
            && (n <= *last_n || sequence <= *last_sequence)
        {
            found.push(format!("{path} {key}: event {n} (sequence {sequence}) after {last} (event {last_n}, sequence {last_sequence})"));
        }
        first_sequence.insert(id.clone(), sequence);
        latest.insert(key, (id, n, sequence));
    }
    Ok(found)
}

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

/// A kill, when it happened and when the victim was started again, to
/// explain repeats.
#[derive(Debug, Clone, Copy)]
struct Kill {
    victim: Victim,
    at: Instant,
    back: Instant,
}

impl Kill {
    /// Whether this kill can have lost the outcome of `request`: its sender
    /// killed around its arrival, or the sender's api away while the
    /// outcome was being reported.
    fn lost(&self, request: &Arrival) -> bool {
        let sender = SOURCES.iter().position(|s| request.peer.ip().to_string() == *s);
        match self.victim {
            Victim::Dispatcher(i) => Some(i) == sender && self.at + READ_AFTER_KILL >= request.at && self.at <= request.at + OUTCOME_SPAN,
            Victim::Api(i) => Some(i) == sender && self.at <= request.at + OUTCOME_SPAN && self.back + API_START >= request.at,
            Victim::Broker => false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kill_9_of_apis_dispatchers_and_the_broker_loses_nothing() -> Result<()> {
    let seconds: u64 = std::env::var("RELAY_TORTURE_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let seed: u64 = std::env::var("RELAY_TORTURE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    println!("torture: {seconds} s of kills, RELAY_TORTURE_SEED={seed}");
    let mut rng = Rng::seeded(seed);

    let nats = PrivateNats::start().await?;
    let stack =
        Stack::start(Options { api: false, dispatcher: false, nats_url: nats.url(), endpoint_cap: 64, ..Options::default() }).await?;
    // Leases and ack waits short enough that a job lost in a crash comes
    // back within the test; quiet logs (the kills make the rest noisy).
    let api_env = |addrs: &relay_api::config::ListenAddrs| {
        let env = with(stack.api_env(), "RELAY_DELIVERY_LEASE_SECS", "10".into());
        let env = with(env, "RELAY_ATTEMPT_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_SEAM_TIMEOUT_MS", "2000".into());
        // Retries within the run (the production schedule waits minutes
        // from the fifth attempt on); seven attempts, as in production.
        let env = with(env, "RELAY_RETRY_TIERS", "0,500,1000,1000,1000,1000,1000".into());
        let env = with(env, "RELAY_LOG", "error,relay_api::relay::lost_events=warn".into());
        let env = with(env, "RELAY_GRPC_ADDR", addrs.grpc.to_string());
        let env = with(env, "RELAY_REST_ADDR", addrs.rest.to_string());
        with(env, "RELAY_INTERNAL_ADDR", addrs.internal.to_string())
    };
    let second = api_addrs().await?;
    let rest_urls = [stack.rest_url.clone(), format!("http://{}", second.rest)];
    let dispatcher_env = |internal: String, source: &str| {
        let env = with(stack.dispatcher_env(), "RELAY_API_INTERNAL_URL", internal);
        let env = with(env, "RELAY_DEV_SOURCE_ADDRESS", source.into());
        let env = with(env, "RELAY_ATTEMPT_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_SEAM_TIMEOUT_MS", "2000".into());
        with(env, "RELAY_LOG", "error,relay_dispatcher::consume=warn".into())
    };
    let mut fleet = Fleet {
        apis: vec![(api_env(&stack.addrs), None), (api_env(&second), None)],
        dispatchers: vec![
            (dispatcher_env(stack.internal_url.clone(), SOURCES[0]), None),
            (dispatcher_env(format!("https://127.0.0.1:{}", second.internal.port()), SOURCES[1]), None),
        ],
        nats,
    };
    for v in [Victim::Api(0), Victim::Api(1), Victim::Dispatcher(0), Victim::Dispatcher(1)] {
        fleet.start(v).await?;
    }
    stack.wait_for_api().await?;

    let tenant = stack.tenant_with_quota("torture", 7).await?;
    let receiver = Receiver::start().await?;
    let fails_first = Flaky::new(Behaviour::FailFirst(500));
    receiver.reply("/fails-first", Reply::Flaky(fails_first.clone()));
    receiver.reply("/slow", Reply::Flaky(Flaky::new(Behaviour::Slow(Duration::from_millis(100)))));
    receiver.reply("/fails-30", Reply::Flaky(Flaky::new(Behaviour::FailRandomly(30))));
    receiver.reply("/ordered-fails-30", Reply::Flaky(Flaky::new(Behaviour::FailRandomly(30))));
    let paths = ["/t1", "/t2", "/fails-first", "/slow", "/fails-30", "/ordered", "/ordered-fails-30"];
    let rest = relay_tests::Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for p in &paths[..5] {
        rest.endpoint(&receiver.url(p), &["t"]).await?;
    }
    for p in ORDERED {
        let (status, body) = rest
            .post(
                "/v1/webhooks",
                serde_json::json!({"url": receiver.url(p), "event_types": ["t"], "ordering": "per_key", "max_in_flight": 16}),
            )
            .await?;
        anyhow::ensure!(status == 201, "creating an ordered endpoint: {status} {body}");
    }

    // Publishers: each picks an api, publishes a fresh id, and retries that
    // same id (on either api) until it is answered 202; about 35 events a
    // second in all, which the failing endpoints' retries keep up with.
    let publishers = Publishers::start_keyed(4, &rest_urls, &tenant.api_key, "t", Pace::Random { seed, lo: 80, hi: 140 }, KEYS);

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
        let at = Instant::now();
        tokio::time::sleep(millis(&mut rng, 100, 1500)).await;
        fleet.start(victim).await?;
        kills.push(Kill { victim, at, back: Instant::now() });
    }
    let ledger = publishers.stop().await?;
    let killing = started.elapsed();

    // Settle: every accepted event at every endpoint, bounded; healthy
    // receivers, so every delivery ends delivered once its outcome lands,
    // and the outbox empties once claims of killed relays run out.
    let pg = stack.pg().await?;
    let settled = load::settle(&pg, &ledger, &receiver, &paths).await?;
    // Where the missing events wait, printed before the verdict: what the
    // broker holds for each consumer (pending, unacknowledged, redelivered).
    if !settled.all_arrived {
        let js = async_nats::jetstream::new(async_nats::connect(fleet.nats.url()).await?);
        let names = relay_contracts::StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
        for (stream, durable) in [(names.events_stream(), names.expand_durable()), (names.deliveries_stream(), names.deliver_durable())] {
            let mut st = js.get_stream(&stream).await?;
            let info = st.info().await?.clone();
            println!("DIAG stream {stream}: {:?}", info.state);
            let mut c: async_nats::jetstream::consumer::PullConsumer =
                st.get_consumer(&durable).await.map_err(|e| anyhow::anyhow!("{e}"))?;
            let ci = c.info().await?.clone();
            println!(
                "DIAG consumer {durable}: delivered {:?} ack_floor {:?} pending {} ack_pending {} redelivered {} waiting {}",
                ci.delivered, ci.ack_floor, ci.num_pending, ci.num_ack_pending, ci.num_redelivered, ci.num_waiting
            );
        }
    }
    let counted =
        load::account(&pg, &receiver, &paths, &settled.owed, |request, _| kills.iter().rev().find(|k| k.lost(request)).map(|k| k.victim))
            .await?;
    let (missing, unexplained) = (counted.missing, &counted.unexplained);
    let duplicates = counted.duplicates.values().sum::<usize>() + unexplained.len();
    let (pending, outbox, schedule_broken) = (settled.pending, settled.outbox, settled.schedule_broken);
    let by_kind = |f: fn(&Victim) -> bool| kills.iter().filter(|k| f(&k.victim)).count();
    // Kills of a dispatcher while it had a retry in hand: a retry of the
    // fails-first endpoint arrived from it just before.
    let retries_seen: Vec<Arrival> =
        load::requests(&receiver, "/fails-first").into_values().flat_map(|seen| seen.into_iter().skip(1)).collect();
    let kills_mid_retry = kills
        .iter()
        .filter(|k| matches!(k.victim, Victim::Dispatcher(_)))
        .filter(|k| retries_seen.iter().any(|r| k.lost(r) && r.at <= k.at))
        .count();
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries").fetch_one(&pg).await?;
    let mut violations = Vec::new();
    for path in ORDERED {
        violations.extend(order_violations(&pg, &receiver, path).await?);
    }
    println!(
        "torture: {:.0} s, kills: {} api, {} dispatcher ({kills_mid_retry} with a retry in hand), {} broker; events accepted {} (+{} stored unanswered, {} publish retries); \
         deliveries {deliveries}, retries {}, dead-lettered after every attempt failed {}; missing {missing}; \
         duplicates {duplicates} ({} unexplained); attempts recorded but never seen {}; attempt logs broken {schedule_broken}; \
         not settled {pending}; outbox left {outbox}; order violations {}; every owed event arrived {:.1} s and all settled {:.1} s after the last kill",
        killing.as_secs_f64(),
        by_kind(|v| matches!(v, Victim::Api(_))),
        by_kind(|v| matches!(v, Victim::Dispatcher(_))),
        by_kind(|v| matches!(v, Victim::Broker)),
        ledger.accepted.len(),
        settled.stored_unconfirmed,
        ledger.retries,
        counted.retries,
        settled.dead_lettered,
        unexplained.len(),
        counted.unseen.len(),
        violations.len(),
        settled.arrived_after.as_secs_f64(),
        settled.quiet_after.as_secs_f64(),
    );
    let killing_ended = started + killing;
    for (path, by_attempts) in &counted.attempts {
        let last = load::arrivals(&receiver, path).values().filter_map(|t| t.iter().min().copied()).max();
        let after = last.map_or(0.0, |t| t.saturating_duration_since(killing_ended).as_secs_f64());
        println!(
            "torture: {path}: (attempts recorded, pairs) {by_attempts:?}; its last event first arrived {after:.1} s after the last kill"
        );
    }
    // The schedule, for reading a failure against: which process went down
    // when, and for how long (seconds since the killing began).
    let schedule: Vec<String> = kills
        .iter()
        .map(|k| {
            let at = k.at.saturating_duration_since(started).as_secs_f64();
            format!("{:?}@{at:.1}+{:.1}", k.victim, k.back.saturating_duration_since(k.at).as_secs_f64())
        })
        .collect();
    println!("torture: kills {}", schedule.join(" "));
    let mut explained: Vec<(String, usize)> = counted.duplicates.iter().map(|(v, n)| (format!("{v:?}"), *n)).collect();
    explained.sort();
    println!("torture: repeats by the kill that explains them: {explained:?}");
    anyhow::ensure!(!ledger.accepted.is_empty() && !kills.is_empty(), "the run published and killed nothing");
    anyhow::ensure!(settled.all_arrived && missing == 0, "{missing} (event, endpoint) pairs never arrived (seed {seed})");
    anyhow::ensure!(violations.is_empty(), "order violations (seed {seed}): {:?}", &violations[..violations.len().min(10)]);
    anyhow::ensure!(unexplained.is_empty(), "repeats no kill explains (seed {seed}): {:?}", &unexplained[..unexplained.len().min(10)]);
    anyhow::ensure!(
        counted.unseen.is_empty(),
        "attempts recorded that never arrived (seed {seed}): {:?}",
        &counted.unseen[..counted.unseen.len().min(10)]
    );
    anyhow::ensure!(
        settled.quiet && pending == 0 && outbox == 0,
        "{pending} deliveries unsettled, {outbox} events unpublished (seed {seed})"
    );
    anyhow::ensure!(schedule_broken == 0, "{schedule_broken} deliveries' attempt logs are not attempts 1..=n once each (seed {seed})");
    let healthy_retried: usize = ["/t1", "/t2", "/slow"]
        .iter()
        .map(|p| counted.attempts.get(*p).map_or(0, |m| m.iter().filter(|(n, _)| **n != 1).map(|(_, c)| c).sum()))
        .sum();
    anyhow::ensure!(
        healthy_retried == 0,
        "{healthy_retried} deliveries to receivers that always answer 200 took other than one attempt (seed {seed})"
    );
    let first_tried = counted.attempts.get("/fails-first").cloned().unwrap_or_default();
    anyhow::ensure!(
        first_tried.keys().all(|n| *n == 2 || *n == 1),
        "the fails-first endpoint's deliveries took {first_tried:?} attempts: each needs its retry, and one more only if a kill repeated the first (seed {seed})"
    );
    anyhow::ensure!(
        settled.dead_lettered
            <= ["/fails-30", "/ordered-fails-30"]
                .iter()
                .map(|p| counted.attempts.get(*p).map_or(0, |m| m.get(&7).copied().unwrap_or(0)) as i64)
                .sum::<i64>(),
        "dead letters beyond the random endpoints' seven-times-failed deliveries (seed {seed})"
    );
    pg.close().await;

    for v in [Victim::Dispatcher(0), Victim::Dispatcher(1), Victim::Api(0), Victim::Api(1)] {
        fleet.kill(v).await?;
    }
    stack.stop().await.context("the state machine's invariants")?;
    fleet.nats.stop().await
}
