//! Operator use-cases: environments, API keys, quotas, queue depths.

use anyhow::Context;
use relay_domain::{ApiKeyId, EnvironmentId, Reason};

use super::App;
pub use crate::db::models::{ApiKey, Environment, QueueDepths};
use crate::{
    apikeys::{self, ApiKeySecret},
    db,
    error::{AppError, AppResult},
};

const MAX_QUOTA: u32 = 10_000;
/// The longest name an environment or API key may have.
const MAX_NAME_CHARS: usize = 200;

/// A name an operator gives: trimmed, 1 to 200 characters, no control
/// characters (a NUL cannot be stored, a newline forges log lines).
fn check_name(field: &'static str, name: &str) -> AppResult<String> {
    let name = name.trim();
    let chars = name.chars().count();
    if chars == 0 {
        return Err(AppError::invalid(Reason::MissingField, format!("{field} is required")));
    }
    if chars > MAX_NAME_CHARS {
        return Err(AppError::invalid(
            Reason::NameTooLong,
            format!("{field} may be at most {MAX_NAME_CHARS} characters; this one has {chars}"),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(AppError::invalid(
            Reason::InvalidName,
            format!("{field} may not contain control characters (found U+{:04X})", c as u32),
        ));
    }
    Ok(name.to_owned())
}

fn check_quota(quota: u32) -> AppResult<i32> {
    if quota > MAX_QUOTA {
        return Err(AppError::invalid(Reason::QuotaOutOfRange, format!("endpoint_quota may be at most {MAX_QUOTA}, got {quota}")));
    }
    Ok(quota as i32)
}

/// Endpoints an environment may register unless an operator says otherwise.
pub const DEFAULT_ENDPOINT_QUOTA: i32 = 5;

const MAX_DISABLE_WINDOW_SECS: u32 = 30 * 24 * 3600;
/// How long a delivery may be held by default: the dead-letter window (7 days).
const DEFAULT_MAX_HELD_SECS: u32 = 7 * 24 * 3600;
const MAX_DISABLE_MIN_FAILURES: u32 = 100_000;

impl App {
    pub async fn create_environment(&self, name: &str, endpoint_quota: u32) -> AppResult<Environment> {
        let name = check_name("name", name)?;
        let quota = if endpoint_quota == 0 { DEFAULT_ENDPOINT_QUOTA } else { check_quota(endpoint_quota)? };
        db::environments::insert(&self.db, &name, quota).await
    }

    pub async fn set_endpoint_quota(&self, environment_id: EnvironmentId, quota: u32) -> AppResult<Environment> {
        let quota = check_quota(quota)?;
        db::environments::set_quota(&self.db, environment_id, quota).await?.ok_or_else(|| AppError::not_found("environment"))
    }

    /// An environment's rule for disabling failing endpoints and how long a
    /// delivery may be held (0 for any: the platform default). Windows
    /// shorter than an hour are for tests and refused unless this is a
    /// development deployment.
    pub async fn set_disable_policy(
        &self,
        environment_id: EnvironmentId,
        after_secs: u32,
        min_failures: u32,
        max_held_secs: u32,
    ) -> AppResult<Environment> {
        let default = relay_domain::health::DisablePolicy::default();
        let after_secs = if after_secs == 0 { default.after.as_secs() as u32 } else { after_secs };
        let min_failures = if min_failures == 0 { default.min_failures } else { min_failures };
        let shortest = self.health.shortest_disable_window.as_secs().max(1) as u32;
        if !(shortest..=MAX_DISABLE_WINDOW_SECS).contains(&after_secs) {
            return Err(AppError::invalid(
                Reason::DisableWindowOutOfRange,
                format!("disable_after_secs must be between {shortest} and {MAX_DISABLE_WINDOW_SECS}, got {after_secs}"),
            ));
        }
        if !(1..=MAX_DISABLE_MIN_FAILURES).contains(&min_failures) {
            return Err(AppError::invalid(
                Reason::DisableMinFailuresOutOfRange,
                format!("disable_min_failures must be between 1 and {MAX_DISABLE_MIN_FAILURES}, got {min_failures}"),
            ));
        }
        let max_held_secs = if max_held_secs == 0 { DEFAULT_MAX_HELD_SECS } else { max_held_secs };
        if !(shortest..=MAX_DISABLE_WINDOW_SECS).contains(&max_held_secs) {
            return Err(AppError::invalid(
                Reason::MaxHeldOutOfRange,
                format!("max_held_secs must be between {shortest} and {MAX_DISABLE_WINDOW_SECS}, got {max_held_secs}"),
            ));
        }
        db::environments::set_disable_policy(&self.db, environment_id, after_secs as i32, min_failures as i32, max_held_secs as i32)
            .await?
            .ok_or_else(|| AppError::not_found("environment"))
    }

    /// Sets how fast an environment may publish (`per_second` 0: no limit);
    /// the limit and its burst as they now are. This api applies it at once,
    /// the others within `catalogue::FRESH`.
    pub async fn set_publish_limit(&self, environment_id: EnvironmentId, per_second: u32, burst: u32) -> AppResult<(u32, u32)> {
        let limit = if per_second == 0 {
            None
        } else {
            let l = relay_domain::rate::RateLimit::new(per_second, burst)
                .map_err(|m| AppError::invalid(Reason::PublishLimitOutOfRange, m.replace("rate_limit.", "")))?;
            Some((l.per_second() as i32, l.burst() as i32))
        };
        if !db::environments::set_publish_limit(&self.db, environment_id, limit).await? {
            return Err(AppError::not_found("environment"));
        }
        self.forget_environment(environment_id);
        Ok(limit.map_or((0, 0), |(r, b)| (r as u32, b as u32)))
    }

    pub async fn create_api_key(&self, environment_id: EnvironmentId, name: &str) -> AppResult<(ApiKey, ApiKeySecret)> {
        let name = check_name("name", name)?;
        let minted = apikeys::mint();
        let key = db::keys::insert(&self.db, environment_id, &name, &minted.lookup_prefix, &minted.salt, &minted.hash)
            .await?
            .ok_or_else(|| AppError::not_found("environment"))?;
        Ok((key, minted.secret))
    }

    /// Revoked at once on this api, and on the others as soon as they hear
    /// of it (a Postgres notification), at the latest once their cached
    /// verification expires (`apikeys::VERIFIED_FOR`).
    pub async fn revoke_api_key(&self, id: ApiKeyId) -> AppResult<ApiKey> {
        let key = db::keys::revoke(&self.db, id).await?.ok_or_else(|| AppError::not_found("API key"))?;
        self.verified_keys.forget(&key.lookup_prefix);
        if let Err(e) = db::keys::announce_revoked(&self.db, &key.lookup_prefix).await {
            tracing::warn!(error = ?e, "announcing a revoked key failed; other apis stop accepting it within their cache's lifetime");
        }
        Ok(key)
    }

    /// The environment an API key belongs to, if the key is live and matches.
    /// A key verified in the last moment is checked against what was read
    /// then (its salted hash), not read again.
    pub async fn authenticate_api_key(&self, presented: &str) -> AppResult<Option<EnvironmentId>> {
        let Some(prefix) = apikeys::lookup_prefix(presented) else { return Ok(None) };
        let stored = match self.verified_keys.get(prefix) {
            Some(live) => live,
            None => {
                let Some(row) = db::keys::find_by_prefix(&self.db, prefix).await? else { return Ok(None) };
                if row.revoked_at.is_some() {
                    return Ok(None);
                }
                let live = apikeys::LiveKey { environment_id: row.environment_id, salt: row.salt, key_hash: row.key_hash };
                self.verified_keys.put(prefix, live.clone());
                live
            }
        };
        Ok(apikeys::matches(presented, &stored.salt, &stored.key_hash).then_some(stored.environment_id))
    }

    pub async fn queue_depths(&self) -> AppResult<QueueDepths> {
        crate::db::depths::queue_depths(&self.db).await
    }
}

impl App {
    /// Fails with NOT_FOUND unless the environment exists; operator calls
    /// that act within one environment start here.
    pub async fn environment_scope(&self, environment_id: EnvironmentId) -> AppResult<super::Tenant> {
        let exists = db::environments::exists(&self.db, environment_id).await?;
        if !exists {
            return Err(AppError::not_found("environment"));
        }
        Ok(super::Tenant { environment_id })
    }

    /// Re-encrypts every current and previous signing secret that is not under
    /// the active key. Each endpoint is rewritten in its own short transaction.
    pub async fn rewrap_secrets(&self) -> AppResult<u32> {
        let active = self.keyring.active_key_id().to_owned();
        let mut rewrapped = 0u32;
        loop {
            let mut tx = self.db.begin().await?;
            let batch = db::endpoint_secrets::lock_not_under_key(&mut tx, &active).await?;
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
                let reseal = |sealed: (Option<String>, Option<Vec<u8>>), what: &'static str| -> AppResult<Option<(String, Vec<u8>)>> {
                    match sealed {
                        (Some(k), Some(c)) => Ok(Some(self.keyring.seal(&self.keyring.open(&k, &c).context(what)?))),
                        _ => Ok(None),
                    }
                };
                let headers = reseal((row.headers_key_id, row.headers_ciphertext), "decrypting stored custom headers")?;
                let client_tls = reseal((row.client_tls_key_id, row.client_tls_ciphertext), "decrypting a stored client key")?;
                let oauth2 = reseal((row.oauth2_key_id, row.oauth2_ciphertext), "decrypting stored OAuth2 credentials")?;
                db::endpoint_secrets::store_secrets(
                    &mut tx,
                    row.id,
                    (&key_id, &ciphertext),
                    previous.as_ref().map(|(k, c)| (k.as_str(), c.as_slice())),
                    headers.as_ref().map(|(k, c)| (k.as_str(), c.as_slice())),
                    client_tls.as_ref().map(|(k, c)| (k.as_str(), c.as_slice())),
                    oauth2.as_ref().map(|(k, c)| (k.as_str(), c.as_slice())),
                )
                .await?;
                rewrapped += 1;
            }
            tx.commit().await.context("committing a rewrap batch")?;
        }
    }
}
