//! `endpoint_health`, and the statements that hold and release an endpoint's
//! deliveries. What the health becomes comes from `relay_domain::health`.
//!
//! Lock order: an outcome batch locks its deliveries, then the health rows
//! of their endpoints (FOR UPDATE, in endpoint order); holding, releasing and
//! probing then skip delivery rows another transaction has locked. Such a
//! row belongs to an outcome batch of the same endpoint, which takes the
//! health lock after this transaction and applies the circuit it finds, so
//! nothing is left pending behind an open circuit or held behind a closed one.

use relay_domain::{DeliveryId, EndpointId, EnvironmentId, delivery::DeadLetterReason};
use sqlx::PgConnection;

use super::models::{Circuit, DisabledReason, EndpointHealth, FailureWindow, HeldDelivery, Timestamp};
use crate::error::AppResult;

/// An endpoint's health with what the rules need beside it.
pub struct HealthRow {
    pub endpoint_id: EndpointId,
    pub environment_id: EnvironmentId,
    pub circuit: Circuit,
    pub consecutive_failures: i32,
    pub failing_since: Option<Timestamp>,
    pub last_success_at: Option<Timestamp>,
    pub last_failure_at: Option<Timestamp>,
    pub next_probe_at: Option<Timestamp>,
    pub probe_interval_ms: i64,
    pub window_ms: i64,
    pub window_bucket: i64,
    pub window_attempts: i32,
    pub window_failures: i32,
    pub previous_attempts: i32,
    pub previous_failures: i32,
    pub failed_retries: i32,
    pub one_at_a_time: bool,
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
            window: FailureWindow {
                length_ms: self.window_ms,
                bucket: self.window_bucket,
                attempts: self.window_attempts,
                failures: self.window_failures,
                previous_attempts: self.previous_attempts,
                previous_failures: self.previous_failures,
            },
            failed_retries: self.failed_retries,
            one_at_a_time: self.one_at_a_time,
        }
    }
}

/// The health of these endpoints, unlocked.
pub async fn read(tx: &mut PgConnection, endpoint_ids: &[EndpointId]) -> AppResult<Vec<HealthRow>> {
    Ok(sqlx::query_as!(
        HealthRow,
        r#"SELECT h.endpoint_id, e.environment_id, h.circuit AS "circuit: Circuit", h.consecutive_failures, h.failing_since, h.last_success_at,
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, h.window_ms, h.window_bucket, h.window_attempts, h.window_failures,
                  h.previous_attempts, h.previous_failures, h.failed_retries, h.one_at_a_time, e.disabled_reason AS "disabled_reason?: DisabledReason",
                  v.disable_after_secs, v.disable_min_failures
           FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id JOIN environments v ON v.id = e.environment_id
           WHERE h.endpoint_id = ANY ($1)"#,
        endpoint_ids as _,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// The same, the health rows locked in endpoint order: a change of circuit
/// waits for expansions that read the old one (they hold KEY SHARE).
pub async fn lock(tx: &mut PgConnection, endpoint_ids: &[EndpointId]) -> AppResult<Vec<HealthRow>> {
    Ok(sqlx::query_as!(
        HealthRow,
        r#"SELECT h.endpoint_id, e.environment_id, h.circuit AS "circuit: Circuit", h.consecutive_failures, h.failing_since, h.last_success_at,
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, h.window_ms, h.window_bucket, h.window_attempts, h.window_failures,
                  h.previous_attempts, h.previous_failures, h.failed_retries, h.one_at_a_time, e.disabled_reason AS "disabled_reason?: DisabledReason",
                  v.disable_after_secs, v.disable_min_failures
           FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id JOIN environments v ON v.id = e.environment_id
           WHERE h.endpoint_id = ANY ($1) ORDER BY h.endpoint_id FOR UPDATE OF h"#,
        endpoint_ids as _,
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
                  h.last_failure_at, h.next_probe_at, h.probe_interval_ms, h.window_ms, h.window_bucket, h.window_attempts, h.window_failures,
                  h.previous_attempts, h.previous_failures, h.failed_retries, h.one_at_a_time, e.disabled_reason AS "disabled_reason?: DisabledReason",
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
pub async fn store(tx: &mut PgConnection, rows: &[(EndpointId, EndpointHealth)]) -> AppResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let column = |f: fn(&EndpointHealth) -> i32| -> Vec<i32> { rows.iter().map(|r| f(&r.1)).collect() };
    let ids: Vec<EndpointId> = rows.iter().map(|r| r.0).collect();
    let circuits: Vec<&str> = rows.iter().map(|r| r.1.circuit.as_str()).collect();
    let since: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.failing_since).collect();
    let success: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.last_success_at).collect();
    let failure: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.last_failure_at).collect();
    let probe: Vec<Option<Timestamp>> = rows.iter().map(|r| r.1.next_probe_at).collect();
    let interval: Vec<i64> = rows.iter().map(|r| r.1.probe_interval_ms).collect();
    let length: Vec<i64> = rows.iter().map(|r| r.1.window.length_ms).collect();
    let bucket: Vec<i64> = rows.iter().map(|r| r.1.window.bucket).collect();
    let one_at_a_time: Vec<bool> = rows.iter().map(|r| r.1.one_at_a_time).collect();
    sqlx::query!(
        "UPDATE endpoint_health h SET circuit = u.circuit, consecutive_failures = u.failures, failing_since = u.since,
           last_success_at = u.success, last_failure_at = u.failure, next_probe_at = u.probe, probe_interval_ms = u.interval,
           window_ms = u.length, window_bucket = u.bucket, window_attempts = u.attempts, window_failures = u.window_failures,
           previous_attempts = u.previous_attempts, previous_failures = u.previous_failures, failed_retries = u.failed_retries,
           one_at_a_time = u.one_at_a_time
         FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::timestamptz[], $5::timestamptz[], $6::timestamptz[], $7::timestamptz[], $8::bigint[],
                     $9::bigint[], $10::bigint[], $11::int[], $12::int[], $13::int[], $14::int[], $15::int[], $16::bool[])
           AS u(id, circuit, failures, since, success, failure, probe, interval, length, bucket, attempts, window_failures, previous_attempts,
                previous_failures, failed_retries, one_at_a_time)
         WHERE h.endpoint_id = ANY ($1::uuid[]) AND h.endpoint_id = u.id",
        &ids as _,
        &circuits as &[&str],
        &column(|h| h.consecutive_failures),
        &since as &[Option<Timestamp>],
        &success as &[Option<Timestamp>],
        &failure as &[Option<Timestamp>],
        &probe as &[Option<Timestamp>],
        &interval,
        &length,
        &bucket,
        &column(|h| h.window.attempts),
        &column(|h| h.window.failures),
        &column(|h| h.window.previous_attempts),
        &column(|h| h.window.previous_failures),
        &column(|h| h.failed_retries),
        &one_at_a_time,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A healthy endpoint's last success, moved forward without a lock on the
/// row's circuit (a plain update does not conflict with expansions).
pub async fn touch_success(tx: &mut PgConnection, endpoint_ids: &[EndpointId], at: Timestamp) -> AppResult<()> {
    sqlx::query!(
        "UPDATE endpoint_health SET last_success_at = $2 WHERE endpoint_id = ANY ($1) AND (last_success_at IS NULL OR last_success_at < $2)",
        endpoint_ids as _,
        at,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A new endpoint's health row: closed, no history.
pub async fn insert(tx: &mut PgConnection, endpoint_id: EndpointId) -> AppResult<()> {
    sqlx::query!("INSERT INTO endpoint_health (endpoint_id) VALUES ($1)", endpoint_id as _).execute(&mut *tx).await?;
    Ok(())
}

/// A clean slate (a tenant enabled or disabled the endpoint): no run of
/// failures, nothing in the window; `recovering` while it holds deliveries
/// (they go back as its answers come in, see `relay_domain::health`), else closed.
pub async fn reset(tx: &mut PgConnection, endpoint_id: EndpointId, recovering: bool) -> AppResult<()> {
    let circuit = if recovering { Circuit::Recovering } else { Circuit::Closed };
    sqlx::query!(
        "UPDATE endpoint_health SET circuit = $2, consecutive_failures = 0, failing_since = NULL, probe_interval_ms = 0,
           next_probe_at = CASE WHEN $2 = 'recovering' THEN now() END,
           window_attempts = 0, window_failures = 0, previous_attempts = 0, previous_failures = 0, failed_retries = 0,
           one_at_a_time = false
         WHERE endpoint_id = $1",
        endpoint_id as _,
        circuit.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every pending delivery of these endpoints becomes held, leased ones
/// included (a dispatcher holding the job is then refused its material; the
/// lease's expiry is not a due time, so those are due from now).
pub async fn hold_pending(tx: &mut PgConnection, endpoint_ids: &[EndpointId]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'held', dispatched_at = NULL, updated_at = now(), held_since = coalesce(held_since, now()),
           next_attempt_at = CASE WHEN dispatched_at IS NULL THEN next_attempt_at ELSE now() END
         -- The rows by id (as a join the planner may scan the whole table for them).
         WHERE id = ANY (ARRAY(SELECT id FROM webhook_deliveries
                               WHERE endpoint_id = ANY ($1)
                                 -- waiting and leased: each has its partial index
                                 AND (state = 'pending' AND dispatched_at IS NULL OR state = 'pending' AND dispatched_at IS NOT NULL)
                               FOR UPDATE SKIP LOCKED))",
        endpoint_ids as _,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Pending deliveries found by id become held (material met them after
/// their endpoint was disabled as gone).
pub async fn hold_by_id(db: &sqlx::PgPool, ids: &[DeliveryId]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'held', dispatched_at = NULL, updated_at = now(), held_since = coalesce(held_since, now()),
           next_attempt_at = CASE WHEN dispatched_at IS NULL THEN next_attempt_at ELSE now() END
         WHERE id = ANY ($1) AND state = 'pending'",
        ids as _,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// Held deliveries of these endpoints that are not yet due go back to
/// pending with their due times (the recovery began: the schedule paces
/// those); the due ones stay held for `release_due`.
pub async fn release_not_due(tx: &mut PgConnection, endpoint_ids: &[EndpointId]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', dispatched_at = NULL, held_since = NULL, updated_at = now()
         WHERE id = ANY (ARRAY(SELECT id FROM webhook_deliveries WHERE endpoint_id = ANY ($1) AND state = 'held' AND next_attempt_at > now()
                               FOR UPDATE SKIP LOCKED))",
        endpoint_ids as _,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Up to `counts[i]` due held deliveries of `endpoint_ids[i]` back to
/// pending, the earliest due first, as they are (attempt and due time kept:
/// each is attempted as the retry it was). Rows another transaction holds
/// are passed over. Returns how many went back.
pub async fn release_due(tx: &mut PgConnection, endpoint_ids: &[EndpointId], counts: &[i64]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', dispatched_at = NULL, held_since = NULL, updated_at = now()
         WHERE id = ANY (ARRAY(
           SELECT d.id FROM UNNEST($1::uuid[], $2::bigint[]) AS u(endpoint_id, n)
           CROSS JOIN LATERAL (SELECT id FROM webhook_deliveries
                               WHERE endpoint_id = u.endpoint_id AND state = 'held' AND next_attempt_at <= now()
                               ORDER BY next_attempt_at, id LIMIT u.n FOR UPDATE SKIP LOCKED) d))",
        endpoint_ids as _,
        counts,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Every held delivery of these endpoints back to pending as it is (the
/// circuit closed with something still held: a tenant's enable, or rows
/// an outcome batch held while the prober found none).
pub async fn release_all(tx: &mut PgConnection, endpoint_ids: &[EndpointId]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', dispatched_at = NULL, held_since = NULL, updated_at = now()
         WHERE id = ANY (ARRAY(SELECT id FROM webhook_deliveries WHERE endpoint_id = ANY ($1) AND state = 'held' FOR UPDATE SKIP LOCKED))",
        endpoint_ids as _,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Each endpoint's held delivery to probe: among the due ones, the one with
/// the most attempts (a receiver that refuses first requests and accepts
/// retries answers it), the earliest due of those; with none due, the first
/// to fall due (to wait for). None for an endpoint that holds nothing.
pub struct ProbeCandidate {
    pub endpoint_id: EndpointId,
    pub id: DeliveryId,
    pub next_attempt_at: Timestamp,
}

pub async fn probe_candidates(tx: &mut PgConnection, endpoint_ids: &[EndpointId], max_attempts: i32) -> AppResult<Vec<ProbeCandidate>> {
    Ok(sqlx::query_as!(
        ProbeCandidate,
        r#"SELECT u.endpoint_id AS "endpoint_id!", p.id AS "id!", p.next_attempt_at AS "next_attempt_at!"
           FROM UNNEST($1::uuid[]) AS u(endpoint_id)
           CROSS JOIN LATERAL (
             -- Per attempt number, most first, the earliest due (an index
             -- probe each: the held rows by endpoint, attempt, due time)…
             (SELECT d.id, d.next_attempt_at FROM generate_series($2::int, 1, -1) AS a(n)
              CROSS JOIN LATERAL (SELECT id, next_attempt_at FROM webhook_deliveries
                                  WHERE endpoint_id = u.endpoint_id AND state = 'held' AND attempt = a.n AND next_attempt_at <= now()
                                  ORDER BY next_attempt_at, id LIMIT 1) d
              LIMIT 1)
             UNION ALL
             -- …else the first to fall due.
             (SELECT id, next_attempt_at FROM webhook_deliveries WHERE endpoint_id = u.endpoint_id AND state = 'held'
              ORDER BY next_attempt_at, id LIMIT 1)
             LIMIT 1) p"#,
        endpoint_ids as _,
        max_attempts,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Each endpoint's earliest held retry (an attempt after the first) that
/// falls due after `after`: the next probe comes no later (see
/// `relay_domain::health::EndpointStanding::probe_by_held_retry`).
pub async fn next_held_retry_due(
    tx: &mut PgConnection,
    endpoint_ids: &[EndpointId],
    after: Timestamp,
) -> AppResult<Vec<(EndpointId, Timestamp)>> {
    Ok(sqlx::query!(
        r#"SELECT u.endpoint_id AS "endpoint_id!", r.due AS "due!"
           FROM UNNEST($1::uuid[]) AS u(endpoint_id)
           CROSS JOIN LATERAL (SELECT next_attempt_at AS due FROM webhook_deliveries
                               WHERE endpoint_id = u.endpoint_id AND state = 'held' AND attempt > 1 AND next_attempt_at > $2
                               ORDER BY next_attempt_at LIMIT 1) r"#,
        endpoint_ids as _,
        after,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.endpoint_id.into(), r.due))
    .collect())
}

/// Whether the endpoint holds any delivery.
pub async fn holds_any(tx: &mut PgConnection, endpoint_id: EndpointId) -> AppResult<bool> {
    Ok(sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'held') AS "held!""#,
        endpoint_id as _
    )
    .fetch_one(&mut *tx)
    .await?)
}

/// Held deliveries become pending as they are (due): the probes. Their
/// `held_since` stays: a probe that fails is held again with the rest, and
/// the bound on holding counts from when it was first held.
pub async fn release_probes(tx: &mut PgConnection, ids: &[DeliveryId]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', dispatched_at = NULL, updated_at = now() WHERE id = ANY ($1) AND state = 'held'",
        ids as _,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Held deliveries held longer than their environment's `max_held_secs`
/// end as dead letters `endpoint_failing` (replayable like any other), at
/// most `limit` per call: an endpoint gone for good neither pins its events
/// past retention nor grows storage without end.
pub async fn expire_held(db: &sqlx::PgPool, limit: i64) -> AppResult<u64> {
    Ok(sqlx::query!(
        "WITH ended AS (
           UPDATE webhook_deliveries d SET state = 'dead', dispatched_at = NULL, last_error = $1, held_since = NULL, updated_at = now()
           WHERE d.id = ANY (ARRAY(
             SELECT h.id FROM webhook_deliveries h JOIN environments v ON v.id = h.environment_id
             -- The shortest bound of any environment first: an index range
             -- on the held rows' age, not a walk over every held row.
             WHERE h.state = 'held' AND h.held_since < now() - make_interval(secs => (SELECT min(max_held_secs) FROM environments))
               AND h.held_since < now() - make_interval(secs => v.max_held_secs)
             ORDER BY h.held_since LIMIT $2 FOR UPDATE OF h SKIP LOCKED))
           RETURNING d.id, d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.last_status)
         INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason)
         SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt - 1, last_status, $1, $1 FROM ended",
        DeadLetterReason::EndpointFailing.as_str(),
        limit,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// Held deliveries of one endpoint in the order they fall due, a page after
/// the `(next_attempt_at, id)` of the last one shown.
pub async fn list_held(
    db: &sqlx::PgPool,
    endpoint_id: EndpointId,
    after: Option<(Timestamp, DeliveryId)>,
    limit: i64,
) -> AppResult<Vec<HeldDelivery>> {
    let (after_at, after_id) = after.unzip();
    Ok(sqlx::query_as!(
        HeldDelivery,
        "SELECT id, event_id, attempt, next_attempt_at, created_at, last_status, last_error FROM webhook_deliveries
         WHERE endpoint_id = $1 AND state = 'held' AND ($2::timestamptz IS NULL OR (next_attempt_at, id) > ($2, $3))
         ORDER BY next_attempt_at, id LIMIT $4",
        endpoint_id as _,
        after_at,
        after_id as _,
        limit,
    )
    .fetch_all(db)
    .await?)
}
