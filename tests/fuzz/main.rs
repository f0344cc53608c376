//! A bounded mutational fuzzer over every REST route.
//!
//! The routes come from `docs/openapi.json`, read when the test runs, so a
//! new route is fuzzed without touching this file. Against a real stack with
//! real ids (two tenants, their endpoints, events and a dead letter), each
//! route gets a valid request, and `RELAY_FUZZ_REQUESTS` (default 3000)
//! mutated copies of such requests are sent as raw HTTP/1.1 bytes, each on a
//! fresh connection, by eight workers, so that no client library tidies
//! anything up. Every answer must be below 500; every refusal the JSON error
//! `{code, reason, message}` with a short message; every success JSON; and
//! no success may come without a valid key or for the other tenant's id.
//! Afterwards the api must still be ready and accept a publish, and the
//! database invariants must hold.
//!
//! The mutations of request `i` depend only on the seed (`RELAY_FUZZ_SEED`,
//! printed at the start) and `i`. The ids they start from may differ between
//! runs — ids the api hands out join the pools as they arrive — so every
//! failure is reported with the exact bytes that caused it.
//!
//! The portal's pages and forms, which share the REST port, are fuzzed the
//! same way by [`portal`], with mutations of their own (sessions, CSRF
//! tokens, hostile form and query values, slow and unfinished bodies).

mod exchange;
mod judge;
mod mutations;
mod mutations_raw;
mod portal;
mod portal_values;
mod request;
mod routes;

use exchange::*;
use judge::*;
use mutations::*;
use mutations_raw::*;
use request::*;
use routes::*;

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use relay_tests::{Options, Receiver, Reply, Rest, Rng, Stack};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use uuid::Uuid;

const DEFAULT_SEED: u64 = 0x5eed_f022_2026;
const DEFAULT_REQUESTS: usize = 3000;
/// Enough to keep the api busy on two cores without queueing behind ourselves.
const WORKERS: usize = 8;
/// How long one exchange may take. Only a few mutations are meant to make the
/// server wait (a declared length the body never reaches, on a connection
/// left open); anything else that takes this long is reported as a hang.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(3);
const MAX_REPORTED: usize = 20;
const EXCERPT_BYTES: usize = 300;
/// Ids kept per tenant and kind for filling paths.
const POOL_CAP: usize = 64;

/// Each fuzz starts a stack of its own and keeps the api busy from eight
/// workers: two at once on two cores would time each other out.
static ONE_FUZZ_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------
// The deterministic generator (`relay_tests::Rng`), with what this file adds.

/// The stream of request `index`, whichever worker sends it.
fn rng_for_request(seed: u64, index: usize) -> Rng {
    let mut r = Rng::seeded(seed ^ (index as u64).wrapping_mul(0xd1b5_4a32_d192_ed03));
    r.next_u64();
    r
}

trait RandomIds {
    fn uuid(&mut self) -> String;
}

impl RandomIds for Rng {
    fn uuid(&mut self) -> String {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes).into_uuid().to_string()
    }
}

fn seed_from_env() -> u64 {
    let Ok(text) = std::env::var("RELAY_FUZZ_SEED") else { return DEFAULT_SEED };
    let text = text.trim();
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    };
    parsed.unwrap_or_else(|| panic!("RELAY_FUZZ_SEED={text:?} is not a number (decimal or 0x hex)"))
}

// ---------------------------------------------------------------------------
// The routes, as the published spec lists them.

/// Sends one request and records what came of it.
async fn run_one(judge: &impl Judge, report: &Mutex<Report>, index: &str, req: &Req) {
    let world = judge.world();
    let wire = req.wire();
    let outcome = exchange(world.addr, &wire, req.method == "HEAD", judge.limit()).await;
    // Checked before the report is locked: a timeout asks the api if it lives.
    let alive_after_timeout = match outcome {
        Outcome::TimedOut => Some(ready(world.addr).await),
        _ => None,
    };
    let lock = || report.lock().expect("the report is never poisoned");
    match outcome {
        Outcome::Answered(a) => {
            let found = judge.problems(req, &a);
            let cross = judge.caller(req).and_then(|caller| foreign_id(req, world, caller)).is_some();
            judge.learn(req, &a);
            let mut r = lock();
            r.sent += 1;
            r.cross_tenant += usize::from(cross);
            if let Some(reason) = serde_json::from_slice::<Value>(&a.body).ok().and_then(|v| v["reason"].as_str().map(str::to_owned)) {
                *r.reasons.entry(reason).or_default() += 1;
            }
            *r.statuses.entry(a.status).or_default() += 1;
            for p in found {
                r.fail(&p, index, req, &wire, Some(&a));
            }
        }
        Outcome::Silent(why) => {
            let mut r = lock();
            r.sent += 1;
            r.silent += 1;
            r.fail(&format!("no answer ({why})"), index, req, &wire, None);
        }
        Outcome::TimedOut => {
            let mut r = lock();
            r.sent += 1;
            r.timeouts += 1;
            if alive_after_timeout == Some(false) {
                r.fail("no answer, and /readyz no longer answers 200", index, req, &wire, None);
            } else if judge.timeout_fails() {
                r.fail(&format!("no answer within {:?}", judge.limit()), index, req, &wire, None);
            } else if !wire.may_hang && r.hangs.len() < MAX_REPORTED {
                r.hangs.push(format!("{index} {} [{}]: {}", req.route, req.applied.join(", "), excerpt(&wire.bytes)));
            }
        }
    }
}

// ---------------------------------------------------------------------------

/// How many mutated requests to send: `var` when set, else `default`.
fn requests_from_env(var: &str, default: usize) -> usize {
    match std::env::var(var) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{var}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// A real stack's ids for a fuzz to start from: the fuzzed tenant's
/// endpoints, an event with deliveries, a dead letter; and a second tenant
/// ("bystander") with its own.
async fn populated(stack: &Stack, receiver: &Receiver, routes: Vec<Route>) -> anyhow::Result<World> {
    let own = stack.tenant("fuzzed").await?;
    let other = stack.tenant("bystander").await?;
    receiver.reply("/dead", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&own.api_key));
    let (a, _) = rest.endpoint(&receiver.url("/a"), &["fz"]).await?;
    let (b, _) = rest.endpoint(&receiver.url("/b"), &["fz"]).await?;
    let (dead_end, _) = rest.endpoint(&receiver.url("/dead"), &["fz.dead"]).await?;
    let event = rest.publish("fz", json!({"seed": true})).await?;
    let doomed = rest.publish("fz.dead", json!({"bound": "for the dead letters"})).await?;
    let theirs = Rest::new(&stack.rest_url, Some(&other.api_key));
    let (their_endpoint, _) = theirs.endpoint(&receiver.url("/other"), &["fz"]).await?;
    let their_event = theirs.publish("fz", json!({"theirs": true})).await?;
    // Seven attempts at the failing endpoint, 50 ms apart, make a dead letter.
    let dead_letter = relay_tests::eventually(Duration::from_secs(20), || async {
        rest.get("/v1/dead-letters").await.ok()?["dead_letters"][0]["id"].as_str().map(str::to_owned)
    })
    .await;
    // The replay routes need a real dead letter to be fuzzed honestly.
    anyhow::ensure!(dead_letter.is_some(), "no dead letter appeared within 20 s of seven failing attempts 50 ms apart");

    let mut ids = Ids::default();
    for id in [&a, &b, &dead_end] {
        ids.add(Tenant::Own, Kind::Endpoint, id);
    }
    ids.add(Tenant::Own, Kind::Event, &event);
    ids.add(Tenant::Own, Kind::Event, &doomed);
    if let Some(d) = &dead_letter {
        ids.add(Tenant::Own, Kind::DeadLetter, d);
    }
    ids.add(Tenant::Other, Kind::Endpoint, &their_endpoint);
    ids.add(Tenant::Other, Kind::Event, &their_event);
    let shared_event_id = Uuid::new_v4().to_string();
    ids.owner.insert(shared_event_id.clone(), None);
    Ok(World {
        addr: stack.addrs.rest,
        own_key: own.api_key.clone(),
        other_key: other.api_key.clone(),
        created_url: receiver.url("/created"),
        shared_event_id,
        routes,
        ids: Mutex::new(ids),
    })
}

/// Runs `one(i)` for every request index below `total`, from eight workers;
/// how long they all took.
async fn fan_out<F, Fut>(total: usize, one: F) -> anyhow::Result<Duration>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (one, next) = (one.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    one(i).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await?;
    }
    Ok(started.elapsed())
}

/// Prints what a fuzz saw, and fails with its first failures, if any.
fn summarise(name: &str, r: &Report, seed: u64, elapsed: Duration) {
    let statuses: Vec<String> = r.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
    println!(
        "{name} summary: {} requests sent, 2xx {} 3xx {} 4xx {} 5xx {} other {}, {} timed out, {} unanswered, {} cross-tenant; seed {seed:#x}; {:.1} s",
        r.sent,
        r.class(200, 300),
        r.class(300, 400),
        r.class(400, 500),
        r.class(500, 600),
        r.class(0, 200) + r.class(600, u16::MAX),
        r.timeouts,
        r.silent,
        r.cross_tenant,
        elapsed.as_secs_f64()
    );
    println!("{name} statuses: {}", statuses.join(" "));
    println!("{name} refusals: {}", r.reasons.iter().map(|(k, n)| format!("{k}×{n}")).collect::<Vec<_>>().join(" "));
    if !r.hangs.is_empty() {
        println!("{name}: {} timeouts of requests that were complete (the api stayed ready):\n  {}", r.hangs.len(), r.hangs.join("\n  "));
    }
}

/// Ends a fuzz: what it saw printed, the stack stopped, and its verdict:
/// no failure, the api still ready, and `after` (a normal request sent
/// after the fuzz) done.
async fn finish(
    name: &str,
    report: &Mutex<Report>,
    seed: u64,
    elapsed: Duration,
    stack: Stack,
    after: anyhow::Result<()>,
) -> anyhow::Result<()> {
    let alive = ready(stack.addrs.rest).await;
    let r = std::mem::take(&mut *report.lock().expect("not poisoned"));
    summarise(name, &r, seed, elapsed);
    let stopped = stack.stop().await;
    assert_no_failures(&r, seed);
    assert!(r.hangs.is_empty(), "{name}: {} complete requests went unanswered while the api stayed ready (seed {seed:#x})", r.hangs.len());
    assert!(alive, "/readyz answers 200 after the {name}");
    after.map_err(|e| anyhow::anyhow!("a normal request after the {name}: {e:#}"))?;
    stopped
}

fn assert_no_failures(r: &Report, seed: u64) {
    assert!(
        r.failures.is_empty(),
        "{} failures ({}) with seed {seed:#x}; the first {}:\n{}\nstatuses: {}",
        r.failed,
        r.kinds.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join("; "),
        r.failures.len(),
        r.failures.join("\n"),
        r.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect::<Vec<_>>().join(" ")
    );
}

/// A fuzz about to run: alone, its seed and size read, its stack started.
struct Fuzz {
    _alone: tokio::sync::MutexGuard<'static, ()>,
    seed: u64,
    total: usize,
    stack: Stack,
    receiver: Receiver,
}

/// Starts the fuzz `name`, of `var` (else `default`) mutated requests.
async fn begin(name: &str, var: &str, default: usize) -> anyhow::Result<Fuzz> {
    let alone = ONE_FUZZ_AT_A_TIME.lock().await;
    let seed = seed_from_env();
    let total = requests_from_env(var, default);
    println!("{name}: seed {seed:#x} (RELAY_FUZZ_SEED to replay), {total} requests ({var}), {WORKERS} workers");
    Ok(Fuzz { _alone: alone, seed, total, stack: Stack::start(Options::default()).await?, receiver: Receiver::start().await? })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rest_route_survives_mutated_requests_with_json_errors_and_no_5xx() -> anyhow::Result<()> {
    let Fuzz { seed, total, stack, receiver, _alone } = begin("fuzz", "RELAY_FUZZ_REQUESTS", DEFAULT_REQUESTS).await?;
    let world = Arc::new(populated(&stack, &receiver, routes()).await?);
    let rest = Rest::new(&stack.rest_url, Some(&world.own_key));
    assert!(!world.routes.is_empty(), "docs/openapi.json lists no routes");
    let report = Arc::new(Mutex::new(Report::default()));

    // Directed first: each route with a path id, given the other tenant's id
    // (and the other tenant given ours), is exactly a 404.
    let mut probe_rng = rng_for_request(seed, usize::MAX);
    let mut probes = 0;
    for route in world.routes.iter().filter(|r| !r.params().is_empty()) {
        for (caller, owner) in [(Tenant::Own, Tenant::Other), (Tenant::Other, Tenant::Own)] {
            let mut req = Req::seed(route, &mut probe_rng, &world);
            let path: Vec<String> = route
                .template
                .split('/')
                .map(|seg| match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                    Some(param) => {
                        let kind = param_kind(&route.template, param).unwrap_or(Kind::Endpoint);
                        let ids = world.ids();
                        ids.any(&mut probe_rng, owner, kind).or_else(|| ids.any(&mut probe_rng, owner, Kind::Endpoint)).unwrap_or_default()
                    }
                    None => seg.to_owned(),
                })
                .collect();
            req.path = path.join("/");
            let key = if caller == Tenant::Own { &world.own_key } else { &world.other_key };
            req.set_header("authorization", format!("Bearer {key}"));
            req.applied.push("cross_tenant_probe");
            let wire = req.wire();
            let index = format!("probe {caller:?}→{owner:?}");
            probes += 1;
            match exchange(world.addr, &wire, false, EXCHANGE_TIMEOUT).await {
                Outcome::Answered(answer) if answer.status == 404 && error_body_problem(&answer).is_none() => {}
                Outcome::Answered(answer) => {
                    report.lock().expect("not poisoned").fail("a cross-tenant id not answered 404", &index, &req, &wire, Some(&answer))
                }
                _ => report.lock().expect("not poisoned").fail("a cross-tenant id not answered", &index, &req, &wire, None),
            }
        }
    }

    println!("fuzz: {probes} cross-tenant probes sent ({} routes)", world.routes.len());

    // Then the mutated requests, from eight workers.
    let elapsed = fan_out(total, {
        let (world, report) = (world.clone(), report.clone());
        move |i| {
            let (world, report) = (world.clone(), report.clone());
            async move {
                let mut rng = rng_for_request(seed, i);
                let req = build(&mut rng, &world);
                run_one(&*world, &report, &format!("#{i}"), &req).await;
            }
        }
    })
    .await?;

    // Still accepting work.
    let after = rest.publish("fz", json!({"after": "the fuzz"})).await.map(drop);
    finish("fuzz", &report, seed, elapsed, stack, after).await
}
