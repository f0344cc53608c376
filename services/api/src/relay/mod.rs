//! The two relays: Postgres → NATS for work the platform owes itself.
//!
//! Cheap commits: writes whose loss in a Postgres crash costs nothing but a
//! repeat the system already absorbs (a relay's claim or lease, a
//! "published" mark, a dispatcher's claim on an attempt: the broker drops a
//! re-publish inside its duplicate window, the expansion ledger a second
//! expansion, an attempt's claim only narrows a duplicate window) are
//! committed without waiting for the disk, by turning `synchronous_commit`
//! off for their own transaction inside the statement:
//! `FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit`.
//! Everything a client or the schedule relies on (an accepted event, a
//! delivery, an outcome, a dead letter) still waits for the disk.
//! Each claims rows with `FOR UPDATE SKIP LOCKED`, so any number of api
//! processes can run them side by side, and a broker outage leaves the rows
//! where they are until it returns.

pub mod deliveries;
pub mod outbox;

use std::time::Duration;

use tokio::sync::watch;

use crate::app::Wake;

/// Sleeps until woken, until `max`, or until shutdown; true on shutdown.
pub(crate) async fn idle(wake: &Wake, max: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = wake.wait() => false,
        _ = tokio::time::sleep(max) => false,
        _ = shutdown.changed() => true,
    }
}

/// After a failure (broker or database away): back off, but not forever.
pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << failures.min(5))).min(Duration::from_secs(3))
}
