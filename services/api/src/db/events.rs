//! `events` and the `consumed_events` ledger, as expansion uses them.

use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::AppResult;

/// The stored type of each of these events that exists, by (environment, id).
pub async fn types_of(tx: &mut PgConnection, environments: &[Uuid], ids: &[Uuid]) -> AppResult<HashMap<(Uuid, Uuid), String>> {
    Ok(sqlx::query_as::<_, (Uuid, Uuid, String)>(
        "SELECT v.environment_id, v.id, v.event_type FROM events v
         JOIN UNNEST($1::uuid[], $2::uuid[]) AS k(environment_id, id) ON v.environment_id = k.environment_id AND v.id = k.id",
    )
    .bind(environments)
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|(env, id, t)| ((env, id), t))
    .collect())
}

/// Marks these events consumed by `consumer`; returns those this call
/// marked (the rest were consumed before). Pass them in key order, so two
/// callers that share events cannot deadlock.
pub async fn mark_consumed(tx: &mut PgConnection, consumer: &str, environments: &[Uuid], ids: &[Uuid]) -> AppResult<HashSet<(Uuid, Uuid)>> {
    Ok(sqlx::query_as::<_, (Uuid, Uuid)>(
        "INSERT INTO consumed_events (consumer, environment_id, event_id)
         SELECT $1, * FROM UNNEST($2::uuid[], $3::uuid[])
         ON CONFLICT DO NOTHING RETURNING environment_id, event_id",
    )
    .bind(consumer)
    .bind(environments)
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect())
}
