//! Listeners (`relay-dev listen`): a temporary endpoint of the caller's
//! environment whose attempts travel over the caller's open call instead of
//! HTTP (`grpc::listen` holds the call; the dispatcher hands each attempt to
//! it over core NATS). The endpoint is an ordinary endpoint otherwise
//! (retries, dead letters, the attempt log, the portal), except that it
//! counts against no quota: one live listener per API key instead.
//!
//! Lifecycle: opened by the call; stamped by the api holding the call every
//! [`STAMP_EVERY`]; when the call ends, or its api stops stamping for
//! [`STALE`], the upkeep deletes the endpoint once the grace period has
//! passed, its pending deliveries ending as dead letters `listener_gone`.

use std::time::Duration;

use anyhow::Context;
use relay_domain::{EndpointId, Reason, delivery::DeadLetterReason};
use relay_signing::{Scheme, SigningSecret};

use super::{App, Tenant, endpoints::Endpoint};
use crate::{
    db::{self, endpoints::NewEndpointRow, endpoints::NewSigningMaterial},
    error::{AppError, AppResult},
};

/// How often the api holding a call says it is alive.
pub const STAMP_EVERY: Duration = Duration::from_secs(5);
/// A listener not stamped for this long has lost its api.
pub const STALE: Duration = Duration::from_secs(15);
/// What a listener's endpoint's URL says (it is never connected to).
pub const LISTEN_URL: &str = "listen://relay-dev";

impl App {
    /// Opens a listener for the key with this lookup prefix: a new endpoint
    /// subscribed to `event_types`, and its signing secret. A key whose
    /// listener is alive is refused; one whose listener's call ended (or
    /// whose api died) has it removed first.
    pub async fn open_listener(&self, tenant: Tenant, key_prefix: &str, event_types: &[String]) -> AppResult<(Endpoint, SigningSecret)> {
        let event_types = super::endpoints::normalise_event_types(event_types)?;
        self.check_subscriptions(tenant.environment_id, &event_types).await?;
        if let Some((old, env, live)) = db::listeners::of_key(&self.db, key_prefix, STALE.as_secs_f64()).await? {
            if live {
                return Err(active());
            }
            self.remove_listener(Tenant { environment_id: env }, old).await?;
        }
        let scheme = Scheme::default();
        let minted = super::endpoints::Minted::for_scheme(scheme);
        let (key_id, ciphertext) = self.keyring.encrypt(&minted.stored);
        let mut tx = self.db.begin().await?;
        let row = NewEndpointRow {
            environment_id: tenant.environment_id,
            url: LISTEN_URL,
            event_types: &event_types,
            scheme,
            material: NewSigningMaterial { key_id: &key_id, ciphertext: &ciphertext, public_key: None },
            headers: None,
            max_in_flight: None,
            filter: None,
            rate_limit: None,
            client_tls: None,
            ca_bundle: None,
            oauth2: None,
            ordering: Default::default(),
        };
        let id = db::endpoints::insert(&mut tx, row).await?;
        db::health::insert(&mut tx, id).await?;
        if !db::listeners::insert(&mut tx, id, tenant.environment_id, key_prefix).await? {
            return Err(active());
        }
        let endpoint =
            db::endpoints::get(&mut tx, tenant.environment_id, id, self.clock.now()).await?.context("reading back a listener")?;
        tx.commit().await.context("committing a listener")?;
        Ok((endpoint, minted.stored))
    }

    /// The call is alive; `false` once the listener is no longer (its
    /// endpoint deleted): the call should end.
    pub async fn stamp_listener(&self, id: EndpointId) -> AppResult<bool> {
        db::listeners::stamp(&self.db, id).await
    }

    /// The call ended: the grace period starts.
    pub async fn end_listener(&self, id: EndpointId) -> AppResult<()> {
        db::listeners::end(&self.db, id).await
    }

    /// Removes the listeners whose call ended more than `grace` ago or
    /// whose api died; how many.
    pub async fn sweep_listeners(&self, grace: Duration) -> AppResult<usize> {
        let gone = db::listeners::gone(&self.db, grace.as_secs_f64(), STALE.as_secs_f64(), 100).await?;
        for &(id, environment_id) in &gone {
            self.remove_listener(Tenant { environment_id }, id).await?;
            tracing::info!(endpoint_id = %id, "a listener's call ended: its endpoint is deleted, its pending deliveries dead letters");
        }
        Ok(gone.len())
    }

    async fn remove_listener(&self, tenant: Tenant, id: EndpointId) -> AppResult<()> {
        match self.delete_endpoint_as(tenant, id, DeadLetterReason::ListenerGone).await {
            // Deleted already (by the tenant): only the listener row is left.
            Ok(()) => {}
            Err(e) if e.code == crate::error::ErrorCode::NotFound => {}
            Err(e) => return Err(e),
        }
        db::listeners::mark_removed(&self.db, id).await
    }
}

fn active() -> AppError {
    AppError::precondition(
        Reason::ListenerActive,
        "this API key already has a listener connected; stop it first (one listener per API key), or use another key",
    )
}
