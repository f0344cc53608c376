//! The prober: open circuits whose probe is due get one held delivery sent
//! (see `app::recovery`). Asleep until the earliest probe falls due, or a
//! circuit opening wakes it.

use std::time::Duration;

use anyhow::Result;
use tokio::sync::watch;

use crate::app::{App, Wake};

pub struct Prober {
    pub app: App,
    /// The longest sleep: a backstop for circuits opened by another api.
    pub idle: Duration,
}

impl Prober {
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        super::drive(&self, shutdown).await
    }
}

impl super::Pass for Prober {
    const FAILING: &'static str = "open circuits wait for their probes";

    fn batch(&self) -> usize {
        200
    }

    fn wake(&self) -> &Wake {
        self.app.probes_wake()
    }

    async fn idle_for(&self) -> Duration {
        let now = self.app.now();
        match self.app.next_probe_at().await {
            Ok(Some(at)) if at > now => (at - now).to_std().unwrap_or(Duration::ZERO).min(self.idle),
            // Past due but not taken: another prober holds it, or the pass
            // just looked; a short pause, not a spin.
            Ok(Some(_)) => Duration::from_millis(50).min(self.idle),
            Ok(None) => self.idle,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "reading the next probe time");
                self.idle
            }
        }
    }

    async fn drain_once(&self) -> Result<usize> {
        Ok(self.app.probe_due_endpoints().await?)
    }
}
