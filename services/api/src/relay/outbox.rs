//! The outbox relay: unpublished events → the EVENTS stream, message id =
//! `<environment id>:<event id>` (event ids are unique per environment), so a
//! re-publish after a crash is dropped by the broker inside its duplicate
//! window.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use async_nats::{HeaderMap, jetstream};
use relay_contracts::{StreamNames, event_headers};
use relay_domain::{EndpointId, EnvironmentId, EventId};
use tokio::sync::{mpsc, watch};

use crate::{
    app::App,
    db::{self, batcher::KeptConnection, events::OutboxRow},
};

/// What an EVENTS message carries: the event's identity, never its payload.
/// Expansion needs nothing more (the api holds the envelope), and a stream of
/// ids cannot make one tenant's large events a queue of megabytes that every
/// other tenant's events wait behind.
#[derive(serde::Serialize)]
struct EventHead<'a> {
    id: EventId,
    #[serde(rename = "type")]
    event_type: &'a str,
    environment_id: EnvironmentId,
    /// An operational event's one recipient (see `app::operational`).
    #[serde(skip_serializing_if = "Option::is_none")]
    target_endpoint_id: Option<EndpointId>,
}

pub struct OutboxRelay {
    pub app: App,
    pub js: jetstream::Context,
    pub names: StreamNames,
    pub batch: i64,
    pub idle: Duration,
    /// At most this many events published and not yet taken for expansion
    /// (the EVENTS consumer's pending and unacknowledged messages). Beyond
    /// it the rest wait in the outbox, where each pass takes every
    /// environment's turn: a queue in the broker could only be first-come.
    pub stream_backlog: u64,
    /// The last pass stopped at `stream_backlog`: look again soon.
    pub held_back: std::sync::atomic::AtomicBool,
    /// An upper bound on the stream's backlog (see `room`); `u64::MAX`
    /// until first measured.
    pub backlog_bound: std::sync::atomic::AtomicU64,
    /// The outbox may hold more than this process has offered (see `pass`).
    pub backlogged: std::sync::atomic::AtomicBool,
    /// The relay's own connection (see `db::batcher`).
    pub conn: tokio::sync::Mutex<KeptConnection>,
    /// Published events whose mark is not written yet (see `MARK_DELAY`),
    /// by a pass or by `first_turns`.
    pub unmarked: std::sync::Mutex<Unmarked>,
    /// How many events the last pass published (see `settle_after_wake`).
    pub last_published: std::sync::atomic::AtomicUsize,
    /// When a pass last looked at the outbox (see `pass`).
    pub last_look: std::sync::Mutex<Option<Instant>>,
}

/// Events the broker has and the outbox does not know of yet: their marks
/// are written together, a statement per several events instead of one
/// each.
#[derive(Debug, Default)]
pub struct Unmarked {
    seqs: Vec<i64>,
    /// When the oldest of them was published.
    since: Option<Instant>,
    /// The relay last slept only until they were due: a pass that follows
    /// with nothing offered writes them and does not look at the outbox
    /// (the next backstop look does, `idle` later at most).
    woke_for_marks: bool,
}

/// How long a published event may stay unmarked. A mark is bookkeeping:
/// lost or late, it costs a re-publish that the broker drops inside its
/// duplicate window (as a mark lost to a crash does), never a delivery. At
/// moderate load (W1@150 in relay-bench) writing each mark by itself was
/// one statement and one commit per event.
const MARK_DELAY: Duration = Duration::from_millis(50);
/// Marks written at once at most, whatever their age.
const MARK_BATCH: usize = 64;

/// Events `first_turns` may put in the stream past its backlog limit, at
/// most: stalled dispatchers (the stream not taken from at all) leave the
/// rest in the outbox, where the looks take them in turns.
const FIRST_TURNS_PAST_LIMIT: u64 = 64;

/// How long a relay held back by the stream's backlog waits before looking again.
const HELD_BACK_RECHECK: Duration = Duration::from_millis(10);

/// How long a woken relay lets company gather when its last pass had some
/// (see `settle_after_wake`).
const COMPANY_PAUSE: Duration = Duration::from_millis(1);

impl OutboxRelay {
    /// How many more events the stream may take now; `None` when the
    /// consumer cannot be read (not created yet, or the broker is away):
    /// then a whole batch is tried, and the publish finds out.
    ///
    /// The broker is asked only when the running bound says the stream may
    /// be full: the bound is the last measured backlog plus everything
    /// published since (consumption only lowers the truth), so while it is
    /// under the limit the room it leaves is certainly there, and a quiet
    /// system asks once per `stream_backlog` events, not once per pass.
    async fn room(&self) -> Option<u64> {
        let bound = self.backlog_bound.load(Ordering::Relaxed);
        if bound < self.stream_backlog {
            return Some(self.stream_backlog - bound);
        }
        let consumer: jetstream::consumer::PullConsumer =
            self.js.get_consumer_from_stream(self.names.expand_durable(), self.names.events_stream()).await.ok()?;
        let info = consumer.cached_info();
        let measured = info.num_pending + info.num_ack_pending as u64;
        self.backlog_bound.store(measured, Ordering::Relaxed);
        Some(self.stream_backlog.saturating_sub(measured))
    }

    /// An event's EVENTS message: subject, headers (the message id the
    /// broker deduplicates by, and a short span's context in the event's
    /// trace, which rides to the dispatcher) and head.
    pub(super) fn message(&self, row: &db::events::OutboxRow) -> Result<(String, HeaderMap, bytes::Bytes)> {
        let (id, env) = (row.id, row.environment_id);
        let mut headers = HeaderMap::new();
        let span = tracing::info_span!("outbox_relay", event_id = %id, environment_id = %env);
        if let Some(tc) = &row.trace_context {
            relay_telemetry::set_parent_from_traceparent(&span, tc);
        }
        span.in_scope(|| relay_telemetry::inject_current(&mut relay_telemetry::NatsHeaders(&mut headers)));
        headers.insert("Nats-Msg-Id", StreamNames::event_message_id(&env.to_string(), &id.to_string()).as_str());
        headers.insert(event_headers::ENVIRONMENT_ID, env.to_string().as_str());
        headers.insert(event_headers::EVENT_TYPE, row.event_type.as_str());
        let head = EventHead { id, event_type: &row.event_type, environment_id: env, target_endpoint_id: row.target_endpoint_id };
        let head = serde_json::to_vec(&head).context("serialising an event head")?;
        Ok((self.names.events_subject(&env.to_string()), headers, head.into()))
    }

    /// Published events to be marked with the next ones (see `MARK_DELAY`).
    fn mark_later(&self, seqs: &[i64]) {
        let mut u = self.unmarked.lock().expect("not poisoned");
        u.since.get_or_insert_with(Instant::now);
        u.seqs.extend_from_slice(seqs);
    }

    pub(super) fn published(&self, n: usize) {
        let _ = self.backlog_bound.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_add(n as u64)));
    }
}

impl OutboxRelay {
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        let first_turns = self.app.outbox_offers().open_first_turns();
        tokio::join!(super::drive(&self, shutdown.clone()), self.first_turns(first_turns, shutdown));
        // What is still unmarked would only be published again after a
        // restart; written now, it is not.
        if let Err(e) = super::on_held(&self.conn, async |held| self.write_marks(held, true).await).await {
            tracing::info!(error = format!("{e:#}"), "published events left unmarked at shutdown; a restart publishes them again");
        }
    }

    /// Writes the marks that are due (all of them with `all`), or none.
    async fn write_marks(&self, held: &mut KeptConnection, all: bool) -> Result<()> {
        let due = {
            let mut u = self.unmarked.lock().expect("not poisoned");
            let due = all || u.seqs.len() >= MARK_BATCH || u.since.is_some_and(|t| t.elapsed() >= MARK_DELAY);
            if !due || u.seqs.is_empty() {
                return Ok(());
            }
            u.since = None;
            std::mem::take(&mut u.seqs)
        };
        let conn = held.get().await?;
        db::events::mark_published(&mut *conn, &due).await.context("marking events published")?;
        Ok(())
    }

    /// One pass: claim a batch, publish it, mark what the broker confirmed.
    /// No row lock is held while the broker is asked: the claim is a short
    /// lease written in one statement, so a broker that stalls holds up
    /// nothing in Postgres, and a relay that dies mid-pass leaves events that
    /// another relay takes once the claim runs out (re-published under the
    /// same message id, inside the broker's duplicate window).
    pub async fn drain_once(&self) -> Result<usize> {
        super::Pass::drain_once(self).await
    }
}

impl super::Pass for OutboxRelay {
    const FAILING: &'static str = "events stay in the outbox";

    fn batch(&self) -> usize {
        self.batch as usize
    }

    fn wake(&self) -> &crate::app::Wake {
        self.app.outbox_wake()
    }

    /// Waits for company only when it is already coming: a pass that
    /// published one event or none says publishes arrive one at a time, so
    /// the woken relay publishes the new one at once (the publish-to-attempt
    /// path's floor at moderate load); a pass that published several says
    /// they arrive faster than passes go, and a millisecond's pause lets the
    /// next pass take a batch instead of one event each (unpaced W1 spent
    /// about a tenth more CPU per delivery without it).
    fn settle_after_wake(&self) -> Duration {
        if self.last_published.load(Ordering::Relaxed) > 1 { COMPANY_PAUSE } else { Duration::ZERO }
    }

    async fn idle_for(&self) -> Duration {
        let idle = if self.held_back.load(Ordering::Relaxed) { HELD_BACK_RECHECK } else { self.idle };
        let mut u = self.unmarked.lock().expect("not poisoned");
        match u.since {
            Some(t) if MARK_DELAY.saturating_sub(t.elapsed()) < idle => {
                u.woke_for_marks = true;
                MARK_DELAY.saturating_sub(t.elapsed())
            }
            _ => idle,
        }
    }

    async fn drain_once(&self) -> Result<usize> {
        let passed = super::on_held(&self.conn, async |held| self.pass(held).await).await;
        // Failed or not, what the pass left says whether offers wait, and
        // whether they may go past the stream's limit (see `first_turns`).
        let past_the_limit = self.backlog_bound.load(Ordering::Relaxed) < self.stream_backlog.saturating_add(FIRST_TURNS_PAST_LIMIT);
        self.app.outbox_offers().set_backlogged(self.backlogged.load(Ordering::Relaxed), past_the_limit);
        passed
    }
}

impl OutboxRelay {
    /// Events this process just wrote are published as they were offered,
    /// with no query to find them, unless the relay is catching up on a
    /// backlog (the last look filled its batch or the stream's room, an
    /// offer was refused, or a publish failed): then offers are set aside
    /// and the outbox is read in turns across environments, which is what
    /// keeps one environment's burst from going ahead of the others'. A look
    /// is also made once `idle` has passed since the last, offers or not:
    /// while publishes keep the relay busy with offers it never sleeps out
    /// its idle interval, and rows nobody offered it (an api that died
    /// between its commit and its offer, a notification lost while the
    /// listener reconnected) would otherwise wait for publishing to pause.
    async fn pass(&self, held: &mut KeptConnection) -> Result<usize> {
        self.last_published.store(0, Ordering::Relaxed);
        let (offered, overflowed) = self.app.outbox_offers().take();
        // Expanded at publish: marked with the rest (and before any look).
        let expanded = self.app.outbox_offers().take_expanded();
        if !expanded.is_empty() {
            self.mark_later(&expanded);
        }
        let woke_for_marks = std::mem::take(&mut self.unmarked.lock().expect("not poisoned").woke_for_marks);
        let look_due = self.last_look.lock().expect("not poisoned").is_none_or(|at| at.elapsed() >= self.idle);
        if offered.is_empty() && !overflowed && !self.backlogged.load(Ordering::Relaxed) {
            if woke_for_marks {
                // Nothing new: the marks were what the relay slept for.
                self.write_marks(held, true).await?;
                return Ok(0);
            }
            if !expanded.is_empty() && !look_due {
                // Woken by events expanded at publish: their marks wait
                // for company (`MARK_DELAY`), and nothing else is to do.
                self.write_marks(held, false).await?;
                return Ok(0);
            }
        }
        if overflowed {
            self.backlogged.store(true, Ordering::Relaxed);
        }
        let limit = self.room().await.map_or(self.batch, |room| self.batch.min(room as i64));
        if limit == 0 {
            self.held_back.store(true, Ordering::Relaxed);
            self.backlogged.store(true, Ordering::Relaxed);
            // What `first_turns` published meanwhile is marked all the same.
            self.write_marks(held, false).await?;
            return Ok(0);
        }
        let shortcut = !offered.is_empty() && !look_due && !self.backlogged.load(Ordering::Relaxed) && offered.len() as i64 <= limit;
        let rows = if shortcut {
            self.held_back.store(false, Ordering::Relaxed);
            in_turns(offered)
        } else {
            // A look must not find events published but unmarked.
            self.write_marks(held, true).await?;
            let conn = held.get().await?;
            *self.last_look.lock().expect("not poisoned") = Some(Instant::now());
            let rows = db::events::claim_unpublished(&mut *conn, limit, RELAY_CLAIM).await.context("claiming unpublished events")?;
            // Held back: the stream's room, not the outbox, ended the pass.
            self.held_back.store(limit < self.batch && rows.len() as i64 >= limit, Ordering::Relaxed);
            // Caught up once a look finds less than it could take.
            self.backlogged.store(rows.len() as i64 >= limit, Ordering::Relaxed);
            rows
        };
        if rows.is_empty() {
            return Ok(0);
        }
        // In the claim's turns (each environment's first, then each one's
        // second, ...), so no environment's events wait behind another's in the stream.
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let messages = rows.iter().map(|row| self.message(row)).collect::<Result<Vec<_>>>()?;
        // Left set only if this future is dropped mid-publish (shutdown):
        // offers then go past until the next pass clears it.
        self.app.outbox_offers().set_passing(Some(rows.iter().map(|r| r.environment_id).collect()));
        let (stored, first_error) = crate::broker::publish_all(&self.js, messages).await;
        self.app.outbox_offers().set_passing(None);
        let (mut published, mut refused): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
        for (seq, ok) in seqs.into_iter().zip(stored.iter().copied()) {
            if ok { published.push(seq) } else { refused.push(seq) }
        }
        self.published(published.len());
        for (r, ok) in rows.iter().zip(&stored) {
            if *ok {
                tracing::debug!(target: "relay_hops", hop = "outbox_published", event_id = %r.id);
            }
        }
        self.app
            .outbox_offers()
            .note_environments_published(rows.iter().zip(&stored).filter(|(_, ok)| **ok).map(|(r, _)| r.environment_id));
        if let Some(lowest) = published.iter().min() {
            self.app.outbox_offers().note_published(*lowest);
        }
        if !published.is_empty() {
            if shortcut {
                self.mark_later(&published);
            } else {
                // Lost to a Postgres crash, this is a second publish that the
                // broker or the expansion ledger drops (see cheap commits in `super`).
                let conn = held.get().await?;
                db::events::mark_published(&mut *conn, &published).await.context("marking events published")?;
                // Offered while this look found them: already published.
                self.app.outbox_offers().forget(&published.iter().copied().collect());
            }
            self.write_marks(held, false).await?;
        }
        if !refused.is_empty() {
            self.backlogged.store(true, Ordering::Relaxed);
            if !shortcut {
                let conn = held.get().await?;
                // The next pass may take them at once, rather than after the claim.
                db::events::release_refused(&mut *conn, &refused).await.context("releasing events the broker refused")?;
            }
        }
        self.last_published.store(published.len(), Ordering::Relaxed);
        match first_error {
            Some(e) if published.is_empty() => Err(e.context("publishing to EVENTS")),
            _ => Ok(published.len()),
        }
    }
}

/// Offered events in turns across environments, as a claim orders them
/// (each environment's first, then each one's second, ...), each
/// environment's in the order offered: the broker stores a pass's events in
/// the order they are sent, so a quiet environment's one offer, made while a
/// burst's hundred waited for the same pass, is the stream's second, not its
/// hundred-and-first.
fn in_turns(mut rows: Vec<OutboxRow>) -> Vec<OutboxRow> {
    let mut turn_of: std::collections::HashMap<EnvironmentId, usize> = std::collections::HashMap::new();
    let turns: Vec<usize> = rows
        .iter()
        .map(|r| {
            let n = turn_of.entry(r.environment_id).or_default();
            *n += 1;
            *n
        })
        .collect();
    if turn_of.len() < 2 {
        return rows;
    }
    let mut keyed: Vec<(usize, OutboxRow)> = turns.into_iter().zip(rows.drain(..)).collect();
    keyed.sort_by_key(|(turn, _)| *turn);
    keyed.into_iter().map(|(_, r)| r).collect()
}

/// Events one `first_turns` publish carries at most.
const FIRST_TURNS_BATCH: usize = 64;

impl OutboxRelay {
    /// A quiet environment's event is not held behind a neighbour's backlog.
    ///
    /// While the outbox relay catches up on a backlog it sets offers aside and
    /// reads the outbox in turns across environments, and while the EVENTS
    /// stream is at its backlog limit it waits for room. Both are right for the
    /// environment bursting, and both made everyone else's events wait for the
    /// relay's passes: behind one environment's burst (relay-bench `w5`) the
    /// quiet environment's events waited 5–8 ms (p50) and 30–40 ms (p99) from
    /// their commit to the broker, where alone they wait under 2 ms — the
    /// relay's passes, each a claim under a saturated database, came about
    /// every 14 ms.
    ///
    /// So an offer made while the relay is backlogged, or would publish it
    /// behind other environments' events (a pass of theirs in progress, or
    /// their offers waiting for the next pass), of an event of an
    /// environment none of whose events was published in the last
    /// `FIRST_TURN_GAP` (see `app::outbox_offers`), comes here and is
    /// published at once, past the stream's limit: the dispatchers take the
    /// stream's events in fair turns, so past the limit it waits one turn, not
    /// the burst. One environment gets at most one event a gap this way, a few
    /// hundred a second against the thousands the dispatchers take, so the
    /// limit still holds the burst back.
    ///
    /// Invariant: the outbox stays the record. What this publishes is marked
    /// with the relay's next marks, as a shortcut pass's events are; an event
    /// the broker refused, or one a look finds before its mark, is published
    /// (again) by the relay — the broker drops a second publish inside its
    /// duplicate window. Events with an ordering key never come here: their
    /// order is the outbox's.
    async fn first_turns(&self, mut rows: mpsc::UnboundedReceiver<OutboxRow>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let first = tokio::select! {
                row = rows.recv() => row,
                _ = shutdown.wait_for(|stopped| *stopped) => None,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            while batch.len() < FIRST_TURNS_BATCH {
                match rows.try_recv() {
                    Ok(row) => batch.push(row),
                    Err(_) => break,
                }
            }
            self.publish_first_turns(batch).await;
        }
    }

    async fn publish_first_turns(&self, batch: Vec<OutboxRow>) {
        let messages = match batch.iter().map(|row| self.message(row)).collect::<Result<Vec<_>>>() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "could not frame an event; the relay's next look publishes it");
                self.app.outbox_offers().look_at_outbox();
                return;
            }
        };
        let (stored, first_error) = crate::broker::publish_all(&self.js, messages).await;
        let mut published = Vec::with_capacity(batch.len());
        for (row, _) in batch.iter().zip(&stored).filter(|(_, ok)| **ok) {
            tracing::debug!(target: "relay_hops", hop = "outbox_published", event_id = %row.id, first_turn = true);
            published.push(row.seq);
        }
        if let Some(e) = first_error {
            tracing::warn!(error = format!("{e:#}"), "the broker refused an event; the relay's next look publishes it");
            self.app.outbox_offers().look_at_outbox();
        }
        if published.is_empty() {
            return;
        }
        self.published(published.len());
        if let Some(lowest) = published.iter().min() {
            self.app.outbox_offers().note_published(*lowest);
        }
        self.mark_later(&published);
    }
}

/// How long a relay's claim on rows it is publishing lasts. Longer than any
/// publish takes; shorter than the broker's duplicate window, so rows a dead
/// relay had already published are recognised when published again.
pub(crate) const RELAY_CLAIM: Duration = Duration::from_secs(30);
const _: () = assert!(RELAY_CLAIM.as_secs() * 2 <= crate::broker::DUPLICATE_WINDOW.as_secs(), "re-publishes must be deduplicated");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passes_events_go_in_turns_across_environments_each_in_its_order() {
        let (b, q, o) = (EnvironmentId::mint(), EnvironmentId::mint(), EnvironmentId::mint());
        let row = |seq, environment_id| OutboxRow {
            seq,
            id: EventId::mint(),
            environment_id,
            event_type: "t".into(),
            trace_context: None,
            target_endpoint_id: None,
        };
        let offered = vec![row(1, b), row(2, b), row(3, b), row(4, o), row(5, b), row(6, q), row(7, o)];
        let seqs: Vec<i64> = in_turns(offered).iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 4, 6, 2, 7, 3, 5]);
        let alone: Vec<i64> = in_turns(vec![row(9, b), row(8, b)]).iter().map(|r| r.seq).collect();
        assert_eq!(alone, [9, 8], "one environment's offers keep their order");
    }
}
