//! A quiet environment's event is not held behind a neighbour's backlog.
//!
//! While the outbox relay catches up on a backlog it sets offers aside and
//! reads the outbox in turns across environments, and while the EVENTS
//! stream is at its backlog limit it waits for room. Both are right for the
//! environment bursting, and both made everyone else's events wait for the
//! relay's passes: behind one environment's burst (relay-bench `w5`) the
//! quiet environment's events waited 5–8 ms (p50) and 30–40 ms (p99) from
//! their commit to the broker, where alone they wait under 2 ms — the
//! relay's passes, each a claim under a saturated database, came about
//! every 14 ms.
//!
//! So an offer made while the relay is backlogged, of an event of an
//! environment none of whose events was published in the last
//! `FIRST_TURN_GAP` (see `app::events::OutboxOffers`), comes here and is
//! published at once, past the stream's limit: the dispatchers take the
//! stream's events in fair turns, so past the limit it waits one turn, not
//! the burst. One environment gets at most one event a gap this way, a few
//! hundred a second against the thousands the dispatchers take, so the
//! limit still holds the burst back.
//!
//! Invariant: the outbox stays the record. What this publishes is marked
//! with the relay's next marks, as a shortcut pass's events are; an event
//! the broker refused, or one a look finds before its mark, is published
//! (again) by the relay — the broker drops a second publish inside its
//! duplicate window. Events with an ordering key never come here: their
//! order is the outbox's.

use std::time::Instant;

use tokio::sync::{mpsc, watch};

use super::outbox::OutboxRelay;
use crate::db::events::OutboxRow;

/// Events one publish carries at most.
const BATCH: usize = 64;

pub(super) async fn run(relay: &OutboxRelay, mut rows: mpsc::UnboundedReceiver<OutboxRow>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let first = tokio::select! {
            row = rows.recv() => row,
            _ = shutdown.wait_for(|stopped| *stopped) => None,
        };
        let Some(first) = first else { return };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rows.try_recv() {
                Ok(row) => batch.push(row),
                Err(_) => break,
            }
        }
        publish(relay, batch).await;
    }
}

async fn publish(relay: &OutboxRelay, batch: Vec<OutboxRow>) {
    let messages = match batch.iter().map(|row| relay.message(row)).collect::<anyhow::Result<Vec<_>>>() {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), "could not frame an event; the relay's next look publishes it");
            relay.app.outbox_offers().look_at_outbox();
            return;
        }
    };
    let (stored, first_error) = crate::broker::publish_all(&relay.js, messages).await;
    let published: Vec<i64> = batch.iter().zip(&stored).filter(|(_, ok)| **ok).map(|(r, _)| r.seq).collect();
    if let Some(e) = first_error {
        tracing::warn!(error = format!("{e:#}"), "the broker refused an event; the relay's next look publishes it");
        relay.app.outbox_offers().look_at_outbox();
    }
    if published.is_empty() {
        return;
    }
    relay.published(published.len());
    for (r, ok) in batch.iter().zip(&stored) {
        if *ok {
            tracing::debug!(target: "relay_hops", hop = "outbox_published", event_id = %r.id, first_turn = true);
        }
    }
    if let Some(lowest) = published.iter().min() {
        relay.app.outbox_offers().note_published(*lowest);
    }
    let mut u = relay.unmarked.lock().expect("not poisoned");
    u.since.get_or_insert_with(Instant::now);
    u.seqs.extend_from_slice(&published);
}
