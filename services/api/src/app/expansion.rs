//! Expansion: one delivery per subscribed, active endpoint of each event,
//! exactly once per event, and first attempts handed out at once — to the
//! dispatcher that asked, with their material, or to the broker.

use std::{collections::HashMap, time::Duration};

use anyhow::Context;
use relay_domain::{DeliveryId, EndpointId, Reason};
use sqlx::PgConnection;

use super::{
    App,
    deliveries::*,
    material::{SendingByEndpoint, StoredSecrets},
};
use crate::{
    db,
    error::{AppError, AppResult},
};
/// The lease first attempts are written with when this api hands them to
/// the broker itself, after the commit. Short, because it stands for "the
/// publish may not have happened": if this process dies between the commit
/// and the broker's ack, the relay re-publishes them this soon. It is well
/// inside the broker's duplicate window, so re-publishing one that did land
/// is dropped by the broker; the relay's re-publish then extends the lease
/// to the full length for attempts still in progress.
const DIRECT_PUBLISH_LEASE: Duration = Duration::from_secs(10);
const _: () = assert!(DIRECT_PUBLISH_LEASE.as_secs() * 4 <= crate::broker::DUPLICATE_WINDOW.as_secs(), "re-publishes must be deduplicated");

/// One event to expand, and who asked: a dispatcher that takes the first
/// attempts in hand names itself (`claim`).
#[derive(Debug, Clone)]
pub struct ExpandAsk {
    pub item: ExpandItem,
    pub claim: Option<Claim>,
}

impl App {
    /// One delivery per matching endpoint, exactly once per event, through
    /// the expansion queues (items of concurrent calls share their batches;
    /// `express`: the items are of quiet environments, see
    /// `app::expansion_queues`). Each item answers as `expand` would, in order.
    pub async fn expand_batch(&self, asks: Vec<ExpandAsk>, express: bool) -> AppResult<Vec<AppResult<Expanded>>> {
        Ok(self.batchers().expansions.call_all(asks, express).await)
    }

    /// One batch of the expansion batcher, in one statement that commits by
    /// itself (`db::deliveries::expand`): the events are checked, claimed in
    /// the ledger (so a redelivered event is a no-op) and their deliveries
    /// written. First attempts within their endpoint's in-flight cap are
    /// written already leased: those of a dispatcher that takes them in
    /// hand come back to it with their material (as far as a reply's
    /// payload budget goes), claimed for it; the rest are handed to the
    /// broker at once; everything else waits, due, for the relay.
    /// `express`: the batch is the express queue's (see `app::lease_guard`).
    pub(crate) async fn expand_on(
        &self,
        conn: &mut PgConnection,
        asks: &[ExpandAsk],
        express: bool,
    ) -> AppResult<Vec<AppResult<Expanded>>> {
        let cap = self.direct.as_ref().map_or(0, |d| d.endpoint_cap);
        for a in asks {
            tracing::debug!(target: "relay_hops", hop = "expand_begin", event_id = %a.item.event_id, batch = asks.len());
        }
        let refused = super::filtering::refused(conn, &asks.iter().map(|a| &a.item).collect::<Vec<_>>()).await?;
        let item = |a: &ExpandAsk| a.item.clone();
        let events = db::deliveries::ToExpand {
            environment_id: asks.iter().map(|a| a.item.environment_id).collect(),
            event_id: asks.iter().map(|a| a.item.event_id).collect(),
            event_type: asks.iter().map(|a| item(a).event_type).collect(),
            trace_context: asks.iter().map(|a| item(a).trace_context).collect(),
            target: asks.iter().map(|a| a.item.target).collect(),
            // Attempts in a dispatcher's hands are leased as long as its
            // claim on them holds; past that the relay hands them out
            // again (and whoever then holds the claim sends).
            lease_ms: asks
                .iter()
                .map(|a| a.claim.map_or(DIRECT_PUBLISH_LEASE, |c| c.hold).as_millis().try_into().unwrap_or(i64::MAX))
                .collect(),
            claimant: asks.iter().map(|a| a.claim.map(|c| c.claimant)).collect(),
            refused_ord: refused.ord,
            refused_endpoint: refused.endpoint_id,
        };
        // Pre-leasing counts in-flight attempts like a relay pass does; the
        // two take turns.
        let rows = {
            let _leasing = match &self.direct {
                Some(_) if express => Some(self.lease_guard.lock_express().await),
                Some(_) => Some(self.lease_guard.lock().await),
                None => None,
            };
            // Subscription filtering (event types, and payload filters as
            // judged above) happens here, not at send time: a row that
            // exists is a row that will be sent. Every attempt of a
            // delivery continues its event's expansion trace.
            for a in asks {
                tracing::debug!(target: "relay_hops", hop = "expand_locked", event_id = %a.item.event_id);
            }
            db::deliveries::expand(conn, &events, cap, relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64).await?
        };
        for a in asks {
            tracing::debug!(target: "relay_hops", hop = "expand_done", event_id = %a.item.event_id);
        }
        // Rows beyond their endpoint's cap wait for an outcome of that
        // endpoint to free a slot, which fills it: every api refills from
        // now on (no relay pass could take them sooner). An api that hands
        // nothing out leaves every row to the relays.
        let waiting = rows.iter().any(|r| r.id.is_some() && !r.leased && !r.held && !r.gated);
        // Rows at a rate gate wait for a relay pass, which opens it.
        if rows.iter().any(|r| r.id.is_some() && r.gated) {
            db::deliveries::notify_due(conn).await?;
            self.deliveries_wake.wake();
        }
        if waiting {
            match &self.direct {
                Some(_) => {
                    db::deliveries::notify_capped(conn).await?;
                    self.slots_awaited.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                None => {
                    db::deliveries::notify_due(conn).await?;
                    self.deliveries_wake.wake();
                }
            }
        }

        // Each item has a row for each delivery it created, or one row.
        let mut to_broker: Vec<crate::queue::Job<'_>> = Vec::new();
        let mut sending_of = SendingByEndpoint::new();
        let mut envelope_of: HashMap<i64, Vec<u8>> = HashMap::new();
        let now = self.clock.now();
        let mut out: Vec<Option<AppResult<Expanded>>> = asks.iter().map(|_| None).collect();
        for row in &rows {
            let i = (row.ord - 1) as usize;
            let ask = &asks[i];
            let answer = out[i].get_or_insert_with(|| match &row.stored_type {
                None => Err(AppError::not_found("event")),
                Some(t) if *t != ask.item.event_type => Err(AppError::invalid(
                    Reason::EventMismatch,
                    format!("event {} does not have that environment and type", ask.item.event_id),
                )),
                // Every mention of the event, so that none of them is acked
                // as done while it waits.
                Some(_) if row.deferred => Err(AppError::new(
                    crate::error::ErrorCode::Unavailable,
                    Reason::Deferred,
                    format!("event {} waits for an earlier event of its ordering key to be expanded; ask again", ask.item.event_id),
                )),
                Some(_) if !row.fresh => Ok(Expanded::duplicate()),
                Some(_) => Ok(Expanded::none()),
            });
            let (Some(id), Ok(expanded)) = (row.id, answer) else { continue };
            expanded.created += 1;
            if !row.leased {
                continue;
            }
            let endpoint_id = row.endpoint_id.context("a created row names its endpoint")?;
            if !row.in_hand {
                to_broker.push(crate::queue::Job {
                    delivery_id: id,
                    endpoint_id,
                    environment_id: ask.item.environment_id,
                    attempt: 1,
                    generation: 0,
                    trace_context: row.trace_context.as_deref(),
                });
                continue;
            }
            if let Some(body) = &row.envelope {
                envelope_of.insert(row.ord, body.clone());
            }
            match self.first_attempt(row, id, endpoint_id, ask, envelope_of.get(&row.ord), now, &mut sending_of) {
                Ok(m) => expanded.attempts.push(m),
                // Claimed for the asking dispatcher, which is not handed it:
                // its lease and claim run out and the relay takes it.
                Err(e) => {
                    tracing::warn!(delivery_id = %id, error = ?e, "no material for a first attempt; it waits for its lease to run out")
                }
            }
        }
        if !to_broker.is_empty() {
            self.dispatch_leased(&to_broker).await;
        }
        let claim = asks.iter().find_map(|a| a.claim).filter(|_| self.direct.is_some());
        // The lanes opened here hand their heads over with their followers
        // (the rows of the same key this expansion queued behind them).
        if let Some(claim) = claim {
            let mut heads: Vec<(usize, Material)> = Vec::new();
            for (i, o) in out.iter_mut().enumerate() {
                if let Some(Ok(expanded)) = o
                    && expanded.attempts.iter().any(|m| m.ordering.is_some())
                {
                    let (lane, unordered) = std::mem::take(&mut expanded.attempts).into_iter().partition(|m| m.ordering.is_some());
                    expanded.attempts = unordered;
                    heads.extend(std::iter::repeat(i).zip(lane));
                }
            }
            if !heads.is_empty() {
                let (carriers, mut handed): (Vec<usize>, Vec<Material>) = heads.into_iter().unzip();
                self.attach_followers(conn, &mut handed, claim).await;
                for (i, head) in carriers.into_iter().zip(handed) {
                    if let Some(Ok(expanded)) = &mut out[i] {
                        expanded.attempts.push(head);
                    }
                }
            }
        }
        // Rows queued in their lanes: each lane promotes its next row if it
        // has no head (after the commit, so the promotion sees them). A
        // dispatcher taking attempts in hand gets the new heads with this
        // answer, as far as the reply's budget for bodies goes.
        // (A lane opened here has its head already.)
        let opened: std::collections::HashSet<(EndpointId, &str)> =
            rows.iter().filter(|r| r.lane_head).filter_map(|r| Some((r.endpoint_id?, r.ordering_key.as_deref()?))).collect();
        let lanes: Vec<(EndpointId, String)> = rows
            .iter()
            .filter(|r| r.queued)
            .filter_map(|r| Some((r.endpoint_id?, r.ordering_key.clone()?)))
            .filter(|(e, k)| !opened.contains(&(*e, k.as_str())))
            .collect();
        match claim {
            _ if lanes.is_empty() => {}
            Some(claim) => {
                let used: usize = out.iter().flatten().flatten().flat_map(|e| &e.attempts).map(|m| m.payload.len()).sum();
                let budget = relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64 - used as i64;
                let heads = self.promote_and_hand(conn, lanes, claim, budget).await;
                // Each with its event's answer where it has one, else with the
                // first answer that can carry it.
                for head in heads {
                    let mine = asks.iter().position(|a| a.item.event_id == head.event_id).filter(|&i| matches!(out[i], Some(Ok(_))));
                    let carrier = mine.or_else(|| out.iter().position(|o| matches!(o, Some(Ok(_)))));
                    match carrier.and_then(|i| out[i].as_mut()) {
                        Some(Ok(expanded)) => expanded.attempts.push(head),
                        _ => {
                            tracing::warn!(delivery_id = %head.delivery_id, "no answer to carry a lane's new head; its lease runs out first")
                        }
                    }
                }
            }
            None => self.promote_lanes(lanes).await,
        }
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(AppError::internal(anyhow::anyhow!("an expansion answered an item with no row")))))
            .collect())
    }

    /// A first attempt's material from its freshly written row.
    #[allow(clippy::too_many_arguments)]
    fn first_attempt(
        &self,
        row: &db::deliveries::ExpandedRow,
        delivery_id: DeliveryId,
        endpoint_id: EndpointId,
        ask: &ExpandAsk,
        envelope: Option<&Vec<u8>>,
        now: super::Timestamp,
        sending_of: &mut SendingByEndpoint,
    ) -> AppResult<Material> {
        let (Some(scheme), Some(key_id), Some(ciphertext)) = (&row.signature_scheme, &row.secret_key_id, &row.secret_ciphertext) else {
            return Err(AppError::internal(anyhow::anyhow!("an attempt in hand came back without its endpoint's secret")));
        };
        let stored = StoredSecrets::new(
            scheme,
            key_id,
            ciphertext,
            &row.previous_secret_key_id,
            &row.previous_secret_ciphertext,
            row.secret_rotated_at,
            (&row.headers_key_id, &row.headers_ciphertext),
        )
        .with_auth(
            (&row.client_tls_key_id, &row.client_tls_ciphertext),
            &row.ca_bundle,
            (&row.oauth2_key_id, &row.oauth2_ciphertext),
        );
        let sending = self.sending_for(sending_of, endpoint_id, stored, now)?;
        Ok(Material {
            delivery_id,
            endpoint_id,
            environment_id: ask.item.environment_id,
            event_id: ask.item.event_id,
            url: row.url.clone().context("an attempt in hand carries its endpoint's URL")?,
            attempt: 1,
            generation: 0,
            scheme: sending.scheme,
            secrets: sending.secrets,
            headers: sending.headers,
            auth: sending.auth,
            max_in_flight: row.max_in_flight.and_then(|n| u32::try_from(n).ok()),
            // A row in a lane is handed out by its expansion only as the
            // head of a lane it opened (numbered 1) or took idle.
            ordering: row.ordering_key.clone().filter(|_| row.lane_head).zip(row.lane_position),
            payload: envelope.cloned().context("an attempt in hand carries its event's body")?,
            traceparent: None,
            followers: Vec::new(),
        })
    }

    /// Hands first attempts written already leased to the broker. Whatever
    /// the broker did not take is released at once (due now, unleased) for
    /// the relay; if this process dies first, the lease expires and the relay
    /// takes it then. The message id is the one the relay would use, so a
    /// publish that did land is never sent twice.
    async fn dispatch_leased(&self, jobs: &[crate::queue::Job<'_>]) {
        let Some(direct) = &self.direct else { return };
        let (stored, first_error) = direct.jobs.publish(jobs).await;
        let unsent: Vec<DeliveryId> = jobs.iter().zip(stored).filter_map(|(j, ok)| (!ok).then_some(j.delivery_id)).collect();
        if unsent.is_empty() {
            return;
        }
        tracing::warn!(count = unsent.len(), error = ?first_error, "the broker did not take some first attempts; the relay will");
        let released = db::deliveries::release_unsent_first_attempts(&self.db, &unsent).await;
        if let Err(e) = released {
            tracing::warn!(error = %e, "releasing unsent first attempts failed; their leases will expire");
        }
        self.deliveries_wake.wake();
    }
}
