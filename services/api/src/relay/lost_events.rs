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
//! without them. Each look reads the events published in its window by
//! any api, not only this one's: the api that published them may have died
//! before it looked (a kill within seconds of the broker's), and its
//! replacement remembers nothing of them — so an api also looks when it
//! starts, as far back as a return would and `START_LOOKBACK` more. A
//! consumer that stops delivering altogether after the
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
/// How far before its start an api looks: a broker lost what it had acknowledged,
/// and every api that saw it come back died before looking, within this.
const START_LOOKBACK: Duration = Duration::from_secs(300);
/// The outbox's last places a look reads, besides this process's own
/// publishing since the loss: a bound on its cost that covers the window
/// at several thousand events a second.
const LOOK_TAIL: i64 = 200_000;

pub struct LostEvents {
    pub app: App,
    pub js: jetstream::Context,
    pub names: StreamNames,
    pub replicas: usize,
    pub link: watch::Receiver<broker::Link>,
}

impl LostEvents {
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let started = Instant::now();
        // The first round is this process's start: the processes before it
        // may have seen the broker come back and died before they looked
        // (the crash torture killed an api within seconds of a broker kill),
        // and nothing of theirs is remembered here, so the start looks as
        // far back as a return would, and `START_LOOKBACK` more.
        let mut at_risk_from = Some(RiskFrom::Start(started));
        loop {
            let from = match at_risk_from.take() {
                Some(from) => from,
                None => {
                    tokio::select! {
                        changed = self.link.changed() => if changed.is_err() { return },
                        _ = stop.changed() => return,
                    }
                    self.returned()
                }
            };
            // Soon, then once a re-publish is no longer a duplicate; a
            // further return starts over. Each look takes events at least as
            // old as the wait before it: published before that look's wait
            // began, so any expansion of theirs had the whole wait to happen.
            for wait in [FIRST_LOOK, broker::DUPLICATE_WINDOW + FIRST_LOOK] {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    changed = self.link.changed() => {
                        if changed.is_ok() {
                            at_risk_from = Some(self.returned());
                        }
                        break;
                    }
                    _ = stop.changed() => return,
                }
                if let Err(e) = self.look(from, wait).await {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "looking for events the broker lost failed; the next return of the broker looks again"
                    );
                }
            }
        }
    }

    /// The broker came back: the events at risk begin before its loss.
    fn returned(&mut self) -> RiskFrom {
        RiskFrom::Loss(self.link.borrow_and_update().lost_at.unwrap_or_else(Instant::now))
    }

    /// Puts back in the outbox what was published since `from` (at least
    /// `min_age` ago) and no expansion took, whichever api published it.
    async fn look(&self, from: RiskFrom, min_age: Duration) -> anyhow::Result<()> {
        broker::ensure_streams(&self.js, &self.names, self.replicas).await.context("creating the streams again")?;
        let (since, window) = match from {
            RiskFrom::Loss(lost_at) => (lost_at.checked_sub(AT_RISK_BEFORE), lost_at.elapsed() + AT_RISK_BEFORE),
            RiskFrom::Start(started) => (None, started.elapsed() + AT_RISK_BEFORE + START_LOOKBACK),
        };
        let from_seq = since.and_then(|since| self.app.outbox_offers().lowest_published_since(since));
        let again = db::events::unpublish_unexpanded(self.app.db(), from_seq, LOOK_TAIL, window, min_age, PER_LOOK)
            .await
            .context("putting events the broker lost back in the outbox")?;
        if !again.is_empty() {
            tracing::warn!(
                count = again.len(),
                from_seq,
                at_start = matches!(from, RiskFrom::Start(_)),
                "events the broker had acknowledged were never expanded; publishing them again"
            );
            self.app.outbox_offers().look_at_outbox();
            self.app.outbox_wake().wake();
        }
        Ok(())
    }
}

/// Where the events at risk begin: shortly before the broker connection was
/// lost, or (at this process's start) a while before it.
#[derive(Debug, Clone, Copy)]
enum RiskFrom {
    Loss(Instant),
    Start(Instant),
}
