//! Events the broker lost after acknowledging them, found and published
//! again once it is back.
//!
//! The outbox marks an event published when the broker acknowledges it, and
//! from then on only the broker holds the way to its expansion. A broker
//! killed outright can come back without messages it acknowledged just
//! before (not yet on its disk), or without its streams (nats-server issue
//! #3402 describes the first; the crash torture showed both). Postgres
//! still holds every such event, and the expansion ledger says which were
//! never expanded.
//!
//! So each time this api's connection to the broker comes back, it looks
//! twice at the events published from shortly before the connection was
//! lost until the return: soon, for messages the broker no longer has
//! (published again now, they are stored anew; those it still has are
//! dropped by its duplicate window), and once the duplicate window has
//! passed, for messages it holds but has not delivered by then. Each look
//! puts the published, never-expanded events back in the outbox, and the
//! outbox relay publishes them under their own message ids; an event that
//! was only slow is expanded once either way (the expansion ledger). The
//! streams are created again first, should the broker have come back
//! without them. A consumer that stops delivering altogether after the
//! return (nats-server issue #5412 and others) is not this module's to
//! mend: what it publishes again would wait behind that consumer too.

use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream;
use relay_contracts::StreamNames;
use tokio::sync::watch;

use crate::{app::App, broker, db};

/// Published this long before the connection was lost, an event may still
/// be only in the broker's memory.
const AT_RISK_BEFORE: Duration = Duration::from_secs(30);
/// The first look, this long after the return (the relays and dispatchers
/// reconnect meanwhile, and expand what the broker kept).
const FIRST_LOOK: Duration = Duration::from_secs(5);
/// Events put back in the outbox by one look, at most.
const PER_LOOK: i64 = 100_000;

pub struct LostEvents {
    pub app: App,
    pub js: jetstream::Context,
    pub names: StreamNames,
    pub replicas: usize,
    pub link: watch::Receiver<broker::Link>,
}

impl LostEvents {
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        // The broker came back again while the last return was looked at.
        let mut returned_again = false;
        loop {
            if !std::mem::take(&mut returned_again) {
                tokio::select! {
                    changed = self.link.changed() => if changed.is_err() { return },
                    _ = stop.changed() => return,
                }
            }
            let lost_at = self.link.borrow_and_update().lost_at.unwrap_or_else(Instant::now);
            let since = lost_at.checked_sub(AT_RISK_BEFORE).unwrap_or(lost_at);
            // Soon, then once a re-publish is no longer a duplicate; a
            // further return starts over. Each look takes events at least as
            // old as the wait before it: published before that look's wait
            // began, so any expansion of theirs had the whole wait to happen.
            for wait in [FIRST_LOOK, broker::DUPLICATE_WINDOW + FIRST_LOOK] {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    changed = self.link.changed() => {
                        returned_again = changed.is_ok();
                        break;
                    }
                    _ = stop.changed() => return,
                }
                if let Err(e) = self.look(since, wait).await {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "looking for events the broker lost failed; the next return of the broker looks again"
                    );
                }
            }
        }
    }

    /// Puts back in the outbox what this process published since `since`
    /// (at least `min_age` ago) and no expansion took.
    async fn look(&self, since: Instant, min_age: Duration) -> anyhow::Result<()> {
        broker::ensure_streams(&self.js, &self.names, self.replicas).await.context("creating the streams again")?;
        let Some(from_seq) = self.app.outbox_offers().lowest_published_since(since) else {
            return Ok(());
        };
        let again = db::events::unpublish_unexpanded(self.app.db(), from_seq, min_age, PER_LOOK)
            .await
            .context("putting events the broker lost back in the outbox")?;
        if !again.is_empty() {
            tracing::warn!(count = again.len(), from_seq, "events the broker had acknowledged were never expanded; publishing them again");
            self.app.outbox_offers().look_at_outbox();
            self.app.outbox_wake().wake();
        }
        Ok(())
    }
}
