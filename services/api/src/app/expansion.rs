//! Expansion: one delivery per subscribed, active endpoint of each event,
//! exactly once per event, and first attempts handed out at once — to the
//! dispatcher that asked, with their material, or to the broker.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use anyhow::Context;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::{
    App,
    deliveries::*,
    material::{SecretsByEndpoint, StoredSecrets},
};
use crate::{
    db,
    error::{AppError, AppResult},
};
/// The ledger name expansion claims events under.
const EXPAND_CONSUMER: &str = "expand";
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
    /// the expansion lane (items of concurrent calls share its batches).
    /// Each item answers as `expand` would, in order.
    pub async fn expand_batch(&self, asks: Vec<ExpandAsk>) -> AppResult<Vec<AppResult<Expanded>>> {
        Ok(self.lanes().expansions.call_all(asks).await)
    }

    /// One batch of the expansion lane, in one transaction: the events are
    /// checked with one read, claimed in the ledger with one insert, and
    /// their deliveries written with one insert, so a redelivered event is a
    /// no-op. First attempts within their endpoint's in-flight cap are
    /// written already leased: those of a dispatcher that takes them in
    /// hand come back to it with their material (as far as a reply's
    /// payload budget goes), the rest are handed to the broker after the
    /// commit; everything else waits, due, for the relay.
    pub(crate) async fn expand_on(&self, conn: &mut PgConnection, asks: &[ExpandAsk]) -> AppResult<Vec<AppResult<Expanded>>> {
        // Pre-leasing counts in-flight attempts like a relay pass does; the
        // two take turns (released at the commit, before publishing).
        let leasing = match &self.direct {
            Some(_) => Some(self.lease_guard.lock().await),
            None => None,
        };
        let mut tx = conn.begin().await?;
        let (envs, ids): (Vec<Uuid>, Vec<Uuid>) = asks.iter().map(|a| (a.item.environment_id, a.item.event_id)).unzip();
        let in_hand: Vec<bool> = asks.iter().map(|a| a.claim.is_some()).collect();
        let stored = db::events::stored(&mut tx, &envs, &ids, &in_hand).await?;

        // Which items may claim: the event exists as described, and it is
        // the first mention of that event in this batch. Claims are taken in
        // key order, so two batches that share events cannot deadlock.
        let mut out: Vec<Option<AppResult<Expanded>>> = Vec::with_capacity(asks.len());
        let mut claimants: Vec<usize> = Vec::new();
        let mut seen: HashSet<(Uuid, Uuid)> = HashSet::new();
        for (i, ask) in asks.iter().enumerate() {
            let item = &ask.item;
            let key = (item.environment_id, item.event_id);
            match stored.get(&key) {
                None => out.push(Some(Err(AppError::not_found("event")))),
                Some(s) if s.event_type != item.event_type => out.push(Some(Err(AppError::invalid(
                    relay_contracts::reasons::EVENT_MISMATCH,
                    format!("event {} does not have that environment and type", item.event_id),
                )))),
                Some(_) if !seen.insert(key) => out.push(Some(Ok(Expanded::duplicate()))),
                Some(_) => {
                    out.push(None);
                    claimants.push(i);
                }
            }
        }
        claimants.sort_by_key(|&i| (asks[i].item.environment_id, asks[i].item.event_id));
        let claimed: HashSet<(Uuid, Uuid)> = if claimants.is_empty() {
            HashSet::new()
        } else {
            let (envs, ids): (Vec<Uuid>, Vec<Uuid>) =
                claimants.iter().map(|&i| (asks[i].item.environment_id, asks[i].item.event_id)).unzip();
            db::events::mark_consumed(&mut tx, EXPAND_CONSUMER, &envs, &ids).await?
        };
        // Subscription filtering happens here, not at send time: a row that
        // exists is a row that will be sent. Every attempt of a delivery
        // continues its event's expansion trace.
        let fresh: Vec<usize> =
            claimants.iter().copied().filter(|&i| claimed.contains(&(asks[i].item.environment_id, asks[i].item.event_id))).collect();
        let mut rows = Vec::new();
        if !fresh.is_empty() {
            let cap = self.direct.as_ref().map_or(0, |d| d.endpoint_cap);
            let item = |i: usize| &asks[i].item;
            let events = db::deliveries::ToExpand {
                environment_id: fresh.iter().map(|&i| item(i).environment_id).collect(),
                event_id: fresh.iter().map(|&i| item(i).event_id).collect(),
                event_type: fresh.iter().map(|&i| item(i).event_type.clone()).collect(),
                trace_context: fresh.iter().map(|&i| item(i).trace_context.clone()).collect(),
                target: fresh.iter().map(|&i| item(i).target).collect(),
                // Attempts in a dispatcher's hands are leased as long as its
                // claim on them holds; past that the relay hands them out
                // again (and whoever then holds the claim sends).
                lease_ms: fresh
                    .iter()
                    .map(|&i| asks[i].claim.map_or(DIRECT_PUBLISH_LEASE, |c| c.hold).as_millis().try_into().unwrap_or(i64::MAX))
                    .collect(),
            };
            // Subscribers are share-locked by the insert: a disable or delete
            // of one waits for this expansion to commit (and then ends the
            // rows it wrote), or this expansion waits for it and reads the
            // endpoint as disabled. No pending delivery of an inactive
            // endpoint is ever committed.
            rows = db::deliveries::create_for_subscribers(&mut tx, &events, cap).await?;
        }
        // Rows beyond their endpoint's cap wait for an outcome of that
        // endpoint to free a slot, which fills it: every api refills from
        // now on (no relay pass could take them sooner).
        let waiting = rows.iter().any(|r| !r.leased && !r.held);
        match (waiting, &self.direct) {
            (true, Some(_)) => db::deliveries::notify_capped(&mut tx).await?,
            // An api that hands nothing out leaves every row to the relays.
            (true, None) => db::deliveries::notify_due(&mut tx).await?,
            (false, _) => {}
        }
        // The leased first attempts: into the hands of the dispatcher that
        // asked, while a reply's payload budget lasts, claimed for it in
        // this transaction like an attempt whose material it fetched (so a
        // stray copy of the job elsewhere is refused); the rest to the broker.
        let claim_of: HashMap<(Uuid, Uuid), Option<Claim>> =
            fresh.iter().map(|&i| ((asks[i].item.environment_id, asks[i].item.event_id), asks[i].claim)).collect();
        let mut budget = relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES;
        let mut claims = db::deliveries::ClaimsAsked::default();
        let in_hand: Vec<bool> = rows
            .iter()
            .map(|row| {
                let key = (row.environment_id, row.event_id);
                let size = stored.get(&key).and_then(|s| s.envelope.as_ref()).map(Vec::len);
                match (row.leased, claim_of.get(&key).copied().flatten(), size) {
                    (true, Some(claim), Some(size)) if size <= budget => {
                        budget -= size;
                        claims.delivery_id.push(row.id);
                        claims.attempt.push(1);
                        claims.generation.push(0);
                        claims.claimant.push(claim.claimant);
                        claims.hold_ms.push(claim.hold.as_millis().try_into().unwrap_or(i64::MAX));
                        true
                    }
                    _ => false,
                }
            })
            .collect();
        if !claims.delivery_id.is_empty() {
            db::deliveries::claim_attempts(&mut *tx, &claims).await?;
        }
        tx.commit().await.context("committing an expansion batch")?;
        drop(leasing);

        let mut created: HashMap<(Uuid, Uuid), Expanded> = HashMap::new();
        let mut to_broker: Vec<db::deliveries::CreatedRow> = Vec::new();
        let mut secrets_of = SecretsByEndpoint::new();
        let now = self.clock.now();
        for (row, in_hand) in rows.into_iter().zip(in_hand) {
            let key = (row.environment_id, row.event_id);
            let expanded = created.entry(key).or_insert_with(Expanded::none);
            expanded.created += 1;
            if !row.leased {
                continue;
            }
            let envelope = stored.get(&key).and_then(|s| s.envelope.as_ref());
            match envelope.filter(|_| in_hand) {
                Some(envelope) => match self.first_attempt(&row, envelope, now, &mut secrets_of) {
                    Ok(m) => expanded.attempts.push(m),
                    // Claimed for the asking dispatcher, which is not handed
                    // it: its lease and claim run out and the relay takes it.
                    Err(e) => {
                        tracing::warn!(delivery_id = %row.id, error = ?e, "no material for a first attempt; it waits for its lease to run out")
                    }
                },
                None => to_broker.push(row),
            }
        }
        if !to_broker.is_empty() {
            self.dispatch_leased(&to_broker).await;
        }
        match (waiting, &self.direct) {
            (true, Some(_)) => self.slots_awaited.store(true, std::sync::atomic::Ordering::Relaxed),
            (true, None) => self.deliveries_wake.wake(),
            (false, _) => {}
        }
        for &i in &claimants {
            let key = (asks[i].item.environment_id, asks[i].item.event_id);
            out[i] =
                Some(Ok(if claimed.contains(&key) { created.remove(&key).unwrap_or_else(Expanded::none) } else { Expanded::duplicate() }));
        }
        Ok(out.into_iter().map(|o| o.expect("every item answered")).collect())
    }

    /// A first attempt's material from its freshly written row.
    fn first_attempt(
        &self,
        row: &db::deliveries::CreatedRow,
        envelope: &[u8],
        now: super::Timestamp,
        secrets_of: &mut SecretsByEndpoint,
    ) -> AppResult<Material> {
        let (Some(key_id), Some(ciphertext)) = (&row.secret_key_id, &row.secret_ciphertext) else {
            return Err(AppError::internal(anyhow::anyhow!("a leased row came back without its endpoint's secret")));
        };
        let stored =
            StoredSecrets::new(key_id, ciphertext, &row.previous_secret_key_id, &row.previous_secret_ciphertext, row.secret_rotated_at);
        let secrets = self.signing_secrets(secrets_of, row.endpoint_id, stored, now)?;
        Ok(Material {
            delivery_id: row.id,
            endpoint_id: row.endpoint_id,
            environment_id: row.environment_id,
            event_id: row.event_id,
            url: row.url.clone().context("a leased row carries its endpoint's URL")?,
            attempt: 1,
            generation: 0,
            secrets,
            payload: envelope.to_vec(),
            traceparent: None,
        })
    }

    /// Hands first attempts written already leased to the broker. Whatever
    /// the broker did not take is released at once (due now, unleased) for
    /// the relay; if this process dies first, the lease expires and the relay
    /// takes it then. The message id is the one the relay would use, so a
    /// publish that did land is never sent twice.
    async fn dispatch_leased(&self, rows: &[db::deliveries::CreatedRow]) {
        let Some(direct) = &self.direct else { return };
        let jobs: Vec<crate::queue::Job<'_>> = rows
            .iter()
            .map(|r| crate::queue::Job {
                delivery_id: r.id,
                endpoint_id: r.endpoint_id,
                environment_id: r.environment_id,
                attempt: 1,
                generation: 0,
                trace_context: r.trace_context.as_deref(),
            })
            .collect();
        let (stored, first_error) = direct.jobs.publish(&jobs).await;
        let unsent: Vec<Uuid> = rows.iter().zip(stored).filter_map(|(r, ok)| (!ok).then_some(r.id)).collect();
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
