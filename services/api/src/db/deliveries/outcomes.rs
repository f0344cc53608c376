//! Recording attempts' outcomes: the one statement that applies the
//! reports for current attempts, the careful path's locked reads and
//! rewrites, and a replay's reset.

use relay_domain::{DeliveryId, EndpointId, EnvironmentId, EventId};
use sqlx::PgConnection;

use crate::{
    db::models::{Circuit, DeliveryState, DisabledReason, Timestamp},
    error::AppResult,
};

/// Outcomes to apply where they are for the delivery's current attempt,
/// column by column, with what the attempt log keeps of each.
#[derive(Default)]
pub struct CurrentOutcomes {
    pub id: Vec<DeliveryId>,
    pub generation: Vec<i32>,
    pub attempt: Vec<i32>,
    pub state: Vec<DeliveryState>,
    pub next_attempt: Vec<i32>,
    pub next_attempt_at: Vec<Option<Timestamp>>,
    pub status: Vec<Option<i32>>,
    /// The report's error: the attempt log's, and the delivery's unless delivered.
    pub error: Vec<Option<String>>,
    pub latency_ms: Vec<i64>,
    pub response_body: Vec<Vec<u8>>,
    pub decision: Vec<&'static str>,
    pub signature_scheme: Vec<Option<&'static str>>,
}

/// A delivery an outcome applied to, with its endpoint's health as it
/// stood before this statement.
pub struct AppliedOutcome {
    pub id: DeliveryId,
    pub environment_id: EnvironmentId,
    pub endpoint_id: EndpointId,
    pub event_id: EventId,
    pub circuit: Circuit,
    pub consecutive_failures: i32,
    pub last_success_at: Option<Timestamp>,
    pub disabled_reason: Option<DisabledReason>,
    /// The window's length, current bucket and failures in it and the
    /// previous one: whether a failure is still inside the window.
    pub window_ms: i64,
    pub window_bucket: i64,
    pub window_failures: i32,
    pub previous_failures: i32,
    /// Its lane's key, at an endpoint that orders per key.
    pub ordering_key: Option<String>,
    /// Its position in its lane, once it has been a lane's head.
    pub ordering_position: Option<i64>,
}

/// Applies each outcome only where it is for the current attempt (pending,
/// or held since it was sent; same generation and attempt), logs the
/// attempts it applied and writes the dead letters of those that ran out,
/// in one statement; returns the deliveries it applied to, with their
/// endpoints' health (what the circuit rules need next). One statement, so
/// a batch of successes needs no transaction around it.
pub async fn record_current_outcomes(conn: &mut PgConnection, o: &CurrentOutcomes) -> AppResult<Vec<AppliedOutcome>> {
    let states: Vec<&str> = o.state.iter().map(|s| s.as_str()).collect();
    Ok(sqlx::query_as!(
        AppliedOutcome,
        r#"WITH applied AS (
             UPDATE webhook_deliveries d SET state = u.state, attempt = u.next_attempt, next_attempt_at = coalesce(u.next_attempt_at, d.next_attempt_at),
               dispatched_at = NULL, last_status = u.status, last_error = CASE WHEN u.state = 'delivered' THEN NULL ELSE u.error END,
               updated_at = now()
             FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::text[], $5::int[], $6::timestamptz[], $7::int[], $8::text[],
                         $9::bigint[], $10::bytea[], $11::text[], $12::text[])
               AS u(id, generation, attempt, state, next_attempt, next_attempt_at, status, error, latency_ms, body, decision, scheme)
             -- The ids as an index condition too (INDEXED_LOOKUPS). The state
             -- test names the report so that it stays a join condition
             -- (JOINS_BY_ESTIMATE): the rows read by id are then as many as
             -- the reports, not the one a pending-state estimate predicts.
             WHERE d.id = ANY ($1::uuid[]) AND d.id = u.id AND d.generation = u.generation AND d.attempt = u.attempt
               AND (d.state IN ('pending', 'held') OR u.id IS NULL)
             -- What the log and the dead letters need comes with each row:
             -- nothing joins the applied rows to the reports again.
             RETURNING d.id, d.environment_id, d.endpoint_id, d.event_id, d.ordering_key, d.ordering_position, u.generation, u.attempt, u.state AS reported_state,
                       u.status, u.error, u.latency_ms, u.body, u.decision, u.next_attempt_at, u.scheme),
           logged AS (
             INSERT INTO delivery_attempts
               (delivery_id, generation, attempt, environment_id, http_status, error, latency_ms, response_body, decision, next_attempt_at,
                signature_scheme)
             SELECT id, generation, attempt, environment_id, status, error, latency_ms, body, decision, next_attempt_at, scheme FROM applied),
           -- The dead letter and the state change commit together: a dead
           -- delivery always has its record.
           exhausted AS (
             INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error)
             SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt, status, error
             FROM applied WHERE reported_state = 'dead')
         SELECT a.id AS "id!", a.environment_id AS "environment_id!", a.endpoint_id AS "endpoint_id!", a.event_id AS "event_id!",
                h.circuit AS "circuit!: Circuit", h.consecutive_failures AS "consecutive_failures!", h.last_success_at,
                e.disabled_reason AS "disabled_reason?: DisabledReason", h.window_ms AS "window_ms!", h.window_bucket AS "window_bucket!",
                h.window_failures AS "window_failures!", h.previous_failures AS "previous_failures!", a.ordering_key,
                a.ordering_position
         FROM applied a JOIN endpoint_health h ON h.endpoint_id = a.endpoint_id JOIN webhook_endpoints e ON e.id = a.endpoint_id"#,
        &o.id as _,
        &o.generation,
        &o.attempt,
        &states as &[&str],
        &o.next_attempt,
        &o.next_attempt_at as &[Option<Timestamp>],
        &o.status as &[Option<i32>],
        &o.error as &[Option<String>],
        &o.latency_ms,
        &o.response_body,
        &o.decision as &[&str],
        &o.signature_scheme as &[Option<&str>],
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// A delivery as the careful outcome path reads and rewrites it.
#[derive(Clone)]
pub struct OutcomeRow {
    pub id: DeliveryId,
    pub environment_id: EnvironmentId,
    pub endpoint_id: EndpointId,
    pub event_id: EventId,
    pub attempt: i32,
    pub generation: i32,
    pub state: DeliveryState,
    pub next_attempt_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    /// Its lane's key, at an endpoint that orders per key.
    pub ordering_key: Option<String>,
    /// Its position in its lane, once it has been a lane's head.
    pub ordering_position: Option<i64>,
}

/// The deliveries locked for update, in id order (so two batches that share
/// a delivery lock in the same order).
pub async fn lock_for_outcome(tx: &mut PgConnection, ids: &[DeliveryId]) -> AppResult<Vec<OutcomeRow>> {
    Ok(sqlx::query_as!(
        OutcomeRow,
        r#"SELECT id, environment_id, endpoint_id, event_id, attempt, generation, state AS "state: DeliveryState", next_attempt_at,
                  last_status, last_error, ordering_key, ordering_position
         FROM webhook_deliveries WHERE id = ANY ($1) ORDER BY id FOR UPDATE"#,
        ids as _,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Writes back rows the careful path changed.
pub async fn rewrite_after_outcome(tx: &mut PgConnection, rows: &[&OutcomeRow]) -> AppResult<()> {
    let ids: Vec<DeliveryId> = rows.iter().map(|r| r.id).collect();
    let states: Vec<&str> = rows.iter().map(|r| r.state.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempt).collect();
    let due: Vec<Timestamp> = rows.iter().map(|r| r.next_attempt_at).collect();
    let statuses: Vec<Option<i32>> = rows.iter().map(|r| r.last_status).collect();
    let errors: Vec<Option<String>> = rows.iter().map(|r| r.last_error.clone()).collect();
    sqlx::query!(
        "UPDATE webhook_deliveries d SET state = u.state, attempt = u.attempt, next_attempt_at = u.next_attempt_at,
           dispatched_at = NULL, last_status = u.last_status, last_error = u.last_error, updated_at = now()
         FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::timestamptz[], $5::int[], $6::text[])
           AS u(id, state, attempt, next_attempt_at, last_status, last_error)
         WHERE d.id = ANY ($1::uuid[]) AND d.id = u.id",
        &ids as _,
        &states as &[&str],
        &attempts,
        &due,
        &statuses as &[Option<i32>],
        &errors as &[Option<String>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A dead delivery back at attempt 1, due now, in a new generation; in a
/// lane, queued at its tail instead (ranked after every event of its key
/// published so far, before any published later). `None` when it is
/// no longer dead (already replayed); else its lane's key, if it has one.
pub async fn reset_for_replay(tx: &mut PgConnection, delivery_id: DeliveryId) -> AppResult<Option<Option<String>>> {
    Ok(sqlx::query_scalar!(
        "UPDATE webhook_deliveries d SET state = CASE WHEN d.ordering_key IS NULL THEN 'pending' ELSE 'queued' END,
           attempt = 1, generation = generation + 1, next_attempt_at = now(), dispatched_at = NULL, updated_at = now(),
           ordering_position = NULL,
           ordering_rank = CASE WHEN d.ordering_key IS NULL THEN NULL ELSE
             (SELECT k.last_sequence * 2 + 1 FROM ordering_keys k WHERE k.environment_id = d.environment_id AND k.ordering_key = d.ordering_key)
           END
         WHERE id = $1 AND state = 'dead'
         RETURNING d.ordering_key",
        delivery_id as _,
    )
    .fetch_optional(&mut *tx)
    .await?)
}
