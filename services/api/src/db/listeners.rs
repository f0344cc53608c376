//! `listeners`: the temporary endpoints of `relay-dev listen`, whose key
//! opened them and whether their call is alive (see the migration).

use relay_domain::{EndpointId, EnvironmentId};
use sqlx::{PgConnection, PgPool};

use crate::error::AppResult;

/// A key's listener not yet removed: its endpoint, and whether its call is
/// alive (not ended, stamped within `stale_secs`).
pub async fn of_key(db: &PgPool, key_prefix: &str, stale_secs: f64) -> AppResult<Option<(EndpointId, EnvironmentId, bool)>> {
    let row = sqlx::query!(
        r#"SELECT endpoint_id AS "endpoint_id: EndpointId", environment_id AS "environment_id: EnvironmentId",
                  (ended_at IS NULL AND seen_at > now() - make_interval(secs => $2)) AS "live!"
           FROM listeners WHERE api_key_prefix = $1 AND removed_at IS NULL"#,
        key_prefix,
        stale_secs,
    )
    .fetch_optional(db)
    .await?;
    Ok(row.map(|r| (r.endpoint_id, r.environment_id, r.live)))
}

/// Whether the endpoint is a listener's (removed or not: its row outlives
/// the call).
pub async fn is_listener(db: &PgPool, endpoint_id: EndpointId) -> AppResult<bool> {
    Ok(sqlx::query_scalar!(r#"SELECT EXISTS (SELECT 1 FROM listeners WHERE endpoint_id = $1) AS "listener!""#, endpoint_id as _)
        .fetch_one(db)
        .await?)
}

/// Records a new listener; `false` if the key has one (a race lost).
pub async fn insert(tx: &mut PgConnection, endpoint_id: EndpointId, environment_id: EnvironmentId, key_prefix: &str) -> AppResult<bool> {
    let done = sqlx::query!(
        "INSERT INTO listeners (endpoint_id, environment_id, api_key_prefix) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        endpoint_id as _,
        environment_id as _,
        key_prefix,
    )
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The call is alive: stamps it. `false` if the listener is no longer
/// live (removed, or its endpoint deleted by the tenant): the call ends.
pub async fn stamp(db: &PgPool, endpoint_id: EndpointId) -> AppResult<bool> {
    let done = sqlx::query!(
        "UPDATE listeners l SET seen_at = now()
         WHERE l.endpoint_id = $1 AND l.removed_at IS NULL AND l.ended_at IS NULL
           AND EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = l.endpoint_id AND e.deleted_at IS NULL)",
        endpoint_id as _,
    )
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The call ended: its grace period starts.
pub async fn end(db: &PgPool, endpoint_id: EndpointId) -> AppResult<()> {
    sqlx::query!("UPDATE listeners SET ended_at = now() WHERE endpoint_id = $1 AND ended_at IS NULL", endpoint_id as _).execute(db).await?;
    Ok(())
}

/// Listeners whose call ended more than `grace_secs` ago, or whose api
/// stopped stamping them `stale_secs` ago (it died), at most `limit`.
pub async fn gone(db: &PgPool, grace_secs: f64, stale_secs: f64, limit: i64) -> AppResult<Vec<(EndpointId, EnvironmentId)>> {
    let rows = sqlx::query!(
        r#"SELECT endpoint_id AS "endpoint_id: EndpointId", environment_id AS "environment_id: EnvironmentId" FROM listeners
           WHERE removed_at IS NULL
             AND (ended_at < now() - make_interval(secs => $1) OR seen_at < now() - make_interval(secs => $2 + $1))
           ORDER BY endpoint_id LIMIT $3"#,
        grace_secs,
        stale_secs,
        limit,
    )
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|r| (r.endpoint_id, r.environment_id)).collect())
}

pub async fn mark_removed(db: &PgPool, endpoint_id: EndpointId) -> AppResult<()> {
    sqlx::query!("UPDATE listeners SET removed_at = now() WHERE endpoint_id = $1", endpoint_id as _).execute(db).await?;
    Ok(())
}
