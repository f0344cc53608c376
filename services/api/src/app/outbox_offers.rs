//! What this process offers its own outbox relay: the events it just
//! wrote, so that the relay publishes them without a query to find them,
//! and — while the relay catches up on a backlog — the events of
//! environments it has not published for lately, which go past the backlog
//! (`relay::outbox::OutboxRelay::first_turns`). Offers are a shortcut,
//! never the record: every event is in the outbox, and one not published
//! from here is found there.

use std::sync::{Arc, Mutex};

use relay_domain::EnvironmentId;

use crate::db;

/// Events this process just wrote, offered to its own outbox relay (see
/// the module's doc).
#[derive(Debug, Clone, Default)]
pub struct OutboxOffers(Arc<Mutex<Offers>>);

#[derive(Debug, Default)]
struct Offers {
    /// Only a process that runs the outbox relay takes offers.
    open: bool,
    rows: Vec<db::events::OutboxRow>,
    /// Offers were refused for want of room: the outbox holds more than
    /// `rows` says.
    overflowed: bool,
    /// When this process's relay published lately, with the lowest outbox
    /// place of each batch (see `relay::lost_events`).
    published: std::collections::VecDeque<(std::time::Instant, i64)>,
    /// The relay is catching up on a backlog (and the stream has room past
    /// its limit): offers of environments it has not published for in
    /// `FIRST_TURN_GAP` go to `first_turns`, the rest wait for its looks
    /// (see `relay::outbox::OutboxRelay::first_turns`).
    backlogged: bool,
    first_turns: Option<tokio::sync::mpsc::UnboundedSender<db::events::OutboxRow>>,
    /// When each environment last had an event published, or sent to
    /// `first_turns`; entries older than `FIRST_TURN_GAP` may linger.
    published_at: std::collections::HashMap<EnvironmentId, std::time::Instant>,
}

/// How long after one of its events was published an environment's next
/// goes past a backlog (see `relay::outbox::OutboxRelay::first_turns`):
/// longer than a burst's events are apart, shorter than a steady
/// publisher's (200 a second).
const FIRST_TURN_GAP: std::time::Duration = std::time::Duration::from_millis(5);
/// Environments remembered in `Offers::published_at` before the stale are pruned.
const PUBLISHED_AT_PRUNE: usize = 1_024;

/// Batches remembered in `Offers::published`, at most and for how long.
const PUBLISHED_KEPT: usize = 20_000;
const PUBLISHED_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// Offers held at most; beyond, events wait for the relay's next look.
const MAX_OFFERS: usize = 10_000;

impl OutboxOffers {
    /// The outbox relay takes offers from now on.
    pub fn open(&self) {
        self.0.lock().expect("unpoisoned").open = true;
    }

    /// Offers an event this process wrote; `ordered`: it has an ordering
    /// key, and so never goes past the outbox's order.
    pub fn offer(&self, row: db::events::OutboxRow, ordered: bool) {
        let mut guard = self.0.lock().expect("unpoisoned");
        let o = &mut *guard;
        if !o.open {
            return;
        }
        let row = match &o.first_turns {
            Some(first_turns) if o.backlogged && !ordered && row.target_endpoint_id.is_none() => {
                let (env, now) = (row.environment_id, std::time::Instant::now());
                if o.published_at.get(&env).is_some_and(|at| now.duration_since(*at) < FIRST_TURN_GAP) {
                    row
                } else {
                    match first_turns.send(row) {
                        Ok(()) => {
                            o.published_at.insert(env, now);
                            return;
                        }
                        Err(tokio::sync::mpsc::error::SendError(row)) => row,
                    }
                }
            }
            _ => row,
        };
        if o.rows.len() < MAX_OFFERS {
            o.rows.push(row);
        } else {
            o.overflowed = true;
        }
    }

    /// Where offers that go past a backlog are sent from now on.
    pub fn open_first_turns(&self) -> tokio::sync::mpsc::UnboundedReceiver<db::events::OutboxRow> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.0.lock().expect("unpoisoned").first_turns = Some(tx);
        rx
    }

    /// Whether the relay's last pass left it catching up on a backlog, and
    /// whether the stream may take events past its limit.
    pub fn set_backlogged(&self, backlogged: bool, room_past_the_limit: bool) {
        self.0.lock().expect("unpoisoned").backlogged = backlogged && room_past_the_limit;
    }

    /// The broker took events of these environments.
    pub fn note_environments_published(&self, envs: impl Iterator<Item = EnvironmentId>) {
        let now = std::time::Instant::now();
        let mut o = self.0.lock().expect("unpoisoned");
        if o.published_at.len() >= PUBLISHED_AT_PRUNE {
            o.published_at.retain(|_, at| now.duration_since(*at) < FIRST_TURN_GAP);
        }
        for env in envs {
            o.published_at.insert(env, now);
        }
    }

    /// What was offered since the last take, and whether any offer was
    /// refused meanwhile.
    pub fn take(&self) -> (Vec<db::events::OutboxRow>, bool) {
        let mut o = self.0.lock().expect("unpoisoned");
        (std::mem::take(&mut o.rows), std::mem::take(&mut o.overflowed))
    }

    /// The outbox holds events the offers do not show: the relay's next
    /// pass looks at it.
    pub fn look_at_outbox(&self) {
        self.0.lock().expect("unpoisoned").overflowed = true;
    }

    /// The broker took a batch whose lowest outbox place is `lowest_seq`.
    pub fn note_published(&self, lowest_seq: i64) {
        let now = std::time::Instant::now();
        let mut o = self.0.lock().expect("unpoisoned");
        while o.published.front().is_some_and(|(at, _)| now.duration_since(*at) > PUBLISHED_FOR) || o.published.len() >= PUBLISHED_KEPT {
            o.published.pop_front();
        }
        o.published.push_back((now, lowest_seq));
    }

    /// The lowest outbox place this process published at or after `since`.
    pub fn lowest_published_since(&self, since: std::time::Instant) -> Option<i64> {
        let o = self.0.lock().expect("unpoisoned");
        o.published.iter().filter(|(at, _)| *at >= since).map(|(_, seq)| *seq).min()
    }

    /// Offers of events published some other way need no publishing.
    pub fn forget(&self, published: &std::collections::HashSet<i64>) {
        self.0.lock().expect("unpoisoned").rows.retain(|r| !published.contains(&r.seq));
    }
}
