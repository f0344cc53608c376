//! `webhook_endpoints`. Reads never select a ciphertext; only material and
//! the rewrap read secrets.

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::models::Endpoint;
use crate::error::AppResult;

/// The environment's endpoint quota, its row locked: concurrent creates
/// serialise on it, so two racing requests cannot both take the last slot.
pub async fn lock_quota(tx: &mut PgConnection, environment_id: Uuid) -> AppResult<Option<i32>> {
    Ok(sqlx::query_scalar!("SELECT endpoint_quota FROM environments WHERE id = $1 FOR UPDATE", environment_id)
        .fetch_optional(&mut *tx)
        .await?)
}

pub async fn count_live(tx: &mut PgConnection, environment_id: Uuid) -> AppResult<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM webhook_endpoints WHERE environment_id = $1 AND deleted_at IS NULL"#,
        environment_id
    )
    .fetch_one(&mut *tx)
    .await?)
}

pub async fn insert(
    tx: &mut PgConnection,
    environment_id: Uuid,
    url: &str,
    event_types: &[String],
    secret_key_id: &str,
    secret_ciphertext: &[u8],
) -> AppResult<Endpoint> {
    Ok(sqlx::query_as!(
        Endpoint,
        "INSERT INTO webhook_endpoints (id, environment_id, url, event_types, secret_key_id, secret_ciphertext)
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id, url, event_types, enabled, created_at, secret_rotated_at",
        Uuid::now_v7(),
        environment_id,
        url,
        event_types,
        secret_key_id,
        secret_ciphertext,
    )
    .fetch_one(&mut *tx)
    .await?)
}

pub async fn list(db: &PgPool, environment_id: Uuid) -> AppResult<Vec<Endpoint>> {
    Ok(sqlx::query_as!(
        Endpoint,
        "SELECT id, url, event_types, enabled, created_at, secret_rotated_at FROM webhook_endpoints
         WHERE environment_id = $1 AND deleted_at IS NULL ORDER BY created_at, id",
        environment_id,
    )
    .fetch_all(db)
    .await?)
}

pub async fn get(db: &PgPool, environment_id: Uuid, id: Uuid) -> AppResult<Option<Endpoint>> {
    Ok(sqlx::query_as!(
        Endpoint,
        "SELECT id, url, event_types, enabled, created_at, secret_rotated_at
         FROM webhook_endpoints WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL",
        id,
        environment_id,
    )
    .fetch_optional(db)
    .await?)
}

/// The new secret becomes current; the current one becomes the previous one.
pub async fn rotate_secret(db: &PgPool, environment_id: Uuid, id: Uuid, key_id: &str, ciphertext: &[u8]) -> AppResult<Option<Endpoint>> {
    Ok(sqlx::query_as!(
        Endpoint,
        "UPDATE webhook_endpoints SET
           previous_secret_key_id = secret_key_id,
           previous_secret_ciphertext = secret_ciphertext,
           secret_key_id = $3, secret_ciphertext = $4, secret_rotated_at = now()
         WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL
         RETURNING id, url, event_types, enabled, created_at, secret_rotated_at",
        id,
        environment_id,
        key_id,
        ciphertext,
    )
    .fetch_optional(db)
    .await?)
}

pub async fn set_enabled(tx: &mut PgConnection, environment_id: Uuid, id: Uuid, enabled: bool) -> AppResult<Option<Endpoint>> {
    Ok(sqlx::query_as!(
        Endpoint,
        "UPDATE webhook_endpoints SET enabled = $3
         WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL
         RETURNING id, url, event_types, enabled, created_at, secret_rotated_at",
        id,
        environment_id,
        enabled,
    )
    .fetch_optional(&mut *tx)
    .await?)
}

/// Soft: the row stays so its dead letters can. False when there was no
/// such live endpoint.
pub async fn soft_delete(tx: &mut PgConnection, environment_id: Uuid, id: Uuid) -> AppResult<bool> {
    Ok(sqlx::query!(
        "UPDATE webhook_endpoints SET deleted_at = now() WHERE id = $1 AND environment_id = $2 AND deleted_at IS NULL",
        id,
        environment_id
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1)
}

/// An endpoint's stored secrets, for re-encryption under another key.
pub struct StoredSecrets {
    pub id: Uuid,
    pub secret_key_id: String,
    pub secret_ciphertext: Vec<u8>,
    pub previous_secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
}

/// Up to 100 endpoints with a secret not under `active_key_id`, locked.
pub async fn lock_not_under_key(tx: &mut PgConnection, active_key_id: &str) -> AppResult<Vec<StoredSecrets>> {
    Ok(sqlx::query_as!(
        StoredSecrets,
        "SELECT id, secret_key_id, secret_ciphertext, previous_secret_key_id, previous_secret_ciphertext
         FROM webhook_endpoints
         WHERE secret_key_id <> $1 OR (previous_secret_key_id IS NOT NULL AND previous_secret_key_id <> $1)
         ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
        active_key_id,
    )
    .fetch_all(&mut *tx)
    .await?)
}

pub async fn store_secrets(tx: &mut PgConnection, id: Uuid, current: (&str, &[u8]), previous: Option<(&str, &[u8])>) -> AppResult<()> {
    sqlx::query!(
        "UPDATE webhook_endpoints SET secret_key_id = $2, secret_ciphertext = $3,
           previous_secret_key_id = $4, previous_secret_ciphertext = $5 WHERE id = $1",
        id,
        current.0,
        current.1,
        previous.map(|p| p.0),
        previous.map(|p| p.1),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}
