//! `portal_links` and `portal_sessions`: the portal's one-time links and the
//! sessions they become. Tokens are looked up by their SHA-256.

use std::time::Duration;

use relay_domain::EnvironmentId;
use sqlx::PgPool;

use super::{interval, models::Timestamp};
use crate::error::AppResult;

/// Stores a link for `environment_id` valid for `ttl`; when it expires.
pub async fn create_link(db: &PgPool, token_hash: &[u8], environment_id: EnvironmentId, ttl: Duration) -> AppResult<Timestamp> {
    Ok(sqlx::query_scalar!(
        "INSERT INTO portal_links (token_hash, environment_id, expires_at) VALUES ($1, $2, now() + $3::interval) RETURNING expires_at",
        token_hash,
        environment_id as _,
        interval(ttl)?,
    )
    .fetch_one(db)
    .await?)
}

/// Uses a link (once, within its expiry) and starts a session for its
/// environment in the same statement; `None` for a link unknown, used or
/// expired — which are not told apart.
pub async fn exchange(
    db: &PgPool,
    link_hash: &[u8],
    session_hash: &[u8],
    csrf_token: &str,
    ttl: Duration,
) -> AppResult<Option<(EnvironmentId, Timestamp)>> {
    Ok(sqlx::query!(
        "WITH used AS (
           UPDATE portal_links SET used_at = now()
           WHERE token_hash = $1 AND used_at IS NULL AND expires_at > now()
           RETURNING environment_id)
         INSERT INTO portal_sessions (token_hash, environment_id, csrf_token, expires_at)
         SELECT $2, environment_id, $3, now() + $4::interval FROM used
         RETURNING environment_id, expires_at",
        link_hash,
        session_hash,
        csrf_token,
        interval(ttl)?,
    )
    .fetch_optional(db)
    .await?
    .map(|r| (r.environment_id.into(), r.expires_at)))
}

/// A live session: its environment and CSRF token.
pub async fn session(db: &PgPool, session_hash: &[u8]) -> AppResult<Option<(EnvironmentId, String)>> {
    Ok(sqlx::query!("SELECT environment_id, csrf_token FROM portal_sessions WHERE token_hash = $1 AND expires_at > now()", session_hash)
        .fetch_optional(db)
        .await?
        .map(|r| (r.environment_id.into(), r.csrf_token)))
}

/// Ends a session (signing out).
pub async fn end_session(db: &PgPool, session_hash: &[u8]) -> AppResult<()> {
    sqlx::query!("DELETE FROM portal_sessions WHERE token_hash = $1", session_hash).execute(db).await?;
    Ok(())
}

/// Deletes links and sessions that expired more than a day ago.
pub async fn prune(db: &PgPool) -> AppResult<u64> {
    let links = sqlx::query!("DELETE FROM portal_links WHERE expires_at < now() - interval '1 day'").execute(db).await?.rows_affected();
    let sessions =
        sqlx::query!("DELETE FROM portal_sessions WHERE expires_at < now() - interval '1 day'").execute(db).await?.rows_affected();
    Ok(links + sessions)
}
