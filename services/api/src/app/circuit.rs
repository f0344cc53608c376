//! Endpoint health applied: what a batch of outcomes does to its endpoints
//! (in the batch's transaction), the prober that sends one held delivery of
//! an open circuit when its probe is due, and the tenant's view of what an
//! endpoint holds. The rules are `relay_domain::health`'s.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use relay_domain::{DeliveryId, EndpointId, EnvironmentId, Reason};
use sqlx::PgConnection;

use relay_domain::health::{Circuit, DisablePolicy, DisabledReason, Effects, EndpointStanding, ProbeStep, Seen};

use super::{App, Tenant, Timestamp, operational::Happened};
use crate::{
    db::{self, health::HealthRow},
    error::{AppError, AppResult},
};

/// A healthy endpoint's `last_success_at` is refreshed at most this often,
/// so a steady stream of successes costs one small write a second, not one
/// per outcome batch.
pub(super) const SUCCESS_STAMP_EVERY: chrono::Duration = chrono::Duration::seconds(1);

/// Endpoints whose probe the prober takes in one pass.
const PROBES_PER_PASS: i64 = 200;

fn standing(row: &HealthRow) -> EndpointStanding {
    EndpointStanding { health: row.health(), disabled: row.disabled_reason }
}

/// What the rules decided for a batch's endpoints, gathered for one write
/// each.
#[derive(Default)]
struct HealthChanges {
    stored: Vec<(EndpointId, relay_domain::health::EndpointHealth)>,
    hold: Vec<EndpointId>,
    recover: Vec<EndpointId>,
    release: Vec<(EndpointId, u32)>,
    enable: Vec<EndpointId>,
    disable: HashMap<DisabledReason, Vec<EndpointId>>,
    announce: Vec<(EnvironmentId, EndpointId, Happened)>,
}

impl HealthChanges {
    fn add(&mut self, row: &HealthRow, before: EndpointStanding, after: EndpointStanding, effects: Effects) {
        let id = row.endpoint_id;
        if after.health.circuit != before.health.circuit {
            tracing::info!(endpoint_id = %id, from = before.health.circuit.as_str(), to = after.health.circuit.as_str(),
                consecutive_failures = after.health.consecutive_failures, "endpoint circuit changed");
        }
        if after.health != before.health {
            self.stored.push((id, after.health));
        }
        if effects.opened {
            let h = after.health;
            let failing = Happened::Failing { consecutive_failures: h.consecutive_failures, since: h.failing_since };
            self.announce.push((row.environment_id, id, failing));
        }
        if let Some(reason) = effects.disable {
            self.announce.push((row.environment_id, id, Happened::Disabled(reason)));
            tracing::warn!(endpoint_id = %id, reason = reason.as_str(), "endpoint disabled by Relay; its deliveries are held");
            self.disable.entry(reason).or_default().push(id);
        }
        if effects.enable {
            tracing::info!(endpoint_id = %id, "endpoint recovered and re-enabled");
            self.enable.push(id);
        }
        if effects.hold {
            self.hold.push(id);
        }
        if effects.recover {
            self.recover.push(id);
        }
        if effects.release > 0 {
            self.release.push((id, effects.release));
        }
        if effects.enable || effects.recover {
            self.announce.push((row.environment_id, id, Happened::Recovered));
        }
    }
}

fn disable_policy(row: &HealthRow) -> DisablePolicy {
    DisablePolicy {
        after: std::time::Duration::from_secs(row.disable_after_secs.max(1) as u64),
        min_failures: row.disable_min_failures.max(1) as u32,
    }
}

impl App {
    /// Applies the results of an outcome batch (endpoint, result, in the
    /// order reported) to the endpoints' health, inside the batch's
    /// transaction and after its deliveries are written.
    pub(super) async fn observe_results(&self, tx: &mut PgConnection, seen: &[(EndpointId, Seen)], now: Timestamp) -> AppResult<()> {
        if seen.is_empty() {
            return Ok(());
        }
        let policy = &self.health.circuit;
        let mut by_endpoint: BTreeMap<EndpointId, Vec<(Seen, Timestamp)>> = BTreeMap::new();
        for &(endpoint, s) in seen {
            by_endpoint.entry(endpoint).or_default().push((s, now));
        }
        let ids: Vec<EndpointId> = by_endpoint.keys().copied().collect();
        // The common case, a healthy endpoint succeeding, takes no lock: only
        // a change of circuit must wait for expansions in flight.
        let mut stamp = Vec::new();
        let mut changing = Vec::new();
        for row in db::health::read(&mut *tx, &ids).await? {
            let all_ok = by_endpoint[&row.endpoint_id].iter().all(|(s, _)| s.is_success());
            if all_ok && row.health().is_plainly_healthy(now, policy) && row.disabled_reason.is_none() {
                if row.last_success_at.is_none_or(|at| at + SUCCESS_STAMP_EVERY <= now) {
                    stamp.push(row.endpoint_id);
                }
            } else {
                changing.push(row.endpoint_id);
            }
        }
        if !stamp.is_empty() {
            db::health::touch_success(&mut *tx, &stamp, now).await?;
        }
        if changing.is_empty() {
            return Ok(());
        }
        let mut changes = HealthChanges::default();
        let mut reopened = Vec::new();
        for row in db::health::lock(&mut *tx, &changing).await? {
            let before = standing(&row);
            let (after, effects) = before.observe(&by_endpoint[&row.endpoint_id], policy, &disable_policy(&row));
            if before.health.circuit == Circuit::HalfOpen && after.health.circuit == Circuit::Open {
                reopened.push(row.endpoint_id);
            }
            changes.add(&row, before, after, effects);
        }
        // A failed probe's next one comes no later than a held retry falls due.
        if !reopened.is_empty() {
            let due: HashMap<EndpointId, Timestamp> =
                db::health::next_held_retry_due(&mut *tx, &reopened, now).await?.into_iter().collect();
            for (id, health) in &mut changes.stored {
                if let Some(&due) = due.get(id) {
                    let s = EndpointStanding { health: *health, disabled: None }.probe_by_held_retry(now, Some(due), policy);
                    *health = s.health;
                }
            }
        }
        self.apply_health_changes(&mut *tx, changes).await
    }

    /// Writes what the rules decided for a batch's endpoints: disables and
    /// enables, held and released deliveries, the health rows, the
    /// operational events.
    async fn apply_health_changes(&self, tx: &mut PgConnection, c: HealthChanges) -> AppResult<()> {
        for (reason, ids) in &c.disable {
            db::endpoints::set_disabled_by_health(&mut *tx, ids, Some(*reason)).await?;
        }
        if !c.enable.is_empty() {
            db::endpoints::set_disabled_by_health(&mut *tx, &c.enable, None).await?;
        }
        if !c.hold.is_empty() {
            db::health::hold_pending(&mut *tx, &c.hold).await?;
        }
        let mut released = 0;
        if !c.recover.is_empty() {
            released += db::health::release_not_due(&mut *tx, &c.recover).await?;
        }
        if !c.release.is_empty() {
            let (ids, counts): (Vec<EndpointId>, Vec<i64>) = c.release.iter().map(|&(id, n)| (id, i64::from(n))).unzip();
            released += db::health::release_due(&mut *tx, &ids, &counts).await?;
        }
        db::health::store(&mut *tx, &c.stored).await?;
        if released > 0 {
            db::deliveries::notify_due(&mut *tx).await?;
        }
        self.announce(&mut *tx, &c.announce).await?;
        if c.stored.iter().any(|(_, h)| h.circuit != Circuit::Closed) {
            self.probes_wake.wake();
        }
        Ok(())
    }

    /// One pass of the prober, for each circuit whose look is due: an open
    /// one sends its held delivery with the most attempts (once one is due
    /// by its own schedule) and waits half-open for the result; a
    /// recovering one releases a few more held deliveries, or closes once
    /// nothing is held. Returns the endpoints looked at.
    pub async fn probe_due_endpoints(&self) -> AppResult<usize> {
        let policy = &self.health.circuit;
        let mut tx = self.db.begin().await?;
        let rows = db::health::lock_due_probes(&mut tx, PROBES_PER_PASS).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let now = self.clock.now();
        let due: Vec<EndpointId> = rows.iter().filter(|r| standing(r).probe_due(now)).map(|r| r.endpoint_id).collect();
        let max_attempts = i32::try_from(self.schedule.max_attempts()).unwrap_or(i32::MAX);
        let candidates: HashMap<EndpointId, db::health::ProbeCandidate> =
            db::health::probe_candidates(&mut tx, &due, max_attempts).await?.into_iter().map(|c| (c.endpoint_id, c)).collect();
        let (mut probes, mut release, mut closed, mut stored) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for row in &rows {
            let before = standing(row);
            let after = if before.probe_due(now) {
                let held = candidates.get(&row.endpoint_id);
                let (after, step) = before.probe(now, held.map(|c| c.next_attempt_at), policy);
                match (step, held) {
                    (ProbeStep::Probe, Some(c)) => probes.push(c.id),
                    (ProbeStep::Release(n), _) => release.push((row.endpoint_id, i64::from(n))),
                    (ProbeStep::Closed, _) => closed.push(row.endpoint_id),
                    _ => {}
                }
                after
            } else {
                // Never probed (a tenant's or receiver's disable): off the
                // prober's list until something opens it again.
                EndpointStanding { health: relay_domain::health::EndpointHealth { next_probe_at: None, ..before.health }, ..before }
            };
            stored.push((row.endpoint_id, after.health));
        }
        let mut released = db::health::release_probes(&mut tx, &probes).await?;
        if !release.is_empty() {
            let (ids, counts): (Vec<EndpointId>, Vec<i64>) = release.into_iter().unzip();
            released += db::health::release_due(&mut tx, &ids, &counts).await?;
        }
        // A circuit closed with nothing held releases whatever an outcome
        // batch was holding on to meanwhile.
        if !closed.is_empty() {
            released += db::health::release_all(&mut tx, &closed).await?;
        }
        db::health::store(&mut tx, &stored).await?;
        if released > 0 {
            db::deliveries::notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing probes")?;
        if !probes.is_empty() {
            tracing::info!(probes = probes.len(), "probing open circuits with held deliveries");
        }
        if released > 0 {
            self.deliveries_wake.wake();
        }
        Ok(rows.len())
    }

    /// When the next probe falls due, for the prober's sleep.
    pub async fn next_probe_at(&self) -> AppResult<Option<Timestamp>> {
        db::health::next_probe_at(&self.db).await
    }

    /// Held deliveries of one of the tenant's endpoints, in the order they
    /// fall due, a page at a time.
    pub async fn list_held(
        &self,
        tenant: Tenant,
        endpoint_id: EndpointId,
        after: Option<(Timestamp, DeliveryId)>,
        limit: i64,
    ) -> AppResult<Vec<relay_domain::models::HeldDelivery>> {
        // The endpoint must be the tenant's (another's answers 404).
        self.get_endpoint(tenant, endpoint_id).await?;
        if !(1..=1000).contains(&limit) {
            return Err(AppError::invalid(Reason::InvalidLimit, format!("limit must be between 1 and 1000, got {limit}")));
        }
        db::health::list_held(&self.db, endpoint_id, after, limit).await
    }
}
