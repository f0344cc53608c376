//! The api's upkeep, each on the relays' pass loop ([`super::drive`]): the
//! dead-letter announcer, the retention work (dead letters and events past
//! retention, held deliveries past their bound, expired claims, old
//! statistics, portal links), the portal's chart sums, the sweep of
//! ordered endpoints' lanes left without a head, and the planner's
//! statistics of the hot tables.

use std::{
    sync::{Mutex, atomic::AtomicI64},
    time::Duration,
};

use anyhow::Result;
use tokio::sync::watch;

use crate::app::{App, Wake, attempt_stats, operational::ANNOUNCE_BACKSTOP};

/// Announces dead letters to operations endpoints in batches: looked for
/// each second while this process has counted one that may still wait
/// (gathering, the per-minute limit), otherwise every `ANNOUNCE_BACKSTOP`
/// for those other api processes counted.
pub struct Announcer {
    pub app: App,
    pub looked: Mutex<Option<tokio::time::Instant>>,
    pub never: Wake,
}

impl Announcer {
    pub fn new(app: App) -> Self {
        Self { app, looked: Mutex::new(None), never: Wake::default() }
    }
}

impl super::Pass for Announcer {
    const FAILING: &'static str = "counted dead letters wait to be announced";

    fn batch(&self) -> usize {
        usize::MAX
    }

    fn wake(&self) -> &Wake {
        &self.never
    }

    async fn idle_for(&self) -> Duration {
        Duration::from_secs(1)
    }

    async fn drain_once(&self) -> Result<usize> {
        let looked = *self.looked.lock().expect("not poisoned");
        if !self.app.dead_letters_counted().may_wait() && looked.is_some_and(|at| at.elapsed() < ANNOUNCE_BACKSTOP) {
            return Ok(0);
        }
        *self.looked.lock().expect("not poisoned") = Some(tokio::time::Instant::now());
        self.app.announce_dead_letters().await?;
        Ok(0)
    }
}

/// The retention work, every `every`. Each step logs its own failure and
/// the rest still run; the walk over old events is bounded per pass, so a
/// large backlog is worked off over several passes, never in one long one.
pub struct Retention {
    pub app: App,
    pub every: Duration,
    pub dead_letter_retention: Duration,
    pub event_retention: Duration,
    /// Where the walk over old events stands between passes.
    pub cursor: AtomicI64,
    pub never: Wake,
}

impl super::Pass for Retention {
    const FAILING: &'static str = "retention waits";

    fn batch(&self) -> usize {
        usize::MAX
    }

    fn wake(&self) -> &Wake {
        &self.never
    }

    async fn idle_for(&self) -> Duration {
        self.every
    }

    async fn drain_once(&self) -> Result<usize> {
        let app = &self.app;
        match app.prune_dead_letters(self.dead_letter_retention).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(pruned = n, "dead letters past retention deleted"),
            Err(e) => tracing::warn!(error = ?e, "pruning dead letters failed"),
        }
        match app.expire_held(100_000).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(expired = n, "deliveries held past their environment's bound became dead letters"),
            Err(e) => tracing::warn!(error = ?e, "expiring held deliveries failed"),
        }
        let cursor = self.cursor.load(std::sync::atomic::Ordering::Relaxed);
        match app.prune_retained(self.event_retention, cursor, 20_000).await {
            Ok((next, pruned)) => {
                self.cursor.store(next, std::sync::atomic::Ordering::Relaxed);
                if pruned.events > 0 || pruned.deliveries > 0 {
                    tracing::info!(
                        events = pruned.events,
                        deliveries = pruned.deliveries,
                        attempts = pruned.attempts,
                        "events past retention deleted"
                    );
                }
            }
            Err(e) => tracing::warn!(error = ?e, "pruning events past retention failed"),
        }
        if let Err(e) = app.prune_attempt_claims().await {
            tracing::warn!(error = ?e, "pruning expired attempt claims failed");
        }
        if let Err(e) = app.prune_attempt_stats().await {
            tracing::warn!(error = ?e, "pruning old attempt statistics failed");
        }
        if let Err(e) = app.prune_portal().await {
            tracing::warn!(error = ?e, "pruning expired portal links and sessions failed");
        }
        Ok(0)
    }
}

/// The portal's chart sums, written every `attempt_stats::FLUSH_EVERY` and
/// once more on the way out.
pub struct StatsFlush {
    pub app: App,
    pub never: Wake,
}

impl StatsFlush {
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        super::drive(&self, shutdown).await;
        if let Err(e) = self.app.flush_attempt_stats().await {
            tracing::warn!(error = ?e, "writing attempt statistics on the way out failed");
        }
    }
}

impl super::Pass for StatsFlush {
    const FAILING: &'static str = "attempt statistics are kept for the next write";

    fn batch(&self) -> usize {
        usize::MAX
    }

    fn wake(&self) -> &Wake {
        &self.never
    }

    async fn idle_for(&self) -> Duration {
        attempt_stats::FLUSH_EVERY
    }

    async fn drain_once(&self) -> Result<usize> {
        self.app.flush_attempt_stats().await?;
        Ok(0)
    }
}

/// The lane sweep: every [`LANE_SWEEP_EVERY`], the lanes of ordered
/// endpoints left without a head (a process died between ending a head or
/// queueing a row and promoting its lane) promote their next row.
pub struct LaneSweep {
    pub app: App,
    pub never: Wake,
}

/// How long a lane can wait for a promotion that a crash lost.
pub const LANE_SWEEP_EVERY: Duration = Duration::from_secs(5);

impl super::Pass for LaneSweep {
    const FAILING: &'static str = "lanes without a head wait for the next sweep";

    fn batch(&self) -> usize {
        usize::MAX
    }

    fn wake(&self) -> &Wake {
        &self.never
    }

    async fn idle_for(&self) -> Duration {
        LANE_SWEEP_EVERY
    }

    async fn drain_once(&self) -> Result<usize> {
        self.app.sweep_lanes().await?;
        Ok(0)
    }
}

/// The statistics keeper (`db::statistics`): every [`STATISTICS_EVERY`],
/// the hot tables past 1,000 rows that have doubled are analysed.
pub struct Statistics {
    pub app: App,
    pub never: Wake,
}

pub const STATISTICS_EVERY: Duration = Duration::from_secs(5);

impl super::Pass for Statistics {
    const FAILING: &'static str = "the planner keeps the statistics it has";

    fn batch(&self) -> usize {
        usize::MAX
    }

    fn wake(&self) -> &Wake {
        &self.never
    }

    async fn idle_for(&self) -> Duration {
        STATISTICS_EVERY
    }

    async fn drain_once(&self) -> Result<usize> {
        self.app.keep_statistics().await?;
        Ok(0)
    }
}

/// The listener sweep (`app::listen`): every second, the listeners whose
/// call ended more than `grace` ago, or whose api died, lose their endpoint.
pub struct ListenerSweep {
    pub app: App,
    pub grace: Duration,
    pub never: Wake,
}

impl super::Pass for ListenerSweep {
    const FAILING: &'static str = "ended listeners keep their endpoints until the next sweep";

    fn batch(&self) -> usize {
        100
    }

    fn wake(&self) -> &Wake {
        &self.never
    }

    async fn idle_for(&self) -> Duration {
        Duration::from_secs(1)
    }

    async fn drain_once(&self) -> Result<usize> {
        Ok(self.app.sweep_listeners(self.grace).await?)
    }
}
