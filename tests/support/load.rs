//! Load under faults, shared by the crash torture and the cluster proof:
//! publishers that retry each event id until it is answered 202, what they
//! saw, and the checks afterwards: every owed event at every endpoint,
//! nothing left pending, each delivery's attempt log whole (attempts 1..=n,
//! once each), and every request a receiver saw either an attempt the log
//! recorded or a repeat a fault explains.
//!
//! Retries are not duplicates: a receiver that fails sometimes is sent the
//! same webhook again by design, once per recorded attempt. A duplicate is a
//! request beyond the recorded attempts; it is explained only by a fault that
//! lost that request's outcome (the process that sent it killed, or the api
//! it reports to away, around when it arrived), never by "some fault
//! happened lately".

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Result;
use serde_json::json;
use uuid::Uuid;

use crate::{Receiver, Rng, eventually};

/// Overrides (or adds) one setting in a process's environment.
pub fn with(mut env: Vec<(&'static str, String)>, key: &'static str, value: String) -> Vec<(&'static str, String)> {
    env.retain(|(k, _)| *k != key);
    env.push((key, value));
    env
}

/// What the publishers saw.
#[derive(Default, Clone)]
pub struct Ledger {
    /// Ids answered 202, with when.
    pub accepted: HashMap<Uuid, Instant>,
    /// Ids not (yet) answered 202.
    pub unconfirmed: HashSet<Uuid>,
    /// Tries not answered 202 (refused, timed out, connection lost).
    pub retries: u64,
}

/// How a publisher spaces its events.
#[derive(Debug, Clone, Copy)]
pub enum Pace {
    /// A random pause of `lo` to `hi` ms after each accepted event.
    Random { seed: u64, lo: usize, hi: usize },
    /// One event per period.
    Every(Duration),
}

/// Publishers running until [`Publishers::stop`].
pub struct Publishers {
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Result<()>>>,
}

impl Publishers {
    /// `count` publishers of events of `event_type`, each trying the apis
    /// at `rest_urls` in turn and retrying the same id (for up to 60 s)
    /// until it is answered 202.
    pub fn start(count: u64, rest_urls: &[String], api_key: &str, event_type: &str, pace: Pace) -> Self {
        Self::start_keyed(count, rest_urls, api_key, event_type, pace, 0)
    }

    /// As [`Publishers::start`], each event with an ordering key `k0`…
    /// (`keys` of them, picked at random per event; 0: none).
    pub fn start_keyed(count: u64, rest_urls: &[String], api_key: &str, event_type: &str, pace: Pace, keys: usize) -> Self {
        let ledger: Arc<Mutex<Ledger>> = Default::default();
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..count)
            .map(|p| {
                let (ledger, stop, urls, key, event_type) =
                    (ledger.clone(), stop.clone(), rest_urls.to_vec(), api_key.to_string(), event_type.to_string());
                tokio::spawn(async move {
                    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
                    let mut rng = Rng::seeded(match pace {
                        Pace::Random { seed, .. } => seed ^ (p + 1).wrapping_mul(0x5851_f42d_4c95_7f2d),
                        Pace::Every(_) => p,
                    });
                    let mut tick = match pace {
                        Pace::Every(every) => {
                            let mut tick = tokio::time::interval(every);
                            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                            Some(tick)
                        }
                        Pace::Random { .. } => None,
                    };
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(tick) = tick.as_mut() {
                            tick.tick().await;
                        }
                        let id = Uuid::new_v4();
                        let ordering_key = if keys == 0 { String::new() } else { format!("k{}", rng.below(keys)) };
                        ledger.lock().expect("unpoisoned").unconfirmed.insert(id);
                        let deadline = Instant::now() + Duration::from_secs(60);
                        while Instant::now() < deadline {
                            let url = &urls[rng.below(urls.len())];
                            let sent = http
                                .post(format!("{url}/v1/events"))
                                .bearer_auth(&key)
                                .json(&json!({"id": id.to_string(), "type": event_type, "payload": {"publisher": p}, "ordering_key": ordering_key}))
                                .send()
                                .await;
                            if sent.is_ok_and(|r| r.status().as_u16() == 202) {
                                let mut l = ledger.lock().expect("unpoisoned");
                                l.unconfirmed.remove(&id);
                                l.accepted.insert(id, Instant::now());
                                break;
                            }
                            ledger.lock().expect("unpoisoned").retries += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        if let Pace::Random { lo, hi, .. } = pace {
                            tokio::time::sleep(Duration::from_millis(rng.range(lo, hi) as u64)).await;
                        }
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        Self { ledger, stop, tasks }
    }

    /// Stops publishing (each publisher finishes the event in hand) and
    /// returns what they saw.
    pub async fn stop(self) -> Result<Ledger> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await??;
        }
        Ok(self.ledger.lock().expect("unpoisoned").clone())
    }
}

/// Each event id that arrived at `path`, with when it arrived (each time).
pub fn arrivals(receiver: &Receiver, path: &str) -> HashMap<String, Vec<Instant>> {
    requests(receiver, path).into_iter().map(|(id, seen)| (id, seen.iter().map(|r| r.at).collect())).collect()
}

/// What settling found.
#[derive(Debug)]
pub struct Settled {
    /// Event ids owed to every endpoint: accepted, or stored though never answered 202.
    pub owed: HashSet<String>,
    /// Of those, the ones never answered 202 but stored.
    pub stored_unconfirmed: usize,
    /// Every owed event arrived at every path (within the bound).
    pub all_arrived: bool,
    /// How long after settling began the last owed event arrived.
    pub arrived_after: Duration,
    /// Nothing left undelivered or unpublished (within the bound).
    pub quiet: bool,
    /// How long after settling began the database was quiet.
    pub quiet_after: Duration,
    /// Deliveries neither delivered nor dead-lettered by their schedule
    /// (every attempt failed), and events not published.
    pub pending: i64,
    pub outbox: i64,
    /// Deliveries dead-lettered because every attempt failed (a receiver
    /// that fails at random can fail them all; never a healthy one).
    pub dead_lettered: i64,
    /// Deliveries whose attempt log is not attempts 1..=n once each with n
    /// the delivery's attempt: a schedule advanced twice or skipped.
    pub schedule_broken: i64,
}

/// Deliveries that still need something (neither delivered nor dead after
/// their last attempt failed), and events not yet published.
const LEFT: &str = "SELECT (SELECT count(*) FROM webhook_deliveries d WHERE NOT (d.state = 'delivered' OR (d.state = 'dead' AND EXISTS \
                    (SELECT 1 FROM delivery_attempts a WHERE a.delivery_id = d.id AND a.attempt = d.attempt AND a.decision = 'dead_lettered')))), \
                    (SELECT count(*) FROM events WHERE published_at IS NULL)";

/// Waits (bounded) for every owed event at every path and for the database
/// to be quiet, then reads what is left.
pub async fn settle(pg: &sqlx::PgPool, ledger: &Ledger, receiver: &Receiver, paths: &[&str]) -> Result<Settled> {
    // An id never answered 202 may still have been stored; then it is owed too.
    let stored_unconfirmed: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM events WHERE id = ANY ($1)")
        .bind(ledger.unconfirmed.iter().copied().collect::<Vec<_>>())
        .fetch_all(pg)
        .await?;
    let owed: HashSet<String> = ledger.accepted.keys().chain(&stored_unconfirmed).map(Uuid::to_string).collect();
    let started = Instant::now();
    let all_arrived = eventually(Duration::from_secs(180), || async {
        paths
            .iter()
            .all(|p| {
                let got = arrivals(receiver, p);
                owed.iter().all(|id| got.contains_key(id))
            })
            .then_some(())
    })
    .await
    .is_some();
    let arrived_after = started.elapsed();
    let quiet = eventually(Duration::from_secs(90), || async {
        let (left, outbox): (i64, i64) = sqlx::query_as(LEFT).fetch_one(pg).await.ok()?;
        (left == 0 && outbox == 0).then_some(())
    })
    .await
    .is_some();
    let quiet_after = started.elapsed();
    let (pending, outbox): (i64, i64) = sqlx::query_as(LEFT).fetch_one(pg).await?;
    let dead_lettered: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state = 'dead'").fetch_one(pg).await?;
    let schedule_broken: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries d
         WHERE (SELECT count(*) FROM delivery_attempts a WHERE a.delivery_id = d.id) <> d.attempt
            OR (SELECT max(a.attempt) FROM delivery_attempts a WHERE a.delivery_id = d.id) IS DISTINCT FROM d.attempt",
    )
    .fetch_one(pg)
    .await?;
    Ok(Settled {
        owed,
        stored_unconfirmed: stored_unconfirmed.len(),
        all_arrived,
        arrived_after,
        quiet,
        quiet_after,
        pending,
        outbox,
        dead_lettered,
        schedule_broken,
    })
}

/// One request as a receiver saw it: when it arrived and where from.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub at: Instant,
    pub peer: SocketAddr,
}

/// Each event id that arrived at `path`, each request in arrival order.
pub fn requests(receiver: &Receiver, path: &str) -> HashMap<String, Vec<Arrival>> {
    let mut m: HashMap<String, Vec<Arrival>> = HashMap::new();
    for r in receiver.at(path) {
        m.entry(r.header("relay-webhook-id")).or_default().push(Arrival { at: r.at, peer: r.peer });
    }
    m
}

/// The attempts the attempt log recorded, per (event id, path).
pub async fn recorded_attempts(pg: &sqlx::PgPool, receiver: &Receiver, paths: &[&str]) -> Result<HashMap<(String, String), usize>> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT d.event_id::text, e.url, count(a.attempt) FROM webhook_deliveries d
         JOIN webhook_endpoints e ON e.id = d.endpoint_id
         LEFT JOIN delivery_attempts a ON a.delivery_id = d.id
         GROUP BY d.event_id, e.url",
    )
    .fetch_all(pg)
    .await?;
    let path_of: HashMap<String, &str> = paths.iter().map(|p| (receiver.url(p), *p)).collect();
    Ok(rows.into_iter().filter_map(|(id, url, n)| Some(((id, path_of.get(&url)?.to_string()), n as usize))).collect())
}

/// One webhook's requests at one endpoint (in arrival order) against the
/// attempts the log recorded for it: the repeats beyond those attempts,
/// each given to the fault `explain` finds for an earlier request (a request
/// and the one after it) — a request whose outcome a fault lost is sent
/// again, so the last request is never the lost one — and how many repeats
/// no fault explains. Each request explains at most one repeat.
pub fn repeats<K>(requests: &[Arrival], recorded: usize, explain: impl Fn(&Arrival, &Arrival) -> Option<K>) -> (Vec<K>, usize) {
    let surplus = requests.len().saturating_sub(recorded);
    if surplus == 0 {
        return (Vec::new(), 0);
    }
    let explained: Vec<K> = requests.windows(2).filter_map(|w| explain(&w[0], &w[1])).take(surplus).collect();
    let unexplained = surplus - explained.len();
    (explained, unexplained)
}

/// What arrived, against what was owed and what the attempt log recorded.
pub struct Accounting<K> {
    /// Distinct (event, path) pairs that arrived.
    pub delivered: usize,
    /// Owed (event, path) pairs that never arrived.
    pub missing: usize,
    /// Requests that were recorded attempts after the first: retries.
    pub retries: usize,
    /// Per path, how many (event, path) pairs took how many recorded attempts.
    pub attempts: BTreeMap<String, BTreeMap<usize, usize>>,
    /// Repeated requests (beyond the recorded attempts), by the fault that
    /// explains them.
    pub duplicates: HashMap<K, usize>,
    /// Repeated requests no fault explains.
    pub unexplained: Vec<String>,
    /// (event, path) pairs with more recorded attempts than requests seen:
    /// an outcome recorded for a request that never arrived.
    pub unseen: Vec<String>,
}

/// Counts missing pairs, retries and repeats; errs on an arrival nobody
/// published.
pub async fn account<K: Clone + Eq + std::hash::Hash>(
    pg: &sqlx::PgPool,
    receiver: &Receiver,
    paths: &[&str],
    owed: &HashSet<String>,
    explain: impl Fn(&Arrival, &Arrival) -> Option<K>,
) -> Result<Accounting<K>> {
    let recorded = recorded_attempts(pg, receiver, paths).await?;
    let mut a = Accounting {
        delivered: 0,
        missing: 0,
        retries: 0,
        attempts: BTreeMap::new(),
        duplicates: HashMap::new(),
        unexplained: Vec::new(),
        unseen: Vec::new(),
    };
    for p in paths {
        let got = requests(receiver, p);
        a.missing += owed.iter().filter(|id| !got.contains_key(*id)).count();
        for (id, seen) in &got {
            anyhow::ensure!(owed.contains(id), "{p}: {id} arrived but was never published");
            a.delivered += 1;
            let attempts = recorded.get(&(id.clone(), p.to_string())).copied().unwrap_or(0);
            *a.attempts.entry(p.to_string()).or_default().entry(attempts).or_default() += 1;
            a.retries += attempts.saturating_sub(1);
            if attempts > seen.len() {
                a.unseen.push(format!("{p} {id}: {attempts} attempts recorded, {} requests seen", seen.len()));
            }
            let (explained, unexplained) = repeats(seen, attempts, &explain);
            for k in explained {
                *a.duplicates.entry(k).or_default() += 1;
            }
            if unexplained > 0 {
                let offsets: Vec<String> =
                    seen.iter().map(|r| format!("{:?} from {}", r.at.saturating_duration_since(seen[0].at), r.peer)).collect();
                a.unexplained.push(format!(
                    "{p} {id}: {} requests, {attempts} attempts recorded, {unexplained} unexplained ({offsets:?})",
                    seen.len()
                ));
            }
        }
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64, port: u16) -> Arrival {
        Arrival { at: base + Duration::from_millis(ms), peer: SocketAddr::from(([127, 0, 0, 2], port)) }
    }

    #[test]
    fn retries_the_log_recorded_are_not_repeats() {
        let t = Instant::now();
        let seen = [at(t, 0, 1), at(t, 1000, 1), at(t, 6000, 1)];
        let (explained, unexplained) = repeats(&seen, 3, |_, _| Some("kill"));
        assert!(explained.is_empty() && unexplained == 0);
    }

    #[test]
    fn a_repeat_needs_a_fault_that_lost_an_earlier_request() {
        let t = Instant::now();
        let seen = [at(t, 0, 1), at(t, 3000, 2)];
        // No fault near the first request: a repeat the checker must report.
        assert_eq!(repeats(&seen, 1, |_, _| None::<&str>), (vec![], 1));
        // A fault that lost the first request explains it, once.
        let near_first = |r: &Arrival, _: &Arrival| (r.at == t).then_some("sender killed");
        assert_eq!(repeats(&seen, 1, near_first), (vec!["sender killed"], 0));
        // Three copies of one attempt with one lost request: one repeat is unexplained.
        let seen = [at(t, 0, 1), at(t, 3000, 2), at(t, 3100, 2)];
        assert_eq!(repeats(&seen, 1, near_first), (vec!["sender killed"], 1));
    }
}
