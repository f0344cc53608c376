//! Load under faults, shared by the crash torture and the cluster proof:
//! publishers that retry each event id until it is answered 202, what they
//! saw, and the settling checks afterwards (every owed event at every
//! endpoint, nothing left pending, each schedule advanced once).

use std::{
    collections::{HashMap, HashSet},
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
        let ledger: Arc<Mutex<Ledger>> = Default::default();
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..count)
            .map(|p| {
                let (ledger, stop, urls, key, event_type) =
                    (ledger.clone(), stop.clone(), rest_urls.to_vec(), api_key.to_string(), event_type.to_string());
                tokio::spawn(async move {
                    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
                    let mut rng = Rng(match pace {
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
                        ledger.lock().expect("unpoisoned").unconfirmed.insert(id);
                        let deadline = Instant::now() + Duration::from_secs(60);
                        while Instant::now() < deadline {
                            let url = &urls[rng.below(urls.len())];
                            let sent = http
                                .post(format!("{url}/v1/events"))
                                .bearer_auth(&key)
                                .json(&json!({"id": id.to_string(), "type": event_type, "payload": {"publisher": p}}))
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
    let mut m: HashMap<String, Vec<Instant>> = HashMap::new();
    for r in receiver.at(path) {
        m.entry(r.header("relay-webhook-id")).or_default().push(r.at);
    }
    m
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
    /// Deliveries not delivered, events not published, and deliveries whose
    /// schedule advanced more than once (every receiver answers 200 here).
    pub pending: i64,
    pub outbox: i64,
    pub advanced_twice: i64,
}

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
        let (left, outbox): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM webhook_deliveries WHERE state <> 'delivered'), (SELECT count(*) FROM events WHERE published_at IS NULL)",
        )
        .fetch_one(pg)
        .await
        .ok()?;
        (left == 0 && outbox == 0).then_some(())
    })
    .await
    .is_some();
    let quiet_after = started.elapsed();
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state <> 'delivered'").fetch_one(pg).await?;
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NULL").fetch_one(pg).await?;
    let advanced_twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries d WHERE d.attempt <> 1 OR (SELECT count(*) FROM delivery_attempts a WHERE a.delivery_id = d.id) <> 1",
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
        advanced_twice,
    })
}

/// What arrived, against what was owed.
pub struct Accounting<K> {
    /// Distinct (event, path) pairs that arrived.
    pub delivered: usize,
    /// Owed (event, path) pairs that never arrived.
    pub missing: usize,
    /// Repeated arrivals, by the fault that explains them.
    pub duplicates: HashMap<K, usize>,
    /// Repeated arrivals no fault explains.
    pub unexplained: Vec<String>,
}

/// Counts missing pairs and gives each repeated arrival to the latest fault
/// between its first arrival (less 3 s, an attempt's span) and its second;
/// errs on an arrival nobody published.
pub fn account<K: Clone + Eq + std::hash::Hash>(
    receiver: &Receiver,
    paths: &[&str],
    owed: &HashSet<String>,
    faults: &[(K, Instant)],
) -> Result<Accounting<K>> {
    let mut a = Accounting { delivered: 0, missing: 0, duplicates: HashMap::new(), unexplained: Vec::new() };
    for p in paths {
        let got = arrivals(receiver, p);
        a.missing += owed.iter().filter(|id| !got.contains_key(*id)).count();
        for (id, times) in &got {
            anyhow::ensure!(owed.contains(id), "{p}: {id} arrived but was never published");
            a.delivered += 1;
            for w in times.windows(2) {
                // A crash between a POST and its recorded outcome (or a broker
                // losing track of an ack) re-sends: some fault must fall
                // between the first arrival (less an attempt) and the second.
                match faults.iter().rev().find(|(_, at)| *at + Duration::from_secs(3) >= w[0] && *at <= w[1]) {
                    Some((k, _)) => *a.duplicates.entry(k.clone()).or_default() += 1,
                    None => a.unexplained.push(format!("{p} {id} ({:?} apart)", w[1] - w[0])),
                }
            }
        }
    }
    Ok(a)
}
