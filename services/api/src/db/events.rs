//! `events` (each row is also the outbox row) and the `consumed_events`
//! ledger, as the outbox relay and expansion use them.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use sqlx::{PgConnection, PgPool, postgres::types::PgInterval};
use uuid::Uuid;

use super::models::{Delivery, DeliveryState, Timestamp};
use crate::error::AppResult;

/// The stored type of each of these events that exists, by (environment, id).
pub async fn types_of(tx: &mut PgConnection, environments: &[Uuid], ids: &[Uuid]) -> AppResult<HashMap<(Uuid, Uuid), String>> {
    Ok(sqlx::query!(
        "SELECT v.environment_id, v.id, v.event_type FROM events v
         JOIN UNNEST($1::uuid[], $2::uuid[]) AS k(environment_id, id) ON v.environment_id = k.environment_id AND v.id = k.id",
        environments,
        ids,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| ((r.environment_id, r.id), r.event_type))
    .collect())
}

/// Marks these events consumed by `consumer`; returns those this call
/// marked (the rest were consumed before). Pass them in key order, so two
/// callers that share events cannot deadlock.
pub async fn mark_consumed(tx: &mut PgConnection, consumer: &str, environments: &[Uuid], ids: &[Uuid]) -> AppResult<HashSet<(Uuid, Uuid)>> {
    Ok(sqlx::query!(
        "INSERT INTO consumed_events (consumer, environment_id, event_id)
         SELECT $1, * FROM UNNEST($2::uuid[], $3::uuid[])
         ON CONFLICT DO NOTHING RETURNING environment_id, event_id",
        consumer,
        environments,
        ids,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.environment_id, r.event_id))
    .collect())
}

/// An unpublished event as the outbox relay claims it:
/// (seq, id, environment, type, trace context).
pub type OutboxRow = (i64, Uuid, Uuid, String, Option<String>);

/// Claims up to `limit` unpublished events nobody holds, oldest first, for
/// `claim`, in one statement (committed without waiting for the disk: a
/// claim lost to a crash is a re-publish the broker drops).
pub async fn claim_unpublished(db: &PgPool, limit: i64, claim: Duration) -> AppResult<Vec<OutboxRow>> {
    let claim = PgInterval::try_from(claim).map_err(|e| anyhow::anyhow!("a claim of {claim:?} is not an interval: {e}"))?;
    Ok(sqlx::query!(
        "UPDATE events SET relay_claim_until = now() + $2
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
         WHERE seq IN (SELECT seq FROM events
                       WHERE published_at IS NULL AND (relay_claim_until IS NULL OR relay_claim_until < now())
                       ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED)
         RETURNING seq, id, environment_id, event_type, trace_context",
        limit,
        claim,
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .map(|r| (r.seq, r.id, r.environment_id, r.event_type, r.trace_context))
    .collect())
}

/// The broker has these: published, claim ended.
pub async fn mark_published(db: &PgPool, seqs: &[i64]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE events SET published_at = now(), relay_claim_until = NULL
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit WHERE seq = ANY ($1)",
        seqs,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// The broker refused these: the next pass may take them at once.
pub async fn release_refused(db: &PgPool, seqs: &[i64]) -> AppResult<u64> {
    Ok(sqlx::query!("UPDATE events SET relay_claim_until = NULL WHERE seq = ANY ($1) AND published_at IS NULL", seqs)
        .execute(db)
        .await?
        .rows_affected())
}

/// A new event, which is also its outbox row. False when the environment
/// already has an event with this id (a repeat publish).
#[allow(clippy::too_many_arguments)]
pub async fn insert(
    db: &PgPool,
    id: Uuid,
    environment_id: Uuid,
    event_type: &str,
    envelope: &[u8],
    occurred_at: Timestamp,
    trace_context: Option<String>,
) -> AppResult<bool> {
    Ok(sqlx::query!(
        "INSERT INTO events (id, environment_id, event_type, envelope, created_at, trace_context)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (environment_id, id) DO NOTHING",
        id,
        environment_id,
        event_type,
        envelope,
        occurred_at,
        trace_context,
    )
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

pub async fn exists(tx: &mut PgConnection, environment_id: Uuid, id: Uuid) -> AppResult<bool> {
    Ok(sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM events WHERE id = $1 AND environment_id = $2) AS "exists!""#,
        id,
        environment_id
    )
    .fetch_one(&mut *tx)
    .await?)
}

/// An event's deliveries, oldest first, without their attempts.
pub async fn deliveries_of(tx: &mut PgConnection, environment_id: Uuid, event_id: Uuid) -> AppResult<Vec<Delivery>> {
    Ok(sqlx::query!(
        r#"SELECT id, event_id, endpoint_id, state AS "state: DeliveryState", attempt, next_attempt_at, created_at, last_status,
                  last_error, generation
         FROM webhook_deliveries WHERE event_id = $1 AND environment_id = $2 ORDER BY created_at, id"#,
        event_id,
        environment_id,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| Delivery {
        id: r.id,
        event_id: r.event_id,
        endpoint_id: r.endpoint_id,
        state: r.state,
        attempt: r.attempt,
        next_attempt_at: r.next_attempt_at,
        created_at: r.created_at,
        last_status: r.last_status,
        last_error: r.last_error,
        generation: r.generation,
        attempts: Vec::new(),
    })
    .collect())
}
