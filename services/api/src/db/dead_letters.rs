//! `webhook_dead_letters`: the record of every delivery that ended without a
//! 2xx. Ids are time-ordered (UUIDv7) wherever a dead letter is written.
//! And `dead_letter_notices`: the dead letters each endpoint has yet to
//! announce (`delivery.dead_lettered` operational events).

use std::{collections::HashSet, time::Duration};

use sqlx::{PgConnection, PgPool};

use relay_domain::{DeadLetterId, DeliveryId, EndpointId, EnvironmentId, EventId, delivery::DeadLetterReason};

pub use super::models::DeadLetter;
use super::models::Timestamp;
use crate::error::AppResult;

/// Dead letters of one outcome batch, column by column for one `UNNEST` insert.
#[derive(Default)]
pub struct DeadLetterRows {
    pub id: Vec<DeadLetterId>,
    pub environment_id: Vec<EnvironmentId>,
    pub delivery_id: Vec<DeliveryId>,
    pub endpoint_id: Vec<EndpointId>,
    pub event_id: Vec<EventId>,
    pub attempts: Vec<i32>,
    pub last_status: Vec<Option<i32>>,
    pub last_error: Vec<Option<String>>,
}

impl DeadLetterRows {
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        delivery_id: DeliveryId,
        environment_id: EnvironmentId,
        endpoint_id: EndpointId,
        event_id: EventId,
        attempts: i32,
        last_status: Option<i32>,
        last_error: Option<String>,
    ) {
        self.id.push(DeadLetterId::mint());
        self.environment_id.push(environment_id);
        self.delivery_id.push(delivery_id);
        self.endpoint_id.push(endpoint_id);
        self.event_id.push(event_id);
        self.attempts.push(attempts);
        self.last_status.push(last_status);
        self.last_error.push(last_error);
    }

    pub fn is_empty(&self) -> bool {
        self.delivery_id.is_empty()
    }
}

/// Attempts ran out: one insert for the batch.
pub async fn insert_exhausted(tx: &mut PgConnection, rows: &DeadLetterRows) -> AppResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error)
         SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::uuid[], $6::int[], $7::int[], $8::text[])",
        &rows.id as _,
        &rows.environment_id as _,
        &rows.delivery_id as _,
        &rows.endpoint_id as _,
        &rows.event_id as _,
        &rows.attempts,
        &rows.last_status as &[Option<i32>],
        &rows.last_error as &[Option<String>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Of these deliveries, those ended by a switch-off while their current
/// attempt was on the wire (the dead letter counts the attempts before it).
pub async fn switched_off_in_flight(tx: &mut PgConnection, delivery_ids: &[DeliveryId]) -> AppResult<HashSet<DeliveryId>> {
    Ok(sqlx::query_scalar!(
        "SELECT l.delivery_id FROM webhook_dead_letters l JOIN webhook_deliveries d ON d.id = l.delivery_id
         WHERE l.delivery_id = ANY ($1) AND l.reason IN ('endpoint_disabled', 'endpoint_deleted')
           AND d.state = 'dead' AND l.attempts = d.attempt - 1",
        delivery_ids as _,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(DeliveryId::from)
    .collect())
}

/// Delivered after all: the provisional dead letters go, so a replay cannot
/// send the receiver an event it already has.
pub async fn withdraw_switch_off(tx: &mut PgConnection, delivery_ids: &[DeliveryId]) -> AppResult<()> {
    if delivery_ids.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "DELETE FROM webhook_dead_letters WHERE delivery_id = ANY ($1) AND reason IN ('endpoint_disabled', 'endpoint_deleted')",
        delivery_ids as _
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The attempt in flight at the switch-off failed: its result completes the
/// provisional dead letter.
pub async fn complete_switch_off(tx: &mut PgConnection, rows: &DeadLetterRows) -> AppResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "UPDATE webhook_dead_letters l SET attempts = u.attempts, last_status = u.last_status, last_error = u.last_error
         FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::text[]) AS u(delivery_id, attempts, last_status, last_error)
         WHERE l.delivery_id = ANY ($1::uuid[]) AND l.delivery_id = u.delivery_id AND l.reason IN ('endpoint_disabled', 'endpoint_deleted')",
        &rows.delivery_id as _,
        &rows.attempts,
        &rows.last_status as &[Option<i32>],
        &rows.last_error as &[Option<String>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A dead letter to replay: its delivery, its endpoint, and whether that
/// endpoint takes deliveries (enabled, or disabled by Relay, which holds
/// them: a replay then waits, held, with the rest). `environment` scopes
/// the lookup (`None`: any).
pub async fn find_for_replay(
    tx: &mut PgConnection,
    id: DeadLetterId,
    environment: Option<EnvironmentId>,
) -> AppResult<Option<(DeliveryId, EndpointId, bool)>> {
    Ok(sqlx::query!(
        r#"SELECT l.delivery_id, l.endpoint_id, (e.enabled OR e.disabled_reason IN ('gone', 'failing')) AND e.deleted_at IS NULL AS "active!"
         FROM webhook_dead_letters l JOIN webhook_endpoints e ON e.id = l.endpoint_id
         WHERE l.id = $1 AND ($2::uuid IS NULL OR l.environment_id = $2)"#,
        id as _,
        environment as _,
    )
    .fetch_optional(&mut *tx)
    .await?
    .map(|r| (r.delivery_id.into(), r.endpoint_id.into(), r.active)))
}

/// Deletes dead letters older than `retention`.
pub async fn prune(db: &PgPool, retention: Duration) -> AppResult<u64> {
    let retention = super::interval(retention)?;
    Ok(sqlx::query!("DELETE FROM webhook_dead_letters WHERE dead_lettered_at < now() - $1::interval", retention)
        .execute(db)
        .await?
        .rows_affected())
}

/// An environment's newest dead letters.
pub async fn list(db: &PgPool, environment_id: EnvironmentId) -> AppResult<Vec<DeadLetter>> {
    Ok(sqlx::query_as!(
        DeadLetter,
        r#"SELECT l.id, l.delivery_id, l.endpoint_id, l.event_id, l.attempts, l.last_status, l.last_error, l.reason AS "reason: DeadLetterReason", l.dead_lettered_at,
                  (d.state IS DISTINCT FROM 'dead'
                   OR EXISTS (SELECT 1 FROM webhook_dead_letters n WHERE n.delivery_id = l.delivery_id AND n.dead_lettered_at > l.dead_lettered_at))
                    AS "replayed!",
                  d.ordering_key AS "ordering_key?",
                  -- The lane's numbers given out after this one's: each a
                  -- later delivery of the key, sent once it had died.
                  CASE WHEN d.state = 'dead' THEN
                    (SELECT g.last_position - d.ordering_position FROM ordering_lanes g
                     WHERE g.endpoint_id = d.endpoint_id AND g.ordering_key = d.ordering_key) END AS later_in_key
         FROM webhook_dead_letters l LEFT JOIN webhook_deliveries d ON d.id = l.delivery_id
         WHERE l.environment_id = $1 ORDER BY l.dead_lettered_at DESC, l.id DESC LIMIT 1000"#,
        environment_id as _,
    )
    .fetch_all(db)
    .await?)
}

/// Dead letters to announce, counted per endpoint (in the transaction that
/// wrote them).
pub async fn count_dead_letter_notices(
    tx: &mut PgConnection,
    endpoint_ids: &[EndpointId],
    environment_ids: &[EnvironmentId],
) -> AppResult<()> {
    sqlx::query!(
        "INSERT INTO dead_letter_notices AS n (endpoint_id, environment_id, pending, first_at)
         SELECT endpoint_id, environment_id, count(*), now() FROM UNNEST($1::uuid[], $2::uuid[]) AS u(endpoint_id, environment_id)
         GROUP BY endpoint_id, environment_id
         ON CONFLICT (endpoint_id) DO UPDATE SET pending = n.pending + excluded.pending, first_at = coalesce(n.first_at, excluded.first_at)",
        endpoint_ids as _,
        environment_ids as _,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Counted dead letters ready to announce: gathered for `gather` since the
/// first, and the endpoint's last announcement at least `every` ago. Taken
/// (reset) in the same statement; the caller writes the events in the same
/// transaction.
pub struct Notice {
    pub endpoint_id: EndpointId,
    pub environment_id: EnvironmentId,
    pub count: i32,
    pub since: Timestamp,
}

pub async fn take_dead_letter_notices(tx: &mut PgConnection, gather: Duration, every: Duration) -> AppResult<Vec<Notice>> {
    let (gather, every) = (super::interval(gather)?, super::interval(every)?);
    Ok(sqlx::query_as!(
        Notice,
        r#"UPDATE dead_letter_notices n SET pending = 0, first_at = NULL, last_sent_at = now()
           FROM (SELECT endpoint_id, pending, first_at FROM dead_letter_notices
                 WHERE pending > 0 AND first_at <= now() - $1::interval
                   AND (last_sent_at IS NULL OR last_sent_at <= now() - $2::interval)
                 ORDER BY first_at LIMIT 500 FOR UPDATE SKIP LOCKED) due
           WHERE n.endpoint_id = due.endpoint_id
           RETURNING n.endpoint_id, n.environment_id, due.pending AS count, due.first_at AS "since!""#,
        gather,
        every,
    )
    .fetch_all(&mut *tx)
    .await?)
}
