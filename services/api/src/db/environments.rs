//! `environments`: the tenants, each with its endpoint quota.

use relay_domain::{EndpointId, EnvironmentId};
use sqlx::PgPool;

use super::models::Environment;
use crate::error::AppResult;

pub async fn insert(db: &PgPool, name: &str, endpoint_quota: i32) -> AppResult<Environment> {
    Ok(sqlx::query_as!(
        Environment,
        "INSERT INTO environments (id, name, endpoint_quota) VALUES ($1, $2, $3)
         RETURNING id, name, endpoint_quota, created_at, disable_after_secs, disable_min_failures, max_held_secs",
        EnvironmentId::mint() as _,
        name,
        endpoint_quota,
    )
    .fetch_one(db)
    .await?)
}

pub async fn set_quota(db: &PgPool, id: EnvironmentId, endpoint_quota: i32) -> AppResult<Option<Environment>> {
    Ok(sqlx::query_as!(
        Environment,
        "UPDATE environments SET endpoint_quota = $2 WHERE id = $1
         RETURNING id, name, endpoint_quota, created_at, disable_after_secs, disable_min_failures, max_held_secs",
        id as _,
        endpoint_quota,
    )
    .fetch_optional(db)
    .await?)
}

pub async fn exists(db: &PgPool, id: EnvironmentId) -> AppResult<bool> {
    Ok(sqlx::query_scalar!(r#"SELECT EXISTS (SELECT 1 FROM environments WHERE id = $1) AS "exists!""#, id as _).fetch_one(db).await?)
}

pub async fn set_disable_policy(
    db: &PgPool,
    id: EnvironmentId,
    after_secs: i32,
    min_failures: i32,
    max_held_secs: i32,
) -> AppResult<Option<Environment>> {
    Ok(sqlx::query_as!(
        Environment,
        "UPDATE environments SET disable_after_secs = $2, disable_min_failures = $3, max_held_secs = $4 WHERE id = $1
         RETURNING id, name, endpoint_quota, created_at, disable_after_secs, disable_min_failures, max_held_secs",
        id as _,
        after_secs,
        min_failures,
        max_held_secs,
    )
    .fetch_optional(db)
    .await?)
}

/// Names (or clears) the environment's operations endpoint; `None` when
/// there is no such environment, else what it is now.
pub async fn set_operations_endpoint(
    db: &PgPool,
    id: EnvironmentId,
    endpoint_id: Option<EndpointId>,
) -> AppResult<Option<Option<EndpointId>>> {
    Ok(sqlx::query_scalar!(
        "UPDATE environments SET operations_endpoint_id = $2 WHERE id = $1 RETURNING operations_endpoint_id",
        id as _,
        endpoint_id as _,
    )
    .fetch_optional(db)
    .await?
    .map(|e| e.map(EndpointId::from)))
}

pub async fn operations_endpoint(db: &PgPool, id: EnvironmentId) -> AppResult<Option<Option<EndpointId>>> {
    Ok(sqlx::query_scalar!("SELECT operations_endpoint_id FROM environments WHERE id = $1", id as _)
        .fetch_optional(db)
        .await?
        .map(|e| e.map(EndpointId::from)))
}

/// An endpoint being deleted stops being any environment's operations endpoint.
pub async fn forget_operations_endpoint(tx: &mut sqlx::PgConnection, endpoint_id: EndpointId) -> AppResult<()> {
    sqlx::query!("UPDATE environments SET operations_endpoint_id = NULL WHERE operations_endpoint_id = $1", endpoint_id as _)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Sets (or, with `None`, removes) the environment's publish limit, its
/// gate starting afresh; `false` if there is no such environment.
pub async fn set_publish_limit(db: &PgPool, id: EnvironmentId, limit: Option<(i32, i32)>) -> AppResult<bool> {
    let done = sqlx::query!(
        "UPDATE environments SET publish_per_second = $2, publish_burst = $3, publish_tat = NULL WHERE id = $1",
        id as _,
        limit.map(|l| l.0),
        limit.map(|l| l.1),
    )
    .execute(db)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Takes one publish from the environment's gate (GCRA, see
/// `relay_domain::rate`): `Ok` if it passes (or the environment has no
/// limit), else how long until one would. One statement, under the
/// environment row's lock, so every api shares the gate.
pub async fn take_publish(db: &PgPool, id: EnvironmentId) -> AppResult<Result<(), std::time::Duration>> {
    let row = sqlx::query!(
        r#"WITH gate AS (
             SELECT id, publish_per_second IS NULL AS unlimited,
                    make_interval(secs => 1.0 / publish_per_second) AS step,
                    make_interval(secs => (publish_burst - 1)::float8 / publish_per_second) AS slack
             FROM environments WHERE id = $1),
           taken AS (
             UPDATE environments e SET publish_tat = greatest(coalesce(e.publish_tat, now()), now()) + g.step
             FROM gate g
             WHERE e.id = g.id AND NOT g.unlimited AND greatest(coalesce(e.publish_tat, now()), now()) <= now() + g.slack
             RETURNING 1)
         SELECT (SELECT unlimited FROM gate) AS unlimited,
                EXISTS (SELECT 1 FROM taken) AS "taken!",
                (SELECT extract(epoch FROM e.publish_tat - g.slack - now())::float8 FROM environments e, gate g WHERE e.id = g.id) AS wait_secs"#,
        id as _,
    )
    .fetch_one(db)
    .await?;
    if row.taken || row.unlimited.unwrap_or(true) {
        return Ok(Ok(()));
    }
    let wait = row.wait_secs.unwrap_or(0.0).clamp(0.001, 3600.0);
    Ok(Err(std::time::Duration::from_secs_f64(wait)))
}
