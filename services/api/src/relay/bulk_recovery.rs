//! The recovery pass: once a second while recoveries run, each sends its
//! next few deliveries again (see `app::recover`), so an endpoint gets at
//! most the release rate per second from a recovery, whatever its range.
//! With none running it sleeps until a new one wakes it (or a backstop).

use std::time::Duration;

use anyhow::Result;
use tokio::sync::watch;

use crate::app::{App, Wake};

pub struct Recoverer {
    pub app: App,
    /// Deliveries each running recovery sends per pass.
    pub per_pass: i64,
    pub every: Duration,
    /// The sleep after a pass that sent nothing: a new recovery wakes the
    /// pass, so this only bounds how late one another api started is seen.
    pub backstop: Duration,
    /// Whether the last pass sent anything (a recovery is running).
    pub busy: std::sync::atomic::AtomicBool,
    /// When the last pass ran: a wake (a new recovery) does not bring the
    /// next pass forward, or it would break the throttle of running ones.
    pub last: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Recoverer {
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        super::drive(&self, shutdown).await
    }
}

impl super::Pass for Recoverer {
    const FAILING: &'static str = "running recoveries wait";

    /// Never "full": the pace is the throttle, so a pass never goes straight on.
    fn batch(&self) -> usize {
        usize::MAX
    }

    fn wake(&self) -> &Wake {
        self.app.recover_wake()
    }

    async fn idle_for(&self) -> Duration {
        if self.busy.load(std::sync::atomic::Ordering::Relaxed) { self.every } else { self.backstop }
    }

    async fn drain_once(&self) -> Result<usize> {
        let last = *self.last.lock().expect("not poisoned");
        if let Some(last) = last {
            tokio::time::sleep_until(last + self.every).await;
        }
        *self.last.lock().expect("not poisoned") = Some(tokio::time::Instant::now());
        let sent = self.app.recover_pass(self.per_pass).await?;
        self.busy.store(sent > 0, std::sync::atomic::Ordering::Relaxed);
        Ok(sent)
    }
}
