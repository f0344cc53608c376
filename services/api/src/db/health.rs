//! `endpoint_health`, and the statements that hold and release an endpoint's
//! deliveries. What the health becomes comes from `app::health`.
//!
//! Lock order: an outcome batch locks its deliveries, then the health rows
//! of their endpoints (FOR UPDATE, in endpoint order); holding, releasing and
//! probing then skip delivery rows another transaction has locked. Such a
//! row belongs to an outcome batch of the same endpoint, which takes the
//! health lock after this transaction and applies the circuit it finds, so
//! nothing is left pending behind an open circuit or held behind a closed one.

use std::time::Duration;

use sqlx::{PgConnection, postgres::types::PgInterval};
use uuid::Uuid;

use super::models::{Circuit, DisabledReason, EndpointHealth, Timestamp};
use crate::error::AppResult;

/// An endpoint's health with what the rules need beside it.
pub struct HealthRow {
    pub endpoint_id: Uuid,
    pub environment_id: Uuid,
    pub circuit: Circuit,
    pub consecutive_failures: i32,
    pub failing_since: Option<Timestamp>,
    pub last_success_at: Option<Timestamp>,
    pub last_failure_at: Option<Timestamp>,
    pub next_probe_at: Option<Timestamp>,
    pub probe_interval_ms: i64,
    pub disabled_reason: Option<DisabledReason>,
    /// The environment's rule for disabling a failing endpoint.
    pub disable_after_secs: i32,
    pub disable_min_failures: i32,
}

impl HealthRow {
    pub fn health(&self) -> EndpointHealth {
        EndpointHealth {
            circuit: self.circuit,
            consecutive_failures: self.consecutive_failures,
            failing_since: self.failing_since,
            last_success_at: self.last_success_at,
            last_failure_at: self.last_failure_at,
            next_probe_at: self.next_probe_at,
            probe_interval_ms: self.probe_interval_ms,
        }
    }
}

/// The health of these endpoints, unlocked.
pub async fn read(tx: &mut PgConnection, endpoint_ids: &[Uuid]) -> AppResult<Vec<HealthRow>> {
    Ok(sqlx::query_as!(
        HealthRow,
        r#"SELECT h.endpoint_id, e.environment_id, h.circuit AS "circuit: Circuit", h.consecutive_failures, h.failing_since, h.last_success_at,
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, e.disabled_reason AS "disabled_reason?: DisabledReason",
                  v.disable_after_secs, v.disable_min_failures
           FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id JOIN environments v ON v.id = e.environment_id
           WHERE h.endpoint_id = ANY ($1)"#,
        endpoint_ids,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// The same, the health rows locked in endpoint order: a change of circuit
/// waits for expansions that read the old one (they hold KEY SHARE).
pub async fn lock(tx: &mut PgConnection, endpoint_ids: &[Uuid]) -> AppResult<Vec<HealthRow>> {
    Ok(sqlx::query_as!(
        HealthRow,
        r#"SELECT h.endpoint_id, e.environment_id, h.circuit AS "circuit: Circuit", h.consecutive_failures, h.failing_since, h.last_success_at,
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, e.disabled_reason AS "disabled_reason?: DisabledReason",
                  v.disable_after_secs, v.disable_min_failures
           FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id JOIN environments v ON v.id = e.environment_id
           WHERE h.endpoint_id = ANY ($1) ORDER BY h.endpoint_id FOR UPDATE OF h"#,
        endpoint_ids,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Open or half-open circuits whose probe is due, locked; ones another
/// prober holds are skipped.
pub async fn lock_due_probes(tx: &mut PgConnection, limit: i64) -> AppResult<Vec<HealthRow>> {
    Ok(sqlx::query_as!(
        HealthRow,
        r#"SELECT h.endpoint_id, e.environment_id, h.circuit AS "circuit: Circuit", h.consecutive_failures, h.failing_since, h.last_success_at,
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, e.disabled_reason AS "disabled_reason?: DisabledReason",
                  v.disable_after_secs, v.disable_min_failures
           FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id JOIN environments v ON v.id = e.environment_id
           WHERE h.circuit <> 'closed' AND h.next_probe_at <= now()
           ORDER BY h.next_probe_at LIMIT $1 FOR UPDATE OF h SKIP LOCKED"#,
        limit,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// The earliest due probe, for the prober's sleep.
pub async fn next_probe_at(db: &sqlx::PgPool) -> AppResult<Option<Timestamp>> {
    Ok(sqlx::query_scalar!("SELECT min(next_probe_at) FROM endpoint_health WHERE circuit <> 'closed'").fetch_one(db).await?)
}

/// Writes health rows back.
pub async fn store(tx: &mut PgConnection, rows: &[(Uuid, EndpointHealth)]) -> AppResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    let circuits: Vec<&str> = rows.iter().map(|r| r.1.circuit.as_str()).collect();
    let failures: Vec<i32> = rows.iter().map(|r| r.1.consecutive_failures).collect();
    let since: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.failing_since).collect();
    let success: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.last_success_at).collect();
    let failure: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.last_failure_at).collect();
    let probe: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.next_probe_at).collect();
    let interval: Vec<i64> = rows.iter().map(|r| r.1.probe_interval_ms).collect();
    sqlx::query!(
        "UPDATE endpoint_health h SET circuit = u.circuit, consecutive_failures = u.failures, failing_since = u.since,
           last_success_at = u.success, last_failure_at = u.failure, next_probe_at = u.probe, probe_interval_ms = u.interval
         FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::timestamptz[], $5::timestamptz[], $6::timestamptz[], $7::timestamptz[], $8::bigint[])
           AS u(id, circuit, failures, since, success, failure, probe, interval)
         WHERE h.endpoint_id = ANY ($1::uuid[]) AND h.endpoint_id = u.id",
        &ids,
        &circuits as &[&str],
        &failures,
        &since as &[Option<Timestamp>],
        &success as &[Option<Timestamp>],
        &failure as &[Option<Timestamp>],
        &probe as &[Option<Timestamp>],
        &interval,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A healthy endpoint's last success, moved forward without a lock on the
/// row's circuit (a plain update does not conflict with expansions).
pub async fn touch_success(tx: &mut PgConnection, endpoint_ids: &[Uuid], at: Timestamp) -> AppResult<()> {
    sqlx::query!(
        "UPDATE endpoint_health SET last_success_at = $2 WHERE endpoint_id = ANY ($1) AND (last_success_at IS NULL OR last_success_at < $2)",
        endpoint_ids,
        at,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A new endpoint's health row: closed, no history.
pub async fn insert(tx: &mut PgConnection, endpoint_id: Uuid) -> AppResult<()> {
    sqlx::query!("INSERT INTO endpoint_health (endpoint_id) VALUES ($1)", endpoint_id).execute(&mut *tx).await?;
    Ok(())
}

/// Back to a clean closed circuit (a tenant enabled the endpoint).
pub async fn reset(tx: &mut PgConnection, endpoint_id: Uuid) -> AppResult<()> {
    sqlx::query!(
        "UPDATE endpoint_health SET circuit = 'closed', consecutive_failures = 0, failing_since = NULL, next_probe_at = NULL,
           probe_interval_ms = 0
         WHERE endpoint_id = $1",
        endpoint_id,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every pending delivery of these endpoints becomes held, leased ones
/// included (a dispatcher holding the job is then refused its material; the
/// lease's expiry is not a due time, so those are due from now).
pub async fn hold_pending(tx: &mut PgConnection, endpoint_ids: &[Uuid]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'held', dispatched_at = NULL, updated_at = now(),
           next_attempt_at = CASE WHEN dispatched_at IS NULL THEN next_attempt_at ELSE now() END
         -- The rows by id (as a join the planner may scan the whole table for them).
         WHERE id = ANY (ARRAY(SELECT id FROM webhook_deliveries
                               WHERE endpoint_id = ANY ($1)
                                 -- waiting and leased: each has its partial index
                                 AND (state = 'pending' AND dispatched_at IS NULL OR state = 'pending' AND dispatched_at IS NOT NULL)
                               FOR UPDATE SKIP LOCKED))",
        endpoint_ids,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Pending deliveries found by id become held (material met them after
/// their endpoint was disabled as gone).
pub async fn hold_by_id(db: &sqlx::PgPool, ids: &[Uuid]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'held', dispatched_at = NULL, updated_at = now(),
           next_attempt_at = CASE WHEN dispatched_at IS NULL THEN next_attempt_at ELSE now() END
         WHERE id = ANY ($1) AND state = 'pending'",
        ids,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// An endpoint's held deliveries back to pending in the order they fell
/// due, one after another at `per_second`: a receiver that just recovered is not
/// hit with the whole backlog at once.
pub async fn release_held(tx: &mut PgConnection, endpoint_ids: &[Uuid], per_second: u32) -> AppResult<u64> {
    let gap = PgInterval::try_from(Duration::from_secs_f64(1.0 / f64::from(per_second.max(1))))
        .map_err(|e| anyhow::anyhow!("a release gap is not an interval: {e}"))?;
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries d SET state = 'pending', dispatched_at = NULL, next_attempt_at = now() + (r.k - 1) * $2::interval,
           updated_at = now()
         FROM (SELECT id, row_number() OVER (PARTITION BY endpoint_id ORDER BY next_attempt_at, id) AS k FROM webhook_deliveries
               WHERE id = ANY (ARRAY(SELECT id FROM webhook_deliveries WHERE endpoint_id = ANY ($1) AND state = 'held' FOR UPDATE SKIP LOCKED))) r
         WHERE d.id = r.id",
        endpoint_ids,
        gap,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// The first held delivery (by due time) of each endpoint, locked; ones
/// an outcome batch holds are passed over.
pub struct FirstHeld {
    pub endpoint_id: Uuid,
    pub id: Uuid,
    pub next_attempt_at: Timestamp,
}

pub async fn first_held(tx: &mut PgConnection, endpoint_ids: &[Uuid]) -> AppResult<Vec<FirstHeld>> {
    Ok(sqlx::query_as!(
        FirstHeld,
        r#"SELECT u.endpoint_id AS "endpoint_id!", p.id, p.next_attempt_at
           FROM UNNEST($1::uuid[]) AS u(endpoint_id)
           CROSS JOIN LATERAL (SELECT id, next_attempt_at FROM webhook_deliveries
                               WHERE endpoint_id = u.endpoint_id AND state = 'held'
                               ORDER BY next_attempt_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) p"#,
        endpoint_ids,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Held deliveries become pending as they are (due): the probes.
pub async fn release_probes(tx: &mut PgConnection, ids: &[Uuid]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', dispatched_at = NULL, updated_at = now() WHERE id = ANY ($1) AND state = 'held'",
        ids,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// A held delivery as the tenant lists it.
pub struct HeldRow {
    pub id: Uuid,
    pub event_id: Uuid,
    /// The attempt it will make next.
    pub attempt: i32,
    pub next_attempt_at: Timestamp,
    pub created_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
}

/// Held deliveries of one endpoint in the order they fall due, a page after
/// the `(next_attempt_at, id)` of the last one shown.
pub async fn list_held(db: &sqlx::PgPool, endpoint_id: Uuid, after: Option<(Timestamp, Uuid)>, limit: i64) -> AppResult<Vec<HeldRow>> {
    let (after_at, after_id) = after.unzip();
    Ok(sqlx::query_as!(
        HeldRow,
        "SELECT id, event_id, attempt, next_attempt_at, created_at, last_status, last_error FROM webhook_deliveries
         WHERE endpoint_id = $1 AND state = 'held' AND ($2::timestamptz IS NULL OR (next_attempt_at, id) > ($2, $3))
         ORDER BY next_attempt_at, id LIMIT $4",
        endpoint_id,
        after_at,
        after_id,
        limit,
    )
    .fetch_all(db)
    .await?)
}
