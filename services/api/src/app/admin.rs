//! Operator use-cases: environments, API keys, quotas, queue depths.

use anyhow::Context;
use uuid::Uuid;

use super::{App, Timestamp};
use crate::{
    apikeys::{self, ApiKeySecret},
    config::DEFAULT_ENDPOINT_QUOTA,
    error::{AppError, AppResult},
};

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Environment {
    pub id: Uuid,
    pub name: String,
    pub endpoint_quota: i32,
    pub created_at: Timestamp,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ApiKey {
    pub id: Uuid,
    pub environment_id: Uuid,
    pub name: String,
    pub lookup_prefix: String,
    pub created_at: Timestamp,
    pub revoked_at: Option<Timestamp>,
}

#[derive(Debug, Clone, Default)]
pub struct QueueDepths {
    pub outbox_unpublished: i64,
    pub deliveries_pending: i64,
    pub deliveries_due: i64,
    /// Handed to the broker, lease not expired, outcome not yet reported.
    pub deliveries_in_flight: i64,
    pub dead_letters: i64,
}

const MAX_QUOTA: u32 = 10_000;
/// The longest name an environment or API key may have.
const MAX_NAME_CHARS: usize = 200;

/// A name an operator gives: trimmed, 1 to 200 characters, no control
/// characters (a NUL cannot be stored, a newline forges log lines).
fn check_name(field: &'static str, name: &str) -> AppResult<String> {
    let name = name.trim();
    let chars = name.chars().count();
    if chars == 0 {
        return Err(AppError::invalid("missing_field", format!("{field} is required")));
    }
    if chars > MAX_NAME_CHARS {
        return Err(AppError::invalid(
            "name_too_long",
            format!("{field} may be at most {MAX_NAME_CHARS} characters; this one has {chars}"),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(AppError::invalid("invalid_name", format!("{field} may not contain control characters (found U+{:04X})", c as u32)));
    }
    Ok(name.to_owned())
}

fn check_quota(quota: u32) -> AppResult<i32> {
    if quota > MAX_QUOTA {
        return Err(AppError::invalid("quota_out_of_range", format!("endpoint_quota may be at most {MAX_QUOTA}, got {quota}")));
    }
    Ok(quota as i32)
}

impl App {
    pub async fn create_environment(&self, name: &str, endpoint_quota: u32) -> AppResult<Environment> {
        let name = check_name("name", name)?;
        let quota = if endpoint_quota == 0 { DEFAULT_ENDPOINT_QUOTA } else { check_quota(endpoint_quota)? };
        let env = sqlx::query_as::<_, Environment>(
            "INSERT INTO environments (id, name, endpoint_quota) VALUES ($1, $2, $3)
             RETURNING id, name, endpoint_quota, created_at",
        )
        .bind(Uuid::now_v7())
        .bind(&name)
        .bind(quota)
        .fetch_one(&self.db)
        .await?;
        Ok(env)
    }

    pub async fn set_endpoint_quota(&self, environment_id: Uuid, quota: u32) -> AppResult<Environment> {
        let quota = check_quota(quota)?;
        sqlx::query_as::<_, Environment>(
            "UPDATE environments SET endpoint_quota = $2 WHERE id = $1
             RETURNING id, name, endpoint_quota, created_at",
        )
        .bind(environment_id)
        .bind(quota)
        .fetch_optional(&self.db)
        .await?
        .ok_or_else(|| AppError::not_found("environment"))
    }

    pub async fn create_api_key(&self, environment_id: Uuid, name: &str) -> AppResult<(ApiKey, ApiKeySecret)> {
        let name = check_name("name", name)?;
        let minted = apikeys::mint();
        let key = sqlx::query_as::<_, ApiKey>(
            "INSERT INTO api_keys (id, environment_id, name, lookup_prefix, salt, key_hash)
             SELECT $1, e.id, $3, $4, $5, $6 FROM environments e WHERE e.id = $2
             RETURNING id, environment_id, name, lookup_prefix, created_at, revoked_at",
        )
        .bind(Uuid::now_v7())
        .bind(environment_id)
        .bind(&name)
        .bind(&minted.lookup_prefix)
        .bind(&minted.salt)
        .bind(&minted.hash)
        .fetch_optional(&self.db)
        .await?
        .ok_or_else(|| AppError::not_found("environment"))?;
        Ok((key, minted.secret))
    }

    pub async fn revoke_api_key(&self, id: Uuid) -> AppResult<ApiKey> {
        sqlx::query_as::<_, ApiKey>(
            "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1
             RETURNING id, environment_id, name, lookup_prefix, created_at, revoked_at",
        )
        .bind(id)
        .fetch_optional(&self.db)
        .await?
        .ok_or_else(|| AppError::not_found("API key"))
    }

    /// The environment an API key belongs to, if the key is live and matches.
    pub async fn authenticate_api_key(&self, presented: &str) -> AppResult<Option<Uuid>> {
        let Some(prefix) = apikeys::lookup_prefix(presented) else { return Ok(None) };
        #[derive(sqlx::FromRow)]
        struct Stored {
            environment_id: Uuid,
            salt: Vec<u8>,
            key_hash: Vec<u8>,
            revoked_at: Option<Timestamp>,
        }
        let row: Option<Stored> =
            sqlx::query_as("SELECT environment_id, salt, key_hash, revoked_at FROM api_keys WHERE lookup_prefix = $1")
                .bind(prefix)
                .fetch_optional(&self.db)
                .await?;
        Ok(row.and_then(|k| (k.revoked_at.is_none() && apikeys::matches(presented, &k.salt, &k.key_hash)).then_some(k.environment_id)))
    }

    pub async fn queue_depths(&self) -> AppResult<QueueDepths> {
        let (outbox, pending, due, in_flight, dead): (i64, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT
               (SELECT count(*) FROM events WHERE published_at IS NULL),
               (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'),
               (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_at <= now()),
               (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > now()),
               (SELECT count(*) FROM webhook_dead_letters)",
        )
        .fetch_one(&self.db)
        .await
        .context("reading queue depths")?;
        Ok(QueueDepths {
            outbox_unpublished: outbox,
            deliveries_pending: pending,
            deliveries_due: due,
            deliveries_in_flight: in_flight,
            dead_letters: dead,
        })
    }

    /// Attempts handed out and not yet reported, per endpoint (the small
    /// partial index of leased rows).
    pub async fn in_flight_by_endpoint(&self) -> AppResult<Vec<(Uuid, i64)>> {
        Ok(sqlx::query_as(
            "SELECT endpoint_id, count(*) FROM webhook_deliveries
             WHERE state = 'pending' AND dispatched_at IS NOT NULL GROUP BY endpoint_id",
        )
        .fetch_all(&self.db)
        .await
        .context("reading in-flight attempts")?)
    }
}

impl App {
    /// Fails with NOT_FOUND unless the environment exists; operator calls
    /// that act within one environment start here.
    pub async fn environment_scope(&self, environment_id: Uuid) -> AppResult<super::Tenant> {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM environments WHERE id = $1)").bind(environment_id).fetch_one(&self.db).await?;
        if !exists {
            return Err(AppError::not_found("environment"));
        }
        Ok(super::Tenant { environment_id })
    }

    /// Re-encrypts every current and previous signing secret that is not under
    /// the active key. Each endpoint is rewritten in its own short transaction.
    pub async fn rewrap_secrets(&self) -> AppResult<u32> {
        #[derive(sqlx::FromRow)]
        struct Stored {
            id: Uuid,
            secret_key_id: String,
            secret_ciphertext: Vec<u8>,
            previous_secret_key_id: Option<String>,
            previous_secret_ciphertext: Option<Vec<u8>>,
        }
        let active = self.keyring.active_key_id().to_owned();
        let mut rewrapped = 0u32;
        loop {
            let mut tx = self.db.begin().await?;
            let batch: Vec<Stored> = sqlx::query_as(
                "SELECT id, secret_key_id, secret_ciphertext, previous_secret_key_id, previous_secret_ciphertext
                 FROM webhook_endpoints
                 WHERE secret_key_id <> $1 OR (previous_secret_key_id IS NOT NULL AND previous_secret_key_id <> $1)
                 ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
            )
            .bind(&active)
            .fetch_all(&mut *tx)
            .await?;
            if batch.is_empty() {
                return Ok(rewrapped);
            }
            for row in batch {
                let current = self.keyring.decrypt(&row.secret_key_id, &row.secret_ciphertext).context("decrypting a stored secret")?;
                let (key_id, ciphertext) = self.keyring.encrypt(&current);
                let previous = match (row.previous_secret_key_id, row.previous_secret_ciphertext) {
                    (Some(k), Some(c)) => {
                        let plain = self.keyring.decrypt(&k, &c).context("decrypting a stored previous secret")?;
                        Some(self.keyring.encrypt(&plain))
                    }
                    _ => None,
                };
                sqlx::query(
                    "UPDATE webhook_endpoints SET secret_key_id = $2, secret_ciphertext = $3,
                       previous_secret_key_id = $4, previous_secret_ciphertext = $5 WHERE id = $1",
                )
                .bind(row.id)
                .bind(key_id)
                .bind(ciphertext)
                .bind(previous.as_ref().map(|p| p.0.clone()))
                .bind(previous.map(|p| p.1))
                .execute(&mut *tx)
                .await?;
                rewrapped += 1;
            }
            tx.commit().await.context("committing a rewrap batch")?;
        }
    }
}
