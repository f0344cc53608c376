//! The two relays: Postgres → NATS for work the platform owes itself.
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
