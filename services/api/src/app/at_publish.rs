//! Expansion at publish: an event this api just wrote is expanded by the
//! api itself, and its first attempts go straight to a dispatcher that
//! takes attempts in hand (`TakeAttempts`), instead of the long way —
//! the outbox relay, EVENTS, the dispatcher's turns and its `ExpandBatch`.
//!
//! Why: the long way is three hops and a seam round trip before the
//! expansion's statement begins, each with its CPU (a broker publish and
//! its ack, a consumer's delivery and ack, a mark, a gRPC call). Measured
//! at 1,500 deliveries a second (relay-bench `w1@150`) this way costs 6–8 %
//! less CPU; the median to the first attempt did not move, since what is
//! left of it is the publish's commit and the expansion's (docs/benchmarks).
//! The expansion itself is the same statement either way
//! (`App::expand_batch`): the ledger, the subscribers' locks, the in-flight
//! caps and the payload filters are applied as for a dispatcher's call.
//!
//! When: only while the long way would add nothing but hops — this api's
//! outbox relay is keeping up (not catching up on a backlog, where the
//! outbox's turns across environments are what keep a burst from going
//! first), the event has no ordering key (a key's order is kept by the
//! outbox and the expansion's deferral), a dispatcher is taking attempts
//! from this api, and within its bounds: at most `cap` such expansions at
//! once, and a quarter of those per environment, so a burst past its share
//! takes the long way, in turns, while its neighbours' events still go
//! straight. Anything not taken here is offered to the outbox relay as
//! before, and so is an event whose expansion here failed.
//!
//! What stays true: the event row is the outbox row, committed before any
//! of this. An api that dies before the expansion commits leaves the row
//! unpublished, and a relay publishes it; one that dies after leaves its
//! attempts claimed and leased for the dispatcher, which never got them,
//! and the delivery relay hands them out when the lease runs out. An event
//! expanded here is marked published with the outbox relay's next marks
//! (`OutboxOffers::mark_expanded`); one that a relay's look publishes
//! before that is expanded again as a duplicate, which the ledger makes a
//! no-op. Attempts a dispatcher cannot take (its stream closed or full) are
//! released at once, due now, for the delivery relay.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use relay_domain::EnvironmentId;
use tokio::sync::mpsc;
use tracing::Instrument as _;

use super::{
    App,
    deliveries::{Claim, ExpandItem, Material},
    expansion::ExpandAsk,
};
use crate::db;

/// Batches of attempts waiting for one dispatcher's stream, at most; past
/// that it is not keeping up and the attempts are released for the relay.
const TAKER_BACKLOG: usize = 256;

/// The dispatchers taking attempts from this api, and how many expansions
/// at publish are in flight.
#[derive(Debug)]
pub struct AtPublish {
    cap: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    takers: Vec<Taker>,
    /// Which taker the next expansion's attempts go to (in turns).
    turn: usize,
    next_id: u64,
    in_flight: usize,
    in_flight_of: HashMap<EnvironmentId, usize>,
    /// The api is stopping: no taker is kept or taken in.
    closed: bool,
}

/// A dispatcher taking attempts in hand.
#[derive(Debug, Clone)]
pub struct Taker {
    id: u64,
    pub claim: Claim,
    tx: mpsc::Sender<Vec<Material>>,
}

/// A dispatcher's place among the takers, given up when dropped (its stream ended).
#[derive(Debug)]
pub struct Joined {
    at_publish: Arc<AtPublish>,
    id: u64,
}

impl Drop for Joined {
    fn drop(&mut self) {
        let mut s = self.at_publish.state.lock().unwrap_or_else(|p| p.into_inner());
        s.takers.retain(|t| t.id != self.id);
    }
}

/// One expansion at publish counted in, counted out when dropped.
#[derive(Debug)]
struct Slot {
    at_publish: Arc<AtPublish>,
    env: EnvironmentId,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.at_publish.state.lock().unwrap_or_else(|p| p.into_inner());
        s.in_flight -= 1;
        if let Some(n) = s.in_flight_of.get_mut(&self.env) {
            *n -= 1;
            if *n == 0 {
                s.in_flight_of.remove(&self.env);
            }
        }
    }
}

impl AtPublish {
    /// `cap`: expansions at publish in flight at once; 0 turns them off.
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self { cap, state: Mutex::default() })
    }

    /// One environment's share of `cap`.
    fn share(&self) -> usize {
        (self.cap / 4).max(1)
    }

    /// A dispatcher takes attempts from now on, until `Joined` is dropped.
    pub fn join(self: &Arc<Self>, claim: Claim) -> (Joined, mpsc::Receiver<Vec<Material>>) {
        let (tx, rx) = mpsc::channel(TAKER_BACKLOG);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.next_id += 1;
        let id = s.next_id;
        // Stopping: the sender goes at once, and the stream ends.
        if !s.closed {
            s.takers.push(Taker { id, claim, tx });
        }
        (Joined { at_publish: self.clone(), id }, rx)
    }

    /// Lets every taker go (the api is stopping): their streams end once
    /// they have sent what they hold, and no stream is taken in after.
    pub fn close(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.closed = true;
        s.takers.clear();
    }

    /// A slot and the taker whose turn it is, if this environment's event
    /// may be expanded at publish now.
    fn take_slot(self: &Arc<Self>, env: EnvironmentId) -> Option<(Slot, Taker)> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.takers.is_empty() || s.in_flight >= self.cap || s.in_flight_of.get(&env).copied().unwrap_or(0) >= self.share() {
            return None;
        }
        s.takers.retain(|t| !t.tx.is_closed());
        if s.takers.is_empty() {
            return None;
        }
        s.turn = s.turn.wrapping_add(1);
        let taker = s.takers[s.turn % s.takers.len()].clone();
        s.in_flight += 1;
        *s.in_flight_of.entry(env).or_default() += 1;
        Some((Slot { at_publish: self.clone(), env }, taker))
    }
}

/// The attempts sent to one dispatcher, as its stream reads them. Dropped
/// (the dispatcher went away), it gives up its place among the takers and
/// releases what it still held for the relay, instead of leaving it to
/// wait out its lease.
pub struct Taken {
    app: App,
    _joined: Joined,
    rx: mpsc::Receiver<Vec<Material>>,
    claim: Claim,
}

impl Taken {
    pub fn new(app: App, joined: Joined, rx: mpsc::Receiver<Vec<Material>>, claim: Claim) -> Self {
        Self { app, _joined: joined, rx, claim }
    }
}

impl futures::Stream for Taken {
    type Item = Vec<Material>;

    fn poll_next(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.rx.close();
        let mut left = Vec::new();
        while let Ok(batch) = self.rx.try_recv() {
            left.extend(batch);
        }
        if !left.is_empty() {
            let (app, claim) = (self.app.clone(), self.claim);
            tokio::spawn(async move { app.release_untaken(&left, claim).await });
        }
    }
}

impl App {
    /// Expands an event this api just wrote, if it may go straight (see the
    /// module's doc); gives the row back when it takes the long way.
    pub(crate) fn expand_at_publish(&self, row: db::events::OutboxRow, ordered: bool) -> Result<(), db::events::OutboxRow> {
        if ordered || row.target_endpoint_id.is_some() || !self.outbox_offers.relay_keeps_up() {
            return Err(row);
        }
        let Some((slot, taker)) = self.at_publish.take_slot(row.environment_id) else { return Err(row) };
        // A child of the publish's span: the event's trace goes on from it.
        let span = tracing::info_span!(
            "expand",
            event_id = %row.id,
            at_publish = true,
            created = tracing::field::Empty,
            duplicate = tracing::field::Empty
        );
        let trace_context = span.in_scope(relay_telemetry::current_traceparent).or_else(|| row.trace_context.clone());
        let app = self.clone();
        // Its own task: the publish is answered on its commit, and a client
        // that goes away cannot drop an expansion half done.
        tokio::spawn(
            async move {
                let _slot = slot;
                let ask = ExpandAsk {
                    item: ExpandItem {
                        event_id: row.id,
                        environment_id: row.environment_id,
                        event_type: row.event_type.clone(),
                        trace_context: trace_context.clone(),
                        target: None,
                    },
                    claim: Some(taker.claim),
                };
                let answer = match app.expand_batch(vec![ask], false).await {
                    Ok(mut answers) => answers.pop().unwrap_or_else(|| Err(crate::error::AppError::internal(anyhow::anyhow!("no answer")))),
                    Err(e) => Err(e),
                };
                match answer {
                    Ok(expanded) => {
                        tracing::Span::current().record("created", expanded.created).record("duplicate", expanded.duplicate);
                        app.metrics.expanded_at_publish.inc();
                        if app.outbox_offers.mark_expanded(row.seq) {
                            app.outbox_wake.wake();
                        }
                        let mut attempts = expanded.attempts;
                        if attempts.is_empty() {
                            return;
                        }
                        for m in &mut attempts {
                            m.traceparent = m.traceparent.take().or_else(|| trace_context.clone());
                        }
                        if let Err(mpsc::error::TrySendError::Full(unsent) | mpsc::error::TrySendError::Closed(unsent)) =
                            taker.tx.try_send(attempts)
                        {
                            app.release_untaken(&unsent, taker.claim).await;
                        }
                    }
                    Err(e) => {
                        // The long way, as if it had never been tried here.
                        tracing::warn!(event_id = %row.id, error = ?e, "expanding at publish failed; the outbox relay takes the event");
                        app.outbox_offers.offer(row, false);
                        app.outbox_wake.wake();
                    }
                }
            }
            .instrument(span),
        );
        Ok(())
    }

    /// First attempts claimed for a dispatcher that could not take them:
    /// due now, unclaimed, for the delivery relay.
    pub(crate) async fn release_untaken(&self, attempts: &[Material], claim: Claim) {
        let ids: Vec<relay_domain::DeliveryId> = attempts.iter().map(|m| m.delivery_id).collect();
        tracing::warn!(count = ids.len(), "a dispatcher could not take first attempts; the relay will");
        match db::deliveries::release_untaken_first_attempts(&self.db, &ids, claim.claimant).await {
            Ok(_) => self.deliveries_wake.wake(),
            Err(e) => tracing::warn!(error = %e, "releasing first attempts failed; their leases will run out"),
        }
    }

    /// Dispatchers taking attempts from this api (`TakeAttempts`).
    pub fn at_publish(&self) -> &Arc<AtPublish> {
        &self.at_publish
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim { claimant: relay_domain::DispatcherId::mint(), hold: std::time::Duration::from_secs(10) }
    }

    /// Slots are bounded in all and per environment, go to the takers in
    /// turns, and a taker that left is never chosen.
    #[test]
    fn slots_are_bounded_and_go_to_takers_in_turns() {
        let at = AtPublish::new(8);
        let (burst, quiet) = (EnvironmentId::mint(), EnvironmentId::mint());
        assert!(at.take_slot(burst).is_none(), "no taker: the long way");
        let (a, _rx_a) = at.join(claim());
        let (b, _rx_b) = at.join(claim());
        let first = at.take_slot(burst).expect("a slot");
        let second = at.take_slot(burst).expect("a second slot");
        assert_ne!(first.1.id, second.1.id, "in turns across takers");
        assert!(at.take_slot(burst).is_none(), "an environment's share is a quarter of the cap");
        let quiet_slot = at.take_slot(quiet).expect("another environment has its own share");
        drop(first);
        assert!(at.take_slot(burst).is_some(), "a slot counted out is free again");
        drop(b);
        for _ in 0..3 {
            let (_, t) = at.take_slot(quiet).map(|(s, t)| (drop(s), t)).expect("a slot");
            assert_eq!(t.id, a.id, "only the taker still joined");
        }
        drop((second, quiet_slot));
        let s = at.state.lock().unwrap();
        assert_eq!((s.in_flight, s.in_flight_of.len(), s.takers.len()), (0, 0, 1), "every slot counted out; one taker left");
    }

    #[tokio::test]
    async fn closing_ends_every_takers_stream_and_takes_no_new_one() {
        let at = AtPublish::new(8);
        let (_joined, mut rx) = at.join(claim());
        at.close();
        assert!(rx.recv().await.is_none(), "the stream of a taker let go ends");
        let (_later, mut later_rx) = at.join(claim());
        assert!(later_rx.recv().await.is_none(), "a stream opened while stopping ends at once");
        assert!(at.take_slot(EnvironmentId::mint()).is_none());
    }

    #[test]
    fn a_cap_of_zero_turns_it_off() {
        let at = AtPublish::new(0);
        let (_joined, _rx) = at.join(claim());
        assert!(at.take_slot(EnvironmentId::mint()).is_none());
    }

    #[test]
    fn a_taker_whose_stream_closed_is_not_chosen() {
        let at = AtPublish::new(8);
        let (_joined, rx) = at.join(claim());
        drop(rx);
        assert!(at.take_slot(EnvironmentId::mint()).is_none(), "its channel is closed");
    }
}
