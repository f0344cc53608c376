//! The circuit never costs a delivery the retry schedule would have made:
//! the same receivers, each getting the same events, behind two stacks run
//! side by side — one with the circuit, one without (`RELAY_DEV_CIRCUIT_OFF`,
//! the plain retry schedule) — and for each receiver that works with a fair
//! probability, every delivery ends as the schedule decides (delivered if
//! any of its attempts got a 2xx, else dead after all seven) and the p99
//! time to arrival with the circuit is within 1.2× of the run without it.
//! A receiver that fails everything is contained: its circuit opens, it
//! gets a fraction of the requests, and the healthy receiver beside it is
//! no slower than without the circuit.
//!
//! The circuit runs production's rule (2 minutes, 20 attempts, 90 %, 30 s
//! without a success, 5 failed retries) over a compressed schedule (0, 0.5,
//! 1, 2, 4, 4, 4 s), so the real-time behaviours (a 10 s cold start, a 1 s
//! `Retry-After`) relate to the rule as they would in production.
//! `RELAY_MATRIX_EVENTS` (default 2,000) and `RELAY_MATRIX_SECONDS` (the
//! publishing span, default 40) size a run; the table is printed.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{StreamExt, TryStreamExt};
use relay_tests::{
    Options, Receiver, Reply, Rest, Stack,
    flaky::{Answered, Behaviour, Flaky},
};
use serde_json::json;

/// The receivers, by path.
fn receivers() -> Vec<(&'static str, Behaviour)> {
    let s = Duration::from_secs;
    vec![
        ("healthy", Behaviour::FailRandomly(0)),
        ("fails-first", Behaviour::FailFirst(500)),
        ("fails-50", Behaviour::FailRandomly(50)),
        ("fails-80", Behaviour::FailRandomly(80)),
        ("429-bursts", Behaviour::ThrottleInBursts { every: s(5), burst: s(1) }),
        ("cold-start", Behaviour::ColdStart { idle: s(60), for_: s(10) }),
        ("times-out-20", Behaviour::TimeOut { percent: 20, hold: Duration::from_millis(600) }),
        ("fails-all", Behaviour::AlwaysFail(500)),
    ]
}

const TIERS: &str = "0,500,1000,2000,4000,4000,4000";
/// Long enough for an answer on a loaded machine, short enough that a
/// fifth of 2,000 requests timing out one at a time stays within a minute.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(300);

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One side of the matrix: a stack, its tenant and receivers.
struct Side {
    name: &'static str,
    stack: Stack,
    rest: Rest,
    endpoints: Vec<(&'static str, String, Arc<Flaky>)>,
    published: Vec<(String, Instant)>,
}

async fn side(name: &'static str, opts: Options) -> anyhow::Result<Side> {
    let stack = Stack::start(opts).await?;
    let tenant = stack.tenant_with_quota(name, 20).await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let mut endpoints = Vec::new();
    for (path, behaviour) in receivers() {
        let flaky = Flaky::new(behaviour);
        receiver.reply(&format!("/{path}"), Reply::Flaky(flaky.clone()));
        let (id, _) = rest.endpoint(&receiver.url(&format!("/{path}")), &["matrix.event"]).await?;
        endpoints.push((path, id, flaky));
    }
    Ok(Side { name, stack, rest, endpoints, published: Vec::new() })
}

/// What one receiver saw of one side's run.
#[derive(Debug, Default)]
struct Row {
    events: usize,
    delivered: usize,
    requests: usize,
    /// ms from publishing to the request that was answered 2xx in time.
    times: Vec<u64>,
    /// Events whose every request failed, as the receiver saw them.
    failed_everywhere: usize,
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// A request the dispatcher heard a 2xx for in time.
fn succeeded(a: &Answered) -> bool {
    (200..300).contains(&a.answer.status) && a.answer.after < ATTEMPT_TIMEOUT
}

fn row(published: &HashMap<String, Instant>, log: &[Answered]) -> Row {
    let mut first_success: HashMap<&str, Instant> = HashMap::new();
    for a in log.iter().filter(|a| succeeded(a)) {
        first_success.entry(a.id.as_str()).or_insert(a.at);
    }
    let mut times: Vec<u64> =
        first_success.iter().filter_map(|(id, at)| Some(at.saturating_duration_since(*published.get(*id)?).as_millis() as u64)).collect();
    times.sort_unstable();
    Row {
        events: published.len(),
        delivered: first_success.len(),
        requests: log.len(),
        times,
        failed_everywhere: published.len() - first_success.len(),
    }
}

/// Every delivery of the endpoint ended as the schedule decides: delivered
/// where a request got a 2xx, else dead after its seven attempts; nothing
/// pending or held. Returns (delivered, dead, still open).
async fn settled(side: &Side, endpoint: &str) -> anyhow::Result<(i64, i64, i64)> {
    let pg = side.stack.pg().await?;
    let counts: (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'delivered'), count(*) FILTER (WHERE state = 'dead' AND attempt = 7),
                count(*) FILTER (WHERE state IN ('pending', 'held'))
         FROM webhook_deliveries WHERE endpoint_id = $1::uuid",
    )
    .bind(endpoint)
    .fetch_one(&pg)
    .await?;
    pg.close().await;
    Ok(counts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_circuit_never_costs_a_delivery_the_retry_schedule_would_have_made() -> anyhow::Result<()> {
    let events = setting("RELAY_MATRIX_EVENTS", 2_000) as usize;
    let span = Duration::from_secs(setting("RELAY_MATRIX_SECONDS", 40));
    let opts = || {
        let mut o = Options { attempt_timeout: ATTEMPT_TIMEOUT, endpoint_cap: 64, ..Options::default() }.tiers(TIERS);
        // Production's rule; probes from 10 s, backing off to 20 s within a run.
        o.circuit = relay_domain::health::CircuitPolicy::production(Duration::ZERO);
        o.circuit.max_probe = Duration::from_secs(20);
        o
    };
    let mut sides = [side("circuit-on", opts()).await?, side("circuit-off", opts().circuit_off()).await?];

    // The same events to both sides, paced over the span, a few publishes
    // in flight at a time. `fate` keys the receivers' random failures, so
    // the two sides meet the same ones.
    let started = Instant::now();
    let published: Vec<[(String, Instant); 2]> = futures::stream::iter(0..events)
        .map(|n| {
            let rests = [&sides[0].rest, &sides[1].rest];
            async move {
                tokio::time::sleep_until((started + span.mul_f64(n as f64 / events as f64)).into()).await;
                let payload = json!({"fate": n, "pad": "x".repeat(200)});
                let publish = |rest: &Rest| {
                    let payload = payload.clone();
                    let rest = Rest { base: rest.base.clone(), key: rest.key.clone(), http: rest.http.clone() };
                    async move {
                        let at = Instant::now();
                        anyhow::Ok((rest.publish("matrix.event", payload).await?, at))
                    }
                };
                let (on, off) = futures::try_join!(publish(rests[0]), publish(rests[1]))?;
                anyhow::Ok([on, off])
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    for [on, off] in published {
        sides[0].published.push(on);
        sides[1].published.push(off);
    }
    let publishing = started.elapsed();

    // Settle: every side's non-failing receivers have every delivery ended
    // (the schedule is 11.5 s long; a backlog behind a slow receiver drains).
    let deadline = Instant::now() + Duration::from_secs(240);
    for side in &sides {
        for (path, endpoint, _) in &side.endpoints {
            // Without the circuit, a receiver that fails everything takes
            // seven attempts an event, one at a time: not waited for.
            if *path == "fails-all" {
                continue;
            }
            loop {
                let (delivered, dead, open) = settled(side, endpoint).await?;
                if delivered + dead == events as i64 && open == 0 {
                    break;
                }
                assert!(Instant::now() < deadline, "{} {path}: {delivered} delivered, {dead} dead, {open} open", side.name);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }

    let mut table = vec![format!(
        "{} events over {:.1} s per side; schedule {TIERS} ms; attempt timeout {} ms",
        events,
        publishing.as_secs_f64(),
        ATTEMPT_TIMEOUT.as_millis()
    )];
    table.push(format!(
        "{:<13} {:>15} {:>15} {:>19} {:>19} {:>17}",
        "receiver", "delivered on", "delivered off", "p50 ms on/off", "p99 ms on/off", "requests on/off"
    ));
    let mut failures = Vec::new();
    let rows: Vec<HashMap<&str, (Row, String)>> = sides
        .iter()
        .map(|side| {
            let published: HashMap<String, Instant> = side.published.iter().cloned().collect();
            side.endpoints.iter().map(|(path, endpoint, flaky)| (*path, (row(&published, &flaky.log()), endpoint.clone()))).collect()
        })
        .collect();
    for (path, _) in receivers() {
        let (on, off) = (&rows[0][path].0, &rows[1][path].0);
        let (p99_on, p99_off) = (percentile(&on.times, 0.99), percentile(&off.times, 0.99));
        table.push(format!(
            "{:<13} {:>15} {:>15} {:>19} {:>19} {:>17}",
            path,
            format!("{}/{}", on.delivered, on.events),
            format!("{}/{}", off.delivered, off.events),
            format!("{}/{}", percentile(&on.times, 0.5), percentile(&off.times, 0.5)),
            format!("{p99_on}/{p99_off}"),
            format!("{}/{}", on.requests, off.requests),
        ));
        if path == "fails-all" {
            continue;
        }
        // Every delivery as the schedule decides, on both sides.
        for (side, (r, endpoint)) in sides.iter().zip([&rows[0][path], &rows[1][path]]) {
            let (delivered, dead, open) = settled(side, endpoint).await?;
            if (delivered, dead, open) != (r.delivered as i64, r.failed_everywhere as i64, 0) {
                failures.push(format!(
                    "{} {path}: the database says {delivered} delivered, {dead} dead after 7, {open} open; the receiver saw {} succeed, {} never",
                    side.name, r.delivered, r.failed_everywhere
                ));
            }
        }
        // Only a receiver that fails at random can leave an event with no
        // request answered: seven failures in a row.
        if !path.starts_with("fails-") && (on.failed_everywhere > 0 || off.failed_everywhere > 0) {
            failures.push(format!("{path}: events with no successful request: {} on, {} off", on.failed_everywhere, off.failed_everywhere));
        }
        // 1.2×, and 50 ms for timer noise where p99 is a few hundred ms.
        if p99_on as f64 > 1.2 * p99_off as f64 + 50.0 {
            failures.push(format!("{path}: p99 {p99_on} ms with the circuit, {p99_off} ms without"));
        }
    }
    // The receiver that fails everything: contained.
    let on_dead = &rows[0]["fails-all"];
    let pg = sides[0].stack.pg().await?;
    let (circuit, held): (String, i64) = sqlx::query_as(
        "SELECT h.circuit, (SELECT count(*) FROM webhook_deliveries d WHERE d.endpoint_id = h.endpoint_id AND d.state = 'held')
         FROM endpoint_health h WHERE h.endpoint_id = $1::uuid",
    )
    .bind(&on_dead.1)
    .fetch_one(&pg)
    .await?;
    pg.close().await;
    let off_dead = &rows[1]["fails-all"].0;
    table.push(format!(
        "fails-all with the circuit: {circuit}, {held} held, {} requests (without: {})",
        on_dead.0.requests, off_dead.requests
    ));
    for line in &table {
        println!("{line}");
    }
    if !matches!(circuit.as_str(), "open" | "half_open") || held == 0 {
        failures.push(format!("fails-all: the circuit is {circuit} with {held} held"));
    }
    if on_dead.0.requests * 2 > off_dead.requests {
        failures.push(format!("fails-all: {} requests with the circuit, {} without", on_dead.0.requests, off_dead.requests));
    }
    assert!(failures.is_empty(), "{}\n{}", failures.join("\n"), table.join("\n"));
    for side in sides {
        side.stack.stop().await?;
    }
    Ok(())
}
