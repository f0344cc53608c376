//! The relays: Postgres → NATS for work the platform owes itself; the
//! prober, which puts held deliveries of open circuits back in their way;
//! and the upkeep passes (announcements, retention, chart sums), all on one
//! pass loop ([`drive`]).
//!
//! Cheap commits: writes whose loss in a Postgres crash costs nothing but a
//! repeat the system already absorbs (a relay's claim or lease, a
//! "published" mark, a dispatcher's claim on an attempt: the broker drops a
//! re-publish inside its duplicate window, the expansion ledger a second
//! expansion, an attempt's claim only narrows a duplicate window, a lane's
//! promotion is made again by the lane sweep) are
//! committed without waiting for the disk, by turning `synchronous_commit`
//! off for their own transaction inside the statement:
//! `FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit`.
//! Everything a client or the schedule relies on (an accepted event, a
//! delivery, an outcome, a dead letter) still waits for the disk.
//! Each claims rows with `FOR UPDATE SKIP LOCKED`, so any number of api
//! processes can run them side by side, and a broker outage leaves the rows
//! where they are until it returns.

pub mod bulk_recovery;
pub mod deliveries;
pub mod lost_events;
pub mod outbox;
pub mod prober;
pub mod upkeep;

use std::time::Duration;

use anyhow::Result;
use tokio::sync::watch;

use crate::{app::Wake, db::batcher::KeptConnection};

/// What a relay does in one pass, and how it waits between passes; the
/// loop around it ([`drive`]) is the same for both relays.
pub(crate) trait Pass {
    /// What stays where it is when a pass fails, for the log.
    const FAILING: &'static str;
    /// Claims, publishes and marks one batch; how many rows it moved.
    async fn drain_once(&self) -> Result<usize>;
    /// A pass that moved this many rows goes straight on.
    fn batch(&self) -> usize;
    /// What wakes the relay early.
    fn wake(&self) -> &Wake;
    /// The longest sleep after a pass that found less than a batch.
    async fn idle_for(&self) -> Duration;
    /// A pause after waking, before the next pass.
    fn settle_after_wake(&self) -> Duration {
        Duration::ZERO
    }
}

/// Runs passes until shutdown: straight on after a full batch, backing off
/// after a failure, otherwise asleep until woken or `idle_for`.
pub(crate) async fn drive<P: Pass>(relay: &P, mut shutdown: watch::Receiver<bool>) {
    let mut failures = 0u32;
    while !*shutdown.borrow() {
        match relay.drain_once().await {
            Ok(n) if n >= relay.batch() => {
                failures = 0;
                continue;
            }
            Ok(_) => failures = 0,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = format!("{e:#}"), "relay pass failed; {}", P::FAILING);
                tokio::select! {
                    _ = tokio::time::sleep(backoff(failures)) => {}
                    _ = shutdown.changed() => return,
                }
                continue;
            }
        }
        let sleep = relay.idle_for().await;
        if idle(relay.wake(), sleep, &mut shutdown).await {
            return;
        }
        tokio::time::sleep(relay.settle_after_wake()).await;
    }
}

/// Sleeps until woken, until `max`, or until shutdown; true on shutdown.
pub(crate) async fn idle(wake: &Wake, max: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = wake.wait() => false,
        _ = tokio::time::sleep(max) => false,
        _ = shutdown.changed() => true,
    }
}

/// Runs `pass` on a relay's own connection (see `db::batcher`); a pass that
/// fails lets the connection go, as the failure may have broken it.
pub(crate) async fn on_held<T>(
    conn: &tokio::sync::Mutex<KeptConnection>,
    pass: impl AsyncFnOnce(&mut KeptConnection) -> Result<T>,
) -> Result<T> {
    let mut held = conn.lock().await;
    let result = pass(&mut held).await;
    if result.is_err() {
        held.forget();
    }
    result
}

/// After a failure (broker or database away): back off, but by at most a
/// second. What ends such a failure is usually a JetStream leader's election
/// or a Postgres promotion, which take seconds; a cap of 3 s added up to 3 s
/// of delivery delay after either was over (the cluster test), while a pass a
/// second against an unreachable broker costs next to nothing.
pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << failures.min(5))).min(Duration::from_secs(1))
}
