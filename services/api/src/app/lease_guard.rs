//! The turn to hand out leases in this api: whatever counts an endpoint's
//! in-flight attempts from committed rows and leases more (a relay pass,
//! an expansion that pre-leases, a refill, a lane's promotion) holds it, so
//! two at once cannot both fill the same free slots and exceed the cap.
//!
//! The express queue's expansions (`app::expansion_queues`) wait for at
//! most the holder in progress: everyone else lines up for the lock one at
//! a time (`line`), so at most one other waits on the lock itself, and an
//! express holder asks the lock directly. Beside a burst the lock's holders
//! are the burst's expansions, refills and relay passes, one behind the
//! other; a quiet environment's expansion took its place behind all of them
//! (relay-bench `w5`'s hop log: 14 ms on average at the lock for its
//! slowest 2 %). The others are not starved: one express connection means
//! at most one express holder waits at a time.
//!
//! Both locks are tokio's (first come, first served among their waiters),
//! and a caller that stops waiting leaves no trace: safe to drop at any
//! await point.

use tokio::sync::{Mutex, MutexGuard};

#[derive(Debug, Default)]
pub struct LeaseGuard {
    lock: Mutex<()>,
    line: Mutex<()>,
}

/// Held while leasing; the turn passes on when it is dropped.
#[must_use = "the turn ends when this is dropped"]
pub struct Leasing<'a> {
    _lock: MutexGuard<'a, ()>,
    _line: Option<MutexGuard<'a, ()>>,
}

impl LeaseGuard {
    /// The turn, after everyone ahead in line.
    pub async fn lock(&self) -> Leasing<'_> {
        // The line is held for the whole turn: the next in line waits on
        // it, not on the lock, where an express holder would queue behind it.
        let line = self.line.lock().await;
        Leasing { _lock: self.lock.lock().await, _line: Some(line) }
    }

    /// The turn after the holder in progress.
    pub async fn lock_express(&self) -> Leasing<'_> {
        Leasing { _lock: self.lock.lock().await, _line: None }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;

    /// Three holders in line behind one in progress: an express holder
    /// that came last goes next after the one in progress and the one
    /// already at the lock, not after all of them.
    #[tokio::test(start_paused = true)]
    async fn an_express_holder_waits_for_the_holder_in_progress_not_for_the_whole_line() {
        let guard = Arc::new(LeaseGuard::default());
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let first = guard.lock().await;
        let mut waiting = Vec::new();
        for (name, express) in [("a", false), ("b", false), ("c", false), ("x", true)] {
            let (guard, order) = (guard.clone(), order.clone());
            waiting.push(tokio::spawn(async move {
                let _turn = if express { guard.lock_express().await } else { guard.lock().await };
                order.lock().unwrap().push(name);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(first);
        for w in waiting {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["x", "a", "b", "c"], "the express holder goes first after the one in progress");
    }

    /// A waiter given up on (its future dropped) leaves the turn to the next.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_at_any_point_passes_the_turn_on() {
        let guard = LeaseGuard::default();
        let held = guard.lock().await;
        assert!(tokio::time::timeout(Duration::from_millis(5), guard.lock()).await.is_err(), "it waits while the turn is held");
        assert!(tokio::time::timeout(Duration::from_millis(5), guard.lock_express()).await.is_err());
        drop(held);
        let _again = tokio::time::timeout(Duration::from_millis(5), guard.lock()).await.expect("the turn is free again");
    }
}
