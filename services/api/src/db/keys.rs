//! `api_keys`: salted hashes, found by their lookup prefix.

use relay_domain::{ApiKeyId, EnvironmentId};
use sqlx::PgPool;

use super::models::{ApiKey, Timestamp};
use crate::error::AppResult;

/// A new key for an environment; `None` when the environment does not exist.
pub async fn insert(
    db: &PgPool,
    environment_id: EnvironmentId,
    name: &str,
    lookup_prefix: &str,
    salt: &[u8],
    key_hash: &[u8],
) -> AppResult<Option<ApiKey>> {
    Ok(sqlx::query_as!(
        ApiKey,
        "INSERT INTO api_keys (id, environment_id, name, lookup_prefix, salt, key_hash)
         SELECT $1, e.id, $3, $4, $5, $6 FROM environments e WHERE e.id = $2
         RETURNING id, environment_id, name, lookup_prefix, created_at, revoked_at",
        ApiKeyId::mint() as _,
        environment_id as _,
        name,
        lookup_prefix,
        salt,
        key_hash,
    )
    .fetch_optional(db)
    .await?)
}

/// Revoked from now on, or since it was first revoked.
pub async fn revoke(db: &PgPool, id: ApiKeyId) -> AppResult<Option<ApiKey>> {
    Ok(sqlx::query_as!(
        ApiKey,
        "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1
         RETURNING id, environment_id, name, lookup_prefix, created_at, revoked_at",
        id as _,
    )
    .fetch_optional(db)
    .await?)
}

/// The Postgres channel that names revoked keys (by lookup prefix) to
/// every api process, so none keeps a cached verification of one.
pub const REVOKED_CHANNEL: &str = "relay_api_keys_revoked";

pub async fn announce_revoked(db: &PgPool, lookup_prefix: &str) -> AppResult<()> {
    sqlx::query_scalar!(r#"SELECT 1 AS "notified!" FROM pg_notify($1, $2)"#, REVOKED_CHANNEL, lookup_prefix).fetch_one(db).await?;
    Ok(())
}

/// What a presented key is checked against.
pub struct StoredKey {
    pub environment_id: EnvironmentId,
    pub salt: Vec<u8>,
    pub key_hash: Vec<u8>,
    pub revoked_at: Option<Timestamp>,
}

pub async fn find_by_prefix(db: &PgPool, lookup_prefix: &str) -> AppResult<Option<StoredKey>> {
    Ok(sqlx::query_as!(
        StoredKey,
        "SELECT environment_id, salt, key_hash, revoked_at FROM api_keys WHERE lookup_prefix = $1",
        lookup_prefix
    )
    .fetch_optional(db)
    .await?)
}
