//! Expansion: one delivery per subscribed, active endpoint of each event,
//! exactly once per event, and first attempts handed to the broker.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use anyhow::Context;
use uuid::Uuid;

use super::{App, deliveries::*};
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

impl App {
    /// One delivery per matching endpoint, exactly once per event: the ledger
    /// claims and the rows commit together, so a redelivered event is a no-op.
    /// Many events go in one transaction: the events are checked with
    /// one read, claimed with one insert, and their deliveries written with
    /// one insert. Each item answers as `expand` would, in order.
    pub async fn expand_batch(&self, items: Vec<ExpandItem>) -> AppResult<Vec<AppResult<Expanded>>> {
        // Pre-leasing counts in-flight attempts like a relay pass does; the
        // two take turns (released at the commit, before publishing).
        let leasing = match &self.direct {
            Some(_) => Some(self.lease_guard.lock().await),
            None => None,
        };
        let mut tx = self.db.begin().await?;
        let (envs, ids): (Vec<Uuid>, Vec<Uuid>) = items.iter().map(|i| (i.environment_id, i.event_id)).unzip();
        let stored = db::events::types_of(&mut tx, &envs, &ids).await?;

        // Which items may claim: the event exists as described, and it is
        // the first mention of that event in this batch. Claims are taken in
        // key order, so two batches that share events cannot deadlock.
        let mut out: Vec<Option<AppResult<Expanded>>> = Vec::with_capacity(items.len());
        let mut claimants: Vec<usize> = Vec::new();
        let mut seen: HashSet<(Uuid, Uuid)> = HashSet::new();
        for (i, item) in items.iter().enumerate() {
            let key = (item.environment_id, item.event_id);
            match stored.get(&key) {
                None => out.push(Some(Err(AppError::not_found("event")))),
                Some(t) if *t != item.event_type => out.push(Some(Err(AppError::invalid(
                    relay_contracts::reasons::EVENT_MISMATCH,
                    format!("event {} does not have that environment and type", item.event_id),
                )))),
                Some(_) if !seen.insert(key) => out.push(Some(Ok(Expanded { created: 0, duplicate: true }))),
                Some(_) => {
                    out.push(None);
                    claimants.push(i);
                }
            }
        }
        claimants.sort_by_key(|&i| (items[i].environment_id, items[i].event_id));
        let claimed: HashSet<(Uuid, Uuid)> = if claimants.is_empty() {
            HashSet::new()
        } else {
            let (envs, ids): (Vec<Uuid>, Vec<Uuid>) = claimants.iter().map(|&i| (items[i].environment_id, items[i].event_id)).unzip();
            db::events::mark_consumed(&mut tx, EXPAND_CONSUMER, &envs, &ids).await?
        };
        // Subscription filtering happens here, not at send time: a row that
        // exists is a row that will be sent. Every attempt of a delivery
        // continues its event's expansion trace. With direct dispatch, rows
        // within their endpoint's in-flight cap are written already leased
        // and handed to the broker after the commit; the rest wait, due, for
        // the relay.
        let mut created: HashMap<(Uuid, Uuid), u32> = HashMap::new();
        let mut leased: Vec<db::deliveries::CreatedRow> = Vec::new();
        let mut waiting = false;
        let fresh: Vec<usize> =
            claimants.iter().copied().filter(|&i| claimed.contains(&(items[i].environment_id, items[i].event_id))).collect();
        if !fresh.is_empty() {
            let cap = self.direct.as_ref().map_or(0, |d| d.endpoint_cap);
            let events = db::deliveries::ToExpand {
                environment_id: fresh.iter().map(|&i| items[i].environment_id).collect(),
                event_id: fresh.iter().map(|&i| items[i].event_id).collect(),
                event_type: fresh.iter().map(|&i| items[i].event_type.clone()).collect(),
                trace_context: fresh.iter().map(|&i| items[i].trace_context.clone()).collect(),
                target: fresh.iter().map(|&i| items[i].target).collect(),
            };
            // Subscribers are share-locked by the insert: a disable or delete
            // of one waits for this expansion to commit (and then ends the
            // rows it wrote), or this expansion waits for it and reads the
            // endpoint as disabled. No pending delivery of an inactive
            // endpoint is ever committed.
            let rows = db::deliveries::create_for_subscribers(&mut tx, &events, cap, DIRECT_PUBLISH_LEASE).await?;
            for row in rows {
                *created.entry((row.environment_id, row.event_id)).or_default() += 1;
                if row.leased {
                    leased.push(row);
                } else {
                    waiting = true;
                }
            }
        }
        if waiting {
            db::deliveries::notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing an expansion batch")?;
        drop(leasing);
        if !leased.is_empty() {
            self.dispatch_leased(&leased).await;
        }
        if waiting {
            self.deliveries_wake.wake();
        }
        for &i in &claimants {
            let key = (items[i].environment_id, items[i].event_id);
            out[i] = Some(Ok(if claimed.contains(&key) {
                Expanded { created: created.get(&key).copied().unwrap_or(0), duplicate: false }
            } else {
                Expanded { created: 0, duplicate: true }
            }));
        }
        Ok(out.into_iter().map(|o| o.expect("every item answered")).collect())
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
