//! What this process offers its own outbox relay: the events it just
//! wrote, so that the relay publishes them without a query to find them,
//! and — while the relay catches up on a backlog, or publishes other
//! environments' events — the events of environments it has not published
//! for lately, which go past the backlog and the pass in progress
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
    /// How many of `rows` each environment has.
    rows_of: std::collections::HashMap<EnvironmentId, usize>,
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
    /// The relay's last pass left it catching up, room past the limit or not.
    catching_up: bool,
    /// The environments of the events the relay is publishing now, if it
    /// is: another's offer goes to `first_turns` as while `backlogged`,
    /// rather than wait for this pass and the next (behind a burst, a pass
    /// of hundreds of its events).
    passing: Option<std::collections::HashSet<EnvironmentId>>,
    first_turns: Option<tokio::sync::mpsc::UnboundedSender<db::events::OutboxRow>>,
    /// Events expanded at publish (`app::at_publish`), to be marked
    /// published with the relay's next marks.
    expanded: Vec<i64>,
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
        // Behind others' events: a backlog, others' events being published,
        // or others' offers waiting for the next pass.
        let env = row.environment_id;
        let past = o.backlogged
            || o.passing.as_ref().is_some_and(|envs| !envs.contains(&env))
            || o.rows_of.len() > usize::from(o.rows_of.contains_key(&env));
        let row = match &o.first_turns {
            Some(first_turns) if past && !ordered && row.target_endpoint_id.is_none() => {
                let now = std::time::Instant::now();
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
            *o.rows_of.entry(row.environment_id).or_default() += 1;
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

    /// Whether this process's relay takes offers and is not catching up on
    /// a backlog: an event may then be expanded at publish (`app::at_publish`).
    pub fn relay_keeps_up(&self) -> bool {
        let o = self.0.lock().expect("unpoisoned");
        o.open && !o.catching_up && !o.overflowed
    }

    /// An event expanded at publish needs no publishing, only its mark.
    /// True for the first since the relay last took them: the caller wakes
    /// the relay, which then writes them with its next marks (the rest
    /// join them meanwhile, with no wake-up each).
    pub fn mark_expanded(&self, seq: i64) -> bool {
        let mut o = self.0.lock().expect("unpoisoned");
        let first = o.expanded.is_empty();
        if o.expanded.len() < MAX_OFFERS {
            o.expanded.push(seq);
        }
        // Past the bound a mark is dropped: a look publishes that event
        // again, and its expansion is a duplicate the ledger ignores.
        first
    }

    /// The events expanded at publish since the last take, to be marked.
    pub fn take_expanded(&self) -> Vec<i64> {
        std::mem::take(&mut self.0.lock().expect("unpoisoned").expanded)
    }

    /// Whether the relay's last pass left it catching up on a backlog, and
    /// whether the stream may take events past its limit.
    pub fn set_backlogged(&self, backlogged: bool, room_past_the_limit: bool) {
        let mut o = self.0.lock().expect("unpoisoned");
        o.backlogged = backlogged && room_past_the_limit;
        o.catching_up = backlogged;
    }

    /// The relay publishes events of these environments now (`Some`), or
    /// no longer (`None`).
    pub fn set_passing(&self, envs: Option<std::collections::HashSet<EnvironmentId>>) {
        self.0.lock().expect("unpoisoned").passing = envs;
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
        o.rows_of.clear();
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
        let mut o = self.0.lock().expect("unpoisoned");
        let o = &mut *o;
        o.rows.retain(|r| !published.contains(&r.seq));
        o.rows_of.clear();
        for r in &o.rows {
            *o.rows_of.entry(r.environment_id).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use relay_domain::EventId;

    use super::*;

    fn row(seq: i64, env: EnvironmentId) -> db::events::OutboxRow {
        db::events::OutboxRow {
            seq,
            id: EventId::mint(),
            environment_id: env,
            event_type: "t".into(),
            trace_context: None,
            target_endpoint_id: None,
        }
    }

    /// Behind a burst's offers waiting for the next pass, or its pass in
    /// progress, a quiet environment's event goes past; the burst's own,
    /// and an event with an ordering key, wait for the relay.
    #[test]
    fn a_quiet_environments_offer_goes_past_others_offers_and_the_pass_in_progress() {
        let offers = OutboxOffers::default();
        offers.open();
        let mut first_turns = offers.open_first_turns();
        let (burst, quiet, other) = (EnvironmentId::mint(), EnvironmentId::mint(), EnvironmentId::mint());
        offers.offer(row(1, burst), false);
        offers.offer(row(2, burst), false);
        assert!(first_turns.try_recv().is_err(), "alone, the burst's offers wait for the relay's pass");
        offers.offer(row(3, quiet), false);
        assert_eq!(first_turns.try_recv().map(|r| r.seq).ok(), Some(3), "behind the burst's waiting offers: past them");
        offers.offer(row(4, other), true);
        assert!(first_turns.try_recv().is_err(), "an ordered event keeps the outbox's order");

        let (taken, _) = offers.take();
        assert_eq!(taken.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 4]);
        offers.set_passing(Some([burst].into_iter().collect()));
        offers.offer(row(5, burst), false);
        offers.offer(row(6, other), false);
        assert_eq!(first_turns.try_recv().map(|r| r.seq).ok(), Some(6), "behind the burst's pass in progress: past it");
        offers.offer(row(7, other), false);
        assert!(first_turns.try_recv().is_err(), "one event a gap per environment goes past");
        offers.set_passing(None);
        let (taken, _) = offers.take();
        assert_eq!(taken.iter().map(|r| r.seq).collect::<Vec<_>>(), [5, 7]);
        offers.offer(row(8, EnvironmentId::mint()), false);
        assert!(first_turns.try_recv().is_err(), "nothing ahead of it: the relay's next pass takes it");
    }
}
