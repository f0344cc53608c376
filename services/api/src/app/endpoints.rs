//! Webhook endpoints: registration rules, the quota, secrets and rotation.

use std::net::IpAddr;

use anyhow::Context;
use relay_netguard::Rejection;
use relay_signing::SigningSecret;
use url::Host;
use uuid::Uuid;

use super::{App, Tenant, require_nonempty};
pub use crate::db::models::{DisabledReason, Endpoint};
use crate::db::{self, deliveries::end_pending_of_endpoint};
use crate::{
    error::{AppError, AppResult},
    secrets::mint_signing_secret,
};

const MAX_EVENT_TYPES: usize = 100;
const MAX_EVENT_TYPE_LEN: usize = 128;
const MAX_URL_LEN: usize = 2048;

fn rejection(e: Rejection) -> AppError {
    AppError::invalid("endpoint_url_rejected", e.to_string())
}

/// Event types: at least one, each a short token, duplicates folded.
pub(crate) fn check_event_type(t: &str) -> AppResult<()> {
    if t.is_empty() || t.len() > MAX_EVENT_TYPE_LEN || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(AppError::invalid(
            "invalid_event_type",
            format!("event type {} must be 1 to {MAX_EVENT_TYPE_LEN} characters with no spaces", crate::error::quoted(t)),
        ));
    }
    Ok(())
}

fn normalise_event_types(types: &[String]) -> AppResult<Vec<String>> {
    if types.is_empty() {
        return Err(AppError::invalid("missing_event_types", "event_types must list at least one event type"));
    }
    if types.len() > MAX_EVENT_TYPES {
        return Err(AppError::invalid(
            "too_many_event_types",
            format!("event_types may list at most {MAX_EVENT_TYPES} types; this one lists {}", types.len()),
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(types.len());
    for t in types {
        let t = t.trim();
        check_event_type(t)?;
        if !out.iter().any(|o| o == t) {
            out.push(t.to_owned());
        }
    }
    Ok(out)
}

impl App {
    /// The URL rules, including the addresses a host name resolves to now.
    /// The dispatcher checks again at send time, since DNS can change.
    async fn check_endpoint_url(&self, raw: &str) -> AppResult<String> {
        if raw.len() > MAX_URL_LEN {
            return Err(AppError::invalid("endpoint_url_rejected", format!("url may be at most {MAX_URL_LEN} bytes, got {}", raw.len())));
        }
        let url = self.url_policy.check_url(raw).map_err(rejection)?;
        if let Some(Host::Domain(name)) = url.host() {
            let addrs: Vec<IpAddr> = self.resolver.lookup(name).await.unwrap_or_default();
            self.url_policy.check_addresses(name, &addrs).map_err(rejection)?;
        }
        Ok(url.to_string())
    }

    pub async fn create_endpoint(&self, tenant: Tenant, url: &str, event_types: &[String]) -> AppResult<(Endpoint, SigningSecret)> {
        require_nonempty("url", url)?;
        let url = self.check_endpoint_url(url).await?;
        let event_types = normalise_event_types(event_types)?;

        let mut tx = self.db.begin().await?;
        // Locking the environment row serialises concurrent creates, so two
        // racing requests cannot both take the last slot.
        let quota = db::endpoints::lock_quota(&mut tx, tenant.environment_id).await?.ok_or_else(|| AppError::not_found("environment"))?;
        let live = db::endpoints::count_live(&mut tx, tenant.environment_id).await?;
        if live >= i64::from(quota) {
            return Err(AppError::precondition(
                "endpoint_quota_exceeded",
                format!("an environment may have at most {quota} webhook endpoints; this one already has {live}"),
            ));
        }
        let secret = mint_signing_secret();
        let (key_id, ciphertext) = self.keyring.encrypt(&secret);
        let id = db::endpoints::insert(&mut tx, tenant.environment_id, &url, &event_types, &key_id, &ciphertext).await?;
        db::health::insert(&mut tx, id).await?;
        let endpoint = db::endpoints::get(&mut tx, tenant.environment_id, id).await?.context("reading back a new endpoint")?;
        tx.commit().await.context("committing a new endpoint")?;
        Ok((endpoint, secret))
    }

    pub async fn list_endpoints(&self, tenant: Tenant) -> AppResult<Vec<Endpoint>> {
        db::endpoints::list(&self.db, tenant.environment_id).await
    }

    pub async fn get_endpoint(&self, tenant: Tenant, id: Uuid) -> AppResult<Endpoint> {
        let mut conn = self.db.acquire().await?;
        db::endpoints::get(&mut conn, tenant.environment_id, id).await?.ok_or_else(|| AppError::not_found("webhook endpoint"))
    }

    /// Mints a new secret; the current one becomes the previous one and keeps
    /// signing for the 24 h window.
    pub async fn rotate_endpoint_secret(&self, tenant: Tenant, id: Uuid) -> AppResult<(Endpoint, SigningSecret)> {
        let secret = mint_signing_secret();
        let (key_id, ciphertext) = self.keyring.encrypt(&secret);
        let mut tx = self.db.begin().await?;
        if !db::endpoints::rotate_secret(&mut tx, tenant.environment_id, id, &key_id, &ciphertext).await? {
            return Err(AppError::not_found("webhook endpoint"));
        }
        let endpoint = db::endpoints::get(&mut tx, tenant.environment_id, id).await?.context("reading back a rotated endpoint")?;
        tx.commit().await.context("committing a secret rotation")?;
        Ok((endpoint, secret))
    }

    /// Disabling ends every pending or held delivery of the endpoint as a
    /// dead letter with reason `endpoint_disabled`: nothing already scheduled
    /// is sent, nothing waits forever, and the tenant can replay after
    /// re-enabling. Enabling releases what the endpoint held while Relay had
    /// disabled it (throttled, oldest first) and starts its health afresh.
    pub async fn set_endpoint_enabled(&self, tenant: Tenant, id: Uuid, enabled: bool) -> AppResult<Endpoint> {
        // The endpoint is locked first here and last by an outcome batch that
        // disables it automatically (deliveries → health → endpoint), so the
        // two can close a circle; Postgres then ends one of them, and this
        // one runs again.
        retry_lost_conflicts(|| self.set_endpoint_enabled_once(tenant, id, enabled)).await
    }

    async fn set_endpoint_enabled_once(&self, tenant: Tenant, id: Uuid, enabled: bool) -> AppResult<Endpoint> {
        let mut tx = self.db.begin().await?;
        let reason = (!enabled).then_some(DisabledReason::Manual);
        db::endpoints::set_disabled(&mut tx, tenant.environment_id, id, reason)
            .await?
            .ok_or_else(|| AppError::not_found("webhook endpoint"))?;
        // The endpoint's lock first (expansions share-lock it, so none is
        // half-way through with the old state), then the deliveries, then the
        // health row: an outcome batch locks deliveries before health, so
        // taking health last cannot close a circle with it.
        if enabled {
            if db::health::release_held(&mut tx, &[id], self.health.release_per_second).await? > 0 {
                db::deliveries::notify_due(&mut tx).await?;
            }
        } else {
            end_pending_of_endpoint(&mut tx, id, db::dead_letters::ENDPOINT_DISABLED).await?;
        }
        db::health::reset(&mut tx, id).await?;
        let endpoint = db::endpoints::get(&mut tx, tenant.environment_id, id).await?.context("reading back an endpoint")?;
        tx.commit().await.context("committing an endpoint state change")?;
        Ok(endpoint)
    }

    /// Soft: the row stays so its dead letters can. Pending deliveries end
    /// as dead letters with reason `endpoint_deleted`.
    pub async fn delete_endpoint(&self, tenant: Tenant, id: Uuid) -> AppResult<()> {
        retry_lost_conflicts(|| self.delete_endpoint_once(tenant, id)).await
    }

    async fn delete_endpoint_once(&self, tenant: Tenant, id: Uuid) -> AppResult<()> {
        let mut tx = self.db.begin().await?;
        if !db::endpoints::soft_delete(&mut tx, tenant.environment_id, id).await? {
            return Err(AppError::not_found("webhook endpoint"));
        }
        end_pending_of_endpoint(&mut tx, id, db::dead_letters::ENDPOINT_DELETED).await?;
        db::environments::forget_operations_endpoint(&mut tx, id).await?;
        tx.commit().await.context("committing an endpoint deletion")?;
        Ok(())
    }
}

/// Runs a transaction again, up to three times in all, while it loses a
/// conflict (a deadlock Postgres broke by ending it); a last loss is
/// answered 503, retry.
async fn retry_lost_conflicts<T, F, Fut>(mut run: F) -> AppResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = AppResult<T>>,
{
    let mut tries = 1;
    loop {
        match run().await {
            Err(e) if e.lost_a_conflict() && tries < 3 => {
                tracing::info!(error = format!("{:#}", e), tries, "a concurrent change won; running the transaction again");
                tries += 1;
            }
            other => return other,
        }
    }
}
