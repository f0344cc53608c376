//! Endpoint health applied: what a batch of outcomes does to its endpoints
//! (in the batch's transaction), the prober that sends one held delivery of
//! an open circuit when its probe is due, and the tenant's view of what an
//! endpoint holds. The rules are `health`'s.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use sqlx::PgConnection;
use uuid::Uuid;

use super::{
    App, Tenant, Timestamp,
    health::{Circuit, DisablePolicy, DisabledReason, Seen, Standing},
    operational::Happened,
};
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

fn standing(row: &HealthRow) -> Standing {
    Standing { health: row.health(), disabled: row.disabled_reason }
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
    pub(super) async fn observe_results(&self, tx: &mut PgConnection, seen: &[(Uuid, Seen)], now: Timestamp) -> AppResult<()> {
        if seen.is_empty() {
            return Ok(());
        }
        let mut by_endpoint: BTreeMap<Uuid, Vec<(Seen, Timestamp)>> = BTreeMap::new();
        for &(endpoint, s) in seen {
            by_endpoint.entry(endpoint).or_default().push((s, now));
        }
        let ids: Vec<Uuid> = by_endpoint.keys().copied().collect();
        // The common case, a healthy endpoint succeeding, takes no lock: only
        // a change of circuit must wait for expansions in flight.
        let mut stamp = Vec::new();
        let mut changing = Vec::new();
        for row in db::health::read(&mut *tx, &ids).await? {
            let all_ok = by_endpoint[&row.endpoint_id].iter().all(|(s, _)| *s == Seen::Success);
            if all_ok && row.circuit == Circuit::Closed && row.consecutive_failures == 0 && row.disabled_reason.is_none() {
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
        let mut stored = Vec::new();
        let (mut hold, mut release, mut enable) = (Vec::new(), Vec::new(), Vec::new());
        let mut disable: HashMap<DisabledReason, Vec<Uuid>> = HashMap::new();
        let mut announce = Vec::new();
        for row in db::health::lock(&mut *tx, &changing).await? {
            let before = standing(&row);
            let (after, effects) = before.observe(&by_endpoint[&row.endpoint_id], &self.health.circuit, &disable_policy(&row));
            let id = row.endpoint_id;
            if after.health.circuit != before.health.circuit {
                tracing::info!(endpoint_id = %id, from = before.health.circuit.as_str(), to = after.health.circuit.as_str(),
                    consecutive_failures = after.health.consecutive_failures, "endpoint circuit changed");
            }
            if after.health != before.health {
                stored.push((id, after.health));
            }
            let opened = before.health.circuit == Circuit::Closed && after.health.circuit != Circuit::Closed && after.disabled.is_none();
            if opened {
                let h = after.health;
                let failing = Happened::Failing { consecutive_failures: h.consecutive_failures, since: h.failing_since };
                announce.push((row.environment_id, id, failing));
            }
            if let Some(reason) = effects.disable {
                announce.push((row.environment_id, id, Happened::Disabled(reason)));
                tracing::warn!(endpoint_id = %id, reason = reason.as_str(), "endpoint disabled by Relay; its deliveries are held");
                disable.entry(reason).or_default().push(id);
            }
            if effects.enable {
                tracing::info!(endpoint_id = %id, "endpoint recovered and re-enabled");
                enable.push(id);
            }
            if effects.hold {
                hold.push(id);
            }
            if effects.release {
                release.push(id);
            }
            if effects.enable || effects.release {
                announce.push((row.environment_id, id, Happened::Recovered));
            }
        }
        for (reason, ids) in &disable {
            db::endpoints::set_disabled_by_health(&mut *tx, ids, Some(*reason)).await?;
        }
        if !enable.is_empty() {
            db::endpoints::set_disabled_by_health(&mut *tx, &enable, None).await?;
        }
        if !hold.is_empty() {
            db::health::hold_pending(&mut *tx, &hold).await?;
        }
        let released =
            if release.is_empty() { 0 } else { db::health::release_held(&mut *tx, &release, self.health.release_per_second).await? };
        db::health::store(&mut *tx, &stored).await?;
        if released > 0 {
            db::deliveries::notify_due(&mut *tx).await?;
        }
        self.announce(&mut *tx, &announce).await?;
        if stored.iter().any(|(_, h)| h.circuit != Circuit::Closed) {
            self.probes_wake.wake();
        }
        Ok(())
    }

    /// One pass of the prober: for each open circuit whose probe is due, the
    /// first held delivery (once it is due by its own schedule) goes back to
    /// pending, and the circuit waits half-open for its result. Returns the
    /// endpoints looked at.
    pub async fn probe_due_endpoints(&self) -> AppResult<usize> {
        let mut tx = self.db.begin().await?;
        let rows = db::health::lock_due_probes(&mut tx, PROBES_PER_PASS).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let now = self.clock.now();
        let due: Vec<Uuid> = rows.iter().filter(|r| standing(r).probe_due(now)).map(|r| r.endpoint_id).collect();
        let first: HashMap<Uuid, db::health::FirstHeld> =
            db::health::first_held(&mut tx, &due).await?.into_iter().map(|f| (f.endpoint_id, f)).collect();
        let (mut probes, mut stored, mut closed) = (Vec::new(), Vec::new(), Vec::new());
        for row in &rows {
            let before = standing(row);
            let after = if before.probe_due(now) {
                let held = first.get(&row.endpoint_id);
                let after = before.probe(now, held.map(|f| f.next_attempt_at), &self.health.circuit);
                match (after.health.circuit, held) {
                    (Circuit::HalfOpen, Some(f)) => probes.push(f.id),
                    (Circuit::Closed, _) => closed.push(row.endpoint_id),
                    _ => {}
                }
                after
            } else {
                // Never probed (a tenant's or receiver's disable): off the
                // prober's list until something opens it again.
                Standing { health: super::health::EndpointHealth { next_probe_at: None, ..before.health }, ..before }
            };
            stored.push((row.endpoint_id, after.health));
        }
        db::health::release_probes(&mut tx, &probes).await?;
        // A circuit closed for want of anything held releases whatever an
        // outcome batch was holding on to meanwhile.
        let released =
            if closed.is_empty() { 0 } else { db::health::release_held(&mut tx, &closed, self.health.release_per_second).await? };
        db::health::store(&mut tx, &stored).await?;
        if !probes.is_empty() || released > 0 {
            db::deliveries::notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing probes")?;
        if !probes.is_empty() {
            tracing::info!(probes = probes.len(), "probing open circuits with held deliveries");
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
        endpoint_id: Uuid,
        after: Option<(Timestamp, Uuid)>,
        limit: i64,
    ) -> AppResult<Vec<db::health::HeldRow>> {
        // The endpoint must be the tenant's (another's answers 404).
        self.get_endpoint(tenant, endpoint_id).await?;
        if !(1..=1000).contains(&limit) {
            return Err(AppError::invalid("invalid_limit", format!("limit must be between 1 and 1000, got {limit}")));
        }
        db::health::list_held(&self.db, endpoint_id, after, limit).await
    }
}
