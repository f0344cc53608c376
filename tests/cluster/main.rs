//! The local production cluster under faults (issue 14): a 3-node NATS
//! cluster with both streams replicated ×3, a Postgres primary with a
//! synchronous streaming standby, two apis and two dispatchers as real
//! processes, a receiver with four endpoints. Under a steady publish load
//! (each event retried with the same id until it is answered 202), one
//! fault after another:
//!
//! 1. kill -9 the NATS node leading `DELIVERIES`, later restart it;
//! 2. kill -9 another node (not the leader then), later restart it;
//! 3. stop the Postgres primary as a crash would and promote the standby;
//! 4. kill -9 one api and one dispatcher (the survivors carry on).
//!
//! Then: every accepted event at every endpoint, every duplicate attributed
//! to a fault, nothing left pending, and per fault how long publishing and
//! delivery stalled. `RELAY_CLUSTER_PHASE_SECS` (default 4) is how long the
//! load runs between two steps; `RELAY_CLUSTER_RATE` (default 20) the events
//! per second offered. `deploy/local/cluster test` runs a long one.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use relay_contracts::StreamNames;
use relay_tests::{
    NatsCluster, Options, PrivatePostgres, Process, Receiver, Stack, api_addrs,
    load::{self, Pace, Publishers, with},
};
use uuid::Uuid;

const PATHS: [&str; 4] = ["/c1", "/c2", "/c3", "/c4"];

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A fault, and when it was made.
#[derive(Debug, Clone)]
struct Fault {
    what: String,
    at: Instant,
    /// The same moment on the wall clock, to find it in the logs.
    wall: chrono::DateTime<chrono::Utc>,
}

impl Fault {
    fn now(what: impl Into<String>) -> Self {
        Self { what: what.into(), at: Instant::now(), wall: chrono::Utc::now() }
    }
}

/// The longest wait, from `from`, for the next of `times` (sorted), within
/// `[from, to]`: how long the stream of instants stalled after a fault, up
/// to the next step (a wait running past `to` is the next step's to count).
fn longest_gap(times: &[Instant], from: Instant, to: Instant) -> Duration {
    let mut last = from;
    let mut gap = Duration::ZERO;
    for &t in times.iter().filter(|&&t| t > from) {
        gap = gap.max(t.min(to) - last);
        if t >= to {
            return gap;
        }
        last = t;
    }
    gap.max(to.saturating_duration_since(last))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_loses_a_broker_leader_a_broker_node_its_postgres_primary_an_api_and_a_dispatcher_and_nothing() -> Result<()> {
    let phase = Duration::from_secs(setting("RELAY_CLUSTER_PHASE_SECS", 4));
    let rate = setting("RELAY_CLUSTER_RATE", 20).max(1);
    println!("cluster: {} s between steps, {rate} events/s offered to 2 apis, {} endpoints", phase.as_secs(), PATHS.len());

    // The engines.
    let mut nats = NatsCluster::start().await?;
    let primary = PrivatePostgres::synchronous_primary().await?;
    let standby = PrivatePostgres::standby_of(&primary).await?;
    primary.wait_for_synchronous_standby().await?;
    let mut stack = Stack::start(Options {
        api: false,
        dispatcher: false,
        nats_url: nats.url(),
        stream_replicas: 3,
        pg_port: primary.port,
        standby_pg_port: Some(standby.port),
        endpoint_cap: 64,
        ..Options::default()
    })
    .await?;

    // Two apis and two dispatchers as processes; each dispatcher calls its
    // own api first and the other after a failure.
    let second = api_addrs().await?;
    let api_env = |addrs: &relay_api::config::ListenAddrs| {
        let env = with(stack.api_env(), "RELAY_DELIVERY_LEASE_SECS", "10".into());
        let env = with(env, "RELAY_ATTEMPT_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_SEAM_TIMEOUT_MS", "2000".into());
        let env = with(env, "RELAY_GRPC_ADDR", addrs.grpc.to_string());
        let env = with(env, "RELAY_REST_ADDR", addrs.rest.to_string());
        with(env, "RELAY_INTERNAL_ADDR", addrs.internal.to_string())
    };
    let internal = [stack.internal_url.clone(), format!("https://127.0.0.1:{}", second.internal.port())];
    let rest_urls = [stack.rest_url.clone(), format!("http://{}", second.rest)];
    let dispatcher_env = |apis: String| {
        let env = with(stack.dispatcher_env(), "RELAY_API_INTERNAL_URL", apis);
        let env = with(env, "RELAY_ATTEMPT_TIMEOUT_MS", "2000".into());
        with(env, "RELAY_SEAM_TIMEOUT_MS", "2000".into())
    };
    // Each process logs (at the services' default level) to a file of its own.
    let logs = std::env::temp_dir().join(format!("relay-cluster-{}", &stack.prefix));
    std::fs::create_dir_all(&logs)?;
    println!("cluster: the processes' logs are in {}", logs.display());
    let spawn = |name: &str, env: Vec<(&'static str, String)>, log: &str| {
        Process::spawn_logging_to(name, &with(env, "RELAY_LOG", "info".into()), &logs.join(log))
    };
    let mut apis = [Some(spawn("relay-api", api_env(&stack.addrs), "api1.log")?), Some(spawn("relay-api", api_env(&second), "api2.log")?)];
    let mut dispatchers = [
        Some(spawn("relay-dispatcher", dispatcher_env(format!("{},{}", internal[0], internal[1])), "dispatcher1.log")?),
        Some(spawn("relay-dispatcher", dispatcher_env(format!("{},{}", internal[1], internal[0])), "dispatcher2.log")?),
    ];
    stack.wait_for_api().await?;
    let tenant = stack.tenant("cluster").await?;
    let receiver = Receiver::start().await?;
    let rest = relay_tests::Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for p in PATHS {
        rest.endpoint(&receiver.url(p), &["c"]).await?;
    }

    // Publishers: paced, each event retried (on either api) until 202.
    let publishers_n = 4u64;
    let publishers = Publishers::start(
        publishers_n,
        &rest_urls,
        &tenant.api_key,
        "c",
        Pace::Every(Duration::from_secs_f64(publishers_n as f64 / rate as f64)),
    );

    // The faults, a phase of load apart.
    let names = StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
    let deliveries_stream = names.deliveries_stream();
    let assets = [
        (names.events_stream(), None),
        (names.events_stream(), Some(names.expand_durable())),
        (names.deliveries_stream(), None),
        (names.deliveries_stream(), Some(names.deliver_durable())),
    ];
    let prefix = stack.prefix.clone();
    // What a node leads, for the fault's label (without the test's prefix).
    let leads = async |nats: &NatsCluster, node: usize| -> String {
        match nats.leadership(&assets).await {
            Ok(led) if led[node].is_empty() => "leads nothing".into(),
            Ok(led) => format!("leads {}", led[node].iter().map(|a| a.trim_start_matches(&prefix)).collect::<Vec<_>>().join(", ")),
            Err(e) => format!("leadership unknown: {e}"),
        }
    };
    let mut faults: Vec<Fault> = Vec::new();
    let started = Instant::now();
    tokio::time::sleep(phase).await;

    let leader = nats.leader_of(&deliveries_stream).await?;
    let label = format!("kill -9 NATS n{} ({})", leader + 1, leads(&nats, leader).await);
    nats.nodes[leader].kill9().await?;
    faults.push(Fault::now(label));
    tokio::time::sleep(phase).await;
    nats.nodes[leader].resume().await?;
    faults.push(Fault::now(format!("restart NATS n{}", leader + 1)));
    tokio::time::sleep(phase).await;

    let now_leading = nats.leader_of(&deliveries_stream).await?;
    let other = (0..3).find(|&i| i != now_leading && i != leader).unwrap_or((now_leading + 1) % 3);
    let label = format!("kill -9 NATS n{} ({})", other + 1, leads(&nats, other).await);
    nats.nodes[other].kill9().await?;
    faults.push(Fault::now(label));
    tokio::time::sleep(phase).await;
    nats.nodes[other].resume().await?;
    faults.push(Fault::now(format!("restart NATS n{}", other + 1)));
    tokio::time::sleep(phase).await;

    primary.crash()?;
    faults.push(Fault::now("Postgres primary stopped (-m immediate)"));
    standby.promote()?;
    faults.push(Fault::now("standby promoted (pg_ctl promote)"));
    stack.db.moved_to(standby.port);
    tokio::time::sleep(phase).await;

    if let Some(p) = apis[0].take() {
        p.kill9().await?;
    }
    if let Some(p) = dispatchers[1].take() {
        p.kill9().await?;
    }
    faults.push(Fault::now("kill -9 api 1 and dispatcher 2"));
    tokio::time::sleep(phase).await;

    let ledger = publishers.stop().await?;
    let loaded = started.elapsed();

    // Settle: every owed event at every endpoint and nothing pending, bounded.
    let pg = stack.pg().await?;
    let settled = load::settle(&pg, &ledger, &receiver, &PATHS).await?;
    let marks: Vec<(String, Instant)> = faults.iter().map(|f| (f.what.clone(), f.at)).collect();
    // Every node here sends from the same address, so a repeat is given to
    // the latest fault between its first copy (less an attempt's span) and
    // the next copy.
    let counted = load::account(&pg, &receiver, &PATHS, &settled.owed, |first, next| {
        marks.iter().rev().find(|(_, at)| *at + Duration::from_secs(3) >= first.at && *at <= next.at).map(|(what, _)| what.clone())
    })
    .await?;
    let (owed, accepted) = (&settled.owed, &ledger.accepted);
    let arrivals = |path: &str| load::arrivals(&receiver, path);

    // Per fault: how long publishing and delivery stalled after it.
    let mut accepts: Vec<Instant> = accepted.values().copied().collect();
    accepts.sort();
    let mut arrived: Vec<Instant> = receiver.received().iter().map(|r| r.at).collect();
    arrived.sort();
    // An event's latency: from its 202 to its arrival at the last endpoint.
    let firsts: Vec<HashMap<String, Instant>> =
        PATHS.iter().map(|p| arrivals(p).into_iter().filter_map(|(id, t)| Some((id, *t.iter().min()?))).collect()).collect();
    let latency = |id: &Uuid, at: Instant| -> Option<Duration> {
        let id = id.to_string();
        firsts.iter().map(|m| m.get(&id).map(|&t| t.saturating_duration_since(at))).collect::<Option<Vec<_>>>()?.into_iter().max()
    };
    // Where the slowest events waited: accepted → published to EVENTS →
    // expanded → first attempt logged (seconds, from the database's clocks).
    let mut slow: Vec<(Duration, Uuid)> = accepted.iter().filter_map(|(id, &at)| Some((latency(id, at)?, *id))).collect();
    slow.sort();
    for (took, id) in slow.iter().rev().take(3).filter(|(took, _)| *took > Duration::from_secs(2)) {
        let stages: (Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
            "SELECT extract(epoch FROM e.published_at - e.created_at)::float8,
                    extract(epoch FROM (SELECT max(d.created_at) FROM webhook_deliveries d WHERE d.event_id = e.id) - e.created_at)::float8,
                    extract(epoch FROM (SELECT max(a.attempted_at) FROM delivery_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id
                                        WHERE d.event_id = e.id AND a.attempt = 1) - e.created_at)::float8
             FROM events e WHERE e.id = $1",
        )
        .bind(id)
        .fetch_one(&pg)
        .await?;
        println!(
            "cluster: slow event {id}: {:.2} s to its last endpoint; marked published +{:.2} s, expanded +{:.2} s, last first attempt logged +{:.2} s",
            took.as_secs_f64(),
            stages.0.unwrap_or(f64::NAN),
            stages.1.unwrap_or(f64::NAN),
            stages.2.unwrap_or(f64::NAN)
        );
    }
    pg.close().await;
    // Every receiver answers 200: one attempt per delivery.
    let retried: usize = counted.attempts.values().flat_map(|m| m.iter().filter(|(n, _)| **n != 1).map(|(_, c)| *c)).sum();
    println!(
        "cluster: {:.0} s of load; events accepted {} (+{} stored but unanswered; {} publish tries refused or lost); \
         deliveries expected {}, delivered {}, missing {}; duplicates {} ({} unattributed); \
         attempt logs broken {}; deliveries that took more than one attempt {}; not delivered {}; outbox left {}; every owed event arrived {:.1} s and the \
         last state changed {:.1} s after the load",
        loaded.as_secs_f64(),
        accepted.len(),
        settled.stored_unconfirmed,
        ledger.retries,
        owed.len() * PATHS.len(),
        counted.delivered,
        counted.missing,
        counted.duplicates.values().sum::<usize>() + counted.unexplained.len(),
        counted.unexplained.len(),
        settled.schedule_broken,
        retried,
        settled.pending,
        settled.outbox,
        settled.arrived_after.as_secs_f64(),
        settled.quiet_after.as_secs_f64(),
    );
    let (from, to) = (started + Duration::from_secs(1), faults[0].at);
    let before = |times: &[Instant]| longest_gap(times, from, to);
    println!(
        "cluster: before any fault: longest gap between accepted publishes {:.2} s, between arrivals {:.2} s",
        before(&accepts).as_secs_f64(),
        before(&arrived).as_secs_f64(),
    );
    for (i, f) in faults.iter().enumerate() {
        let until = faults.get(i + 1).map(|n| n.at).unwrap_or(f.at + phase);
        let slowest = accepted.iter().filter(|&(_, &at)| at >= f.at && at < until).filter_map(|(id, &at)| latency(id, at)).max();
        println!(
            "cluster: {} {:<60} publishing stalled {:>5.2} s, delivery stalled {:>5.2} s, slowest event accepted before the next step {:>5.2} s; duplicates {}",
            f.wall.format("%H:%M:%S%.3f"),
            f.what,
            longest_gap(&accepts, f.at, until).as_secs_f64(),
            longest_gap(&arrived, f.at, until).as_secs_f64(),
            slowest.unwrap_or_default().as_secs_f64(),
            counted.duplicates.get(&f.what).copied().unwrap_or(0),
        );
    }

    let (missing, unattributed) = (counted.missing, &counted.unexplained);
    let (pending, outbox, schedule_broken) = (settled.pending, settled.outbox, settled.schedule_broken);
    anyhow::ensure!(accepted.len() as u64 >= rate, "the run accepted only {} events", accepted.len());
    anyhow::ensure!(settled.all_arrived && missing == 0, "{missing} (event, endpoint) pairs never arrived");
    anyhow::ensure!(unattributed.is_empty(), "duplicates no fault explains: {:?}", &unattributed[..unattributed.len().min(10)]);
    anyhow::ensure!(settled.quiet && pending == 0 && outbox == 0, "{pending} deliveries undelivered, {outbox} events unpublished");
    anyhow::ensure!(
        schedule_broken == 0 && retried == 0,
        "{schedule_broken} attempt logs broken, {retried} deliveries took more than one attempt"
    );

    for p in apis.iter_mut().chain(dispatchers.iter_mut()) {
        if let Some(p) = p.take() {
            p.kill9().await?;
        }
    }
    stack.stop().await.context("the state machine's invariants")?;
    if std::env::var_os("RELAY_CLUSTER_KEEP_LOGS").is_none() {
        let _ = std::fs::remove_dir_all(&logs);
    }
    Ok(())
}
