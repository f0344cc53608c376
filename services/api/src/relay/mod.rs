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
        // Only a real pause is slept: tokio's timer rounds every deadline up
        // to its next millisecond tick, so even a zero sleep waits for it
        // (tokio-rs/tokio#6390) — up to a millisecond added to every event
        // between its publish and the outbox relay's pass.
        let settle = relay.settle_after_wake();
        if !settle.is_zero() {
            tokio::time::sleep(settle).await;
        }
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::{sync::Notify, time::Instant};

    use super::*;

    /// A relay that finds nothing and records when each pass began.
    struct Recording {
        wake: Wake,
        settle: Duration,
        passes: Mutex<Vec<Instant>>,
        passed: Notify,
    }

    impl Pass for Recording {
        const FAILING: &'static str = "nothing moves";
        async fn drain_once(&self) -> Result<usize> {
            self.passes.lock().expect("unpoisoned").push(Instant::now());
            self.passed.notify_one();
            Ok(0)
        }
        fn batch(&self) -> usize {
            8
        }
        fn wake(&self) -> &Wake {
            &self.wake
        }
        async fn idle_for(&self) -> Duration {
            Duration::from_secs(3600)
        }
        fn settle_after_wake(&self) -> Duration {
            self.settle
        }
    }

    /// A relay driven with this settle pause, and a way to stop it.
    fn driven(settle: Duration) -> (std::sync::Arc<Recording>, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let relay = std::sync::Arc::new(Recording { wake: Wake::default(), settle, passes: Mutex::default(), passed: Notify::new() });
        let (stop, shutdown) = watch::channel(false);
        let driving = tokio::spawn({
            let relay = relay.clone();
            async move { drive(&*relay, shutdown).await }
        });
        (relay, stop, driving)
    }

    /// Wakes the relay `times` times, each after its last pass; how long
    /// each pass began after its wake-up.
    async fn passes_after_wakes(relay: &Recording, times: usize) -> Vec<Duration> {
        relay.passed.notified().await;
        let mut after = Vec::with_capacity(times);
        for _ in 0..times {
            let woken_at = Instant::now();
            relay.wake.wake();
            tokio::time::timeout(Duration::from_secs(60), relay.passed.notified()).await.expect("the woken relay passes");
            after.push(*relay.passes.lock().expect("unpoisoned").last().expect("a pass") - woken_at);
        }
        after
    }

    /// On the real clock: a relay with no settle pause passes as soon as it
    /// is woken. A zero sleep in between would wait for the timer's next
    /// millisecond tick each time (about a millisecond: 400 wake-ups took
    /// 450 ms that way), where 400 wake-ups without one take a few.
    #[tokio::test]
    async fn a_woken_relay_without_a_settle_pause_does_not_wait_for_the_timer() {
        let (relay, stop, driving) = driven(Duration::ZERO);
        let after = passes_after_wakes(&relay, 400).await;
        stop.send(true).expect("the relay listens");
        driving.await.expect("the relay stops");
        let total: Duration = after.iter().sum();
        assert!(total < Duration::from_millis(150), "400 wake-ups to passes took {total:?}: the relay slept between them");
    }

    /// On a paused clock (it moves only to the next timer): a settle pause
    /// is kept, whole.
    #[tokio::test(start_paused = true)]
    async fn a_woken_relay_with_a_settle_pause_keeps_it() {
        let (relay, stop, driving) = driven(Duration::from_millis(5));
        let after = passes_after_wakes(&relay, 3).await;
        stop.send(true).expect("the relay listens");
        driving.await.expect("the relay stops");
        assert_eq!(after, vec![Duration::from_millis(5); 3]);
    }
}
