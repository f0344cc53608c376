//! `recover_operations`, and the statements a recovery pass runs.

use relay_domain::{DeliveryId, EndpointId, EnvironmentId, OperationId};
use sqlx::{PgConnection, PgPool};

use super::models::{Operation, Timestamp};
use crate::error::AppResult;

/// Dead deliveries (still with their dead letter) and held ones of an
/// endpoint created in `[since, until)`: what a recovery would send again.
pub async fn count_recoverable(db: &PgPool, endpoint_id: EndpointId, since: Timestamp, until: Timestamp) -> AppResult<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM webhook_deliveries d
           WHERE d.endpoint_id = $1 AND d.state IN ('dead', 'held') AND d.created_at >= $2 AND d.created_at < $3
             AND (d.state = 'held' OR EXISTS (SELECT 1 FROM webhook_dead_letters l WHERE l.delivery_id = d.id))"#,
        endpoint_id as _,
        since,
        until,
    )
    .fetch_one(db)
    .await?)
}

pub async fn insert(
    db: &PgPool,
    environment_id: EnvironmentId,
    endpoint_id: EndpointId,
    since: Timestamp,
    until: Timestamp,
    total: i32,
) -> AppResult<Operation> {
    Ok(sqlx::query_as!(
        Operation,
        "INSERT INTO recover_operations (id, environment_id, endpoint_id, since, until, total) VALUES ($1, $2, $3, $4, $5, $6)
         RETURNING id, environment_id, endpoint_id, since, until, state, total, completed, cursor_at, cursor_id AS \"cursor_id: DeliveryId\", error",
        OperationId::mint() as _,
        environment_id as _,
        endpoint_id as _,
        since,
        until,
        total,
    )
    .fetch_one(db)
    .await?)
}

/// An operation of the environment (`None`: any).
pub async fn get(db: &PgPool, id: OperationId, environment_id: Option<EnvironmentId>) -> AppResult<Option<Operation>> {
    Ok(sqlx::query_as!(
        Operation,
        "SELECT id, environment_id, endpoint_id, since, until, state, total, completed, cursor_at, cursor_id AS \"cursor_id: DeliveryId\", error
         FROM recover_operations WHERE id = $1 AND ($2::uuid IS NULL OR environment_id = $2)",
        id as _,
        environment_id as _,
    )
    .fetch_optional(db)
    .await?)
}

/// The oldest running operation of each endpoint, locked; one another pass
/// holds is skipped. One at a time per endpoint keeps the throttle per
/// endpoint, and a later overlapping request finds the earlier one's work done.
pub async fn lock_running(tx: &mut PgConnection) -> AppResult<Vec<Operation>> {
    Ok(sqlx::query_as!(
        Operation,
        "SELECT id, environment_id, endpoint_id, since, until, state, total, completed, cursor_at, cursor_id AS \"cursor_id: DeliveryId\", error
         FROM recover_operations
         WHERE id IN (SELECT DISTINCT ON (endpoint_id) id FROM recover_operations WHERE state = 'running' ORDER BY endpoint_id, created_at)
         ORDER BY created_at LIMIT 100 FOR UPDATE SKIP LOCKED",
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// A delivery a recovery pass takes.
pub struct Recoverable {
    pub id: DeliveryId,
    pub created_at: Timestamp,
    /// Replayed into its lane (queued at the tail): the lane's key.
    pub queued_in: Option<String>,
}

/// The next `limit` recoverable deliveries after the operation's cursor,
/// locked, sent again in the same statement: a dead one is replayed (attempt
/// 1 of a new generation), a held one released; both due now. A dead one of
/// a lane is queued at the lane's tail (see `reset_for_replay`).
pub async fn recover_next(tx: &mut PgConnection, op: &Operation, limit: i64) -> AppResult<Vec<Recoverable>> {
    Ok(sqlx::query_as!(
        Recoverable,
        r#"WITH next AS (
             SELECT d.id, d.created_at, d.state FROM webhook_deliveries d
             WHERE d.endpoint_id = $1 AND d.state IN ('dead', 'held') AND d.created_at >= $2 AND d.created_at < $3
               AND ($4::timestamptz IS NULL OR (d.created_at, d.id) > ($4, $5))
               AND (d.state = 'held' OR EXISTS (SELECT 1 FROM webhook_dead_letters l WHERE l.delivery_id = d.id))
             ORDER BY d.created_at, d.id LIMIT $6 FOR UPDATE)
           UPDATE webhook_deliveries d
           SET state = CASE WHEN next.state = 'dead' AND d.ordering_key IS NOT NULL THEN 'queued' ELSE 'pending' END,
               dispatched_at = NULL, next_attempt_at = now(), updated_at = now(),
               attempt = CASE WHEN next.state = 'dead' THEN 1 ELSE d.attempt END,
               generation = CASE WHEN next.state = 'dead' THEN d.generation + 1 ELSE d.generation END,
               ordering_position = CASE WHEN next.state = 'dead' THEN NULL ELSE d.ordering_position END,
               ordering_rank = CASE WHEN next.state = 'dead' AND d.ordering_key IS NOT NULL THEN
                 (SELECT k.last_sequence * 2 + 1 FROM ordering_keys k WHERE k.environment_id = d.environment_id AND k.ordering_key = d.ordering_key)
                 ELSE d.ordering_rank END
           FROM next WHERE d.id = next.id
           RETURNING d.id, d.created_at, CASE WHEN d.state = 'queued' THEN d.ordering_key END AS queued_in"#,
        op.endpoint_id as _,
        op.since,
        op.until,
        op.cursor_at,
        op.cursor_id as _,
        limit,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Progress after a pass: the cursor moved to the last delivery handled.
pub async fn advance(
    tx: &mut PgConnection,
    id: OperationId,
    done: i32,
    cursor: Option<(Timestamp, DeliveryId)>,
    finished: bool,
) -> AppResult<()> {
    let (at, cursor_id) = cursor.unzip();
    sqlx::query!(
        "UPDATE recover_operations SET completed = completed + $2, cursor_at = coalesce($3, cursor_at), cursor_id = coalesce($4, cursor_id),
           state = CASE WHEN $5 THEN 'done' ELSE state END, updated_at = now()
         WHERE id = $1",
        id as _,
        done,
        at,
        cursor_id as _,
        finished,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

pub async fn fail(tx: &mut PgConnection, id: OperationId, error: &str) -> AppResult<()> {
    sqlx::query!("UPDATE recover_operations SET state = 'failed', error = $2, updated_at = now() WHERE id = $1", id as _, error)
        .execute(&mut *tx)
        .await?;
    Ok(())
}
