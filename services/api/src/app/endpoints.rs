//! Webhook endpoints: registration rules, the quota, secrets and rotation,
//! and switching one off (disable, delete) so that nothing starts after the
//! tenant is answered.

use std::{
    collections::HashMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::Context;
use relay_contracts::relay::queue::v1::{DeliveryJob, SwitchedOff};
use relay_domain::{DispatcherId, EndpointId, Reason, delivery::DeadLetterReason};
use relay_netguard::Rejection;
use relay_signing::{Scheme, SigningSecret};
use url::Host;

pub use super::endpoint_requests::{EndpointChange, NewEndpoint};
use super::endpoint_requests::{
    ca_bundle_change, check_filter, check_max_in_flight, check_rate_limit, client_tls_change, filter_change, header_change, oauth2_change,
    parse_ordering, rate_limit_change,
};
use super::{App, Tenant, require_nonempty};
pub use crate::db::models::{DisabledReason, Endpoint};
use crate::db::{
    self,
    deliveries::{HeldClaim, end_pending_of_endpoint},
    endpoints::{EndpointUpdate, NewEndpointRow, NewSigningMaterial},
};
use crate::{
    error::{AppError, AppResult},
    secrets::{mint_ed25519_key_pair, mint_signing_secret},
};

const MAX_EVENT_TYPES: usize = 100;
const MAX_EVENT_TYPE_LEN: usize = 128;
const MAX_URL_LEN: usize = 2048;

fn rejection(e: Rejection) -> AppError {
    AppError::invalid(Reason::EndpointUrlRejected, e.to_string())
}

fn parse_scheme(name: &str) -> AppResult<Scheme> {
    Scheme::parse(name).ok_or_else(|| {
        AppError::invalid(
            Reason::InvalidSignatureScheme,
            format!("signature_scheme must be one of {}; got {}", Scheme::ALL.map(Scheme::as_str).join(", "), crate::error::quoted(name)),
        )
    })
}

/// Signing material minted for a scheme: what is stored (encrypted) and,
/// for a key pair, the public half.
pub(super) struct Minted {
    pub(super) stored: SigningSecret,
    pub(super) public_key: Option<String>,
}

impl Minted {
    pub(super) fn for_scheme(scheme: Scheme) -> Self {
        if scheme.is_asymmetric() {
            let (private, public) = mint_ed25519_key_pair();
            Self { stored: private, public_key: Some(public) }
        } else {
            Self { stored: mint_signing_secret(), public_key: None }
        }
    }

    /// What the customer is shown once: a shared secret; never a private key.
    fn shown(self) -> Option<SigningSecret> {
        self.public_key.is_none().then_some(self.stored)
    }
}

/// A live endpoint of the tenant's, its row locked, with its scheme.
async fn lock_signing(tx: &mut sqlx::PgConnection, tenant: Tenant, id: EndpointId) -> AppResult<(db::endpoints::LockedSigning, Scheme)> {
    let locked =
        db::endpoints::lock_signing(tx, tenant.environment_id, id).await?.ok_or_else(|| AppError::not_found("webhook endpoint"))?;
    let scheme = db::models::stored_scheme(id, &locked.signature_scheme)?;
    Ok((locked, scheme))
}

/// Event types: at least one, each a short token, duplicates folded.
pub(crate) fn check_event_type(t: &str) -> AppResult<()> {
    if t.is_empty() || t.len() > MAX_EVENT_TYPE_LEN || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(AppError::invalid(
            Reason::InvalidEventType,
            format!(
                "event type {} must be 1 to {MAX_EVENT_TYPE_LEN} characters with no spaces or control characters",
                crate::error::quoted(t)
            ),
        ));
    }
    Ok(())
}

pub(super) fn normalise_event_types(types: &[String]) -> AppResult<Vec<String>> {
    if types.is_empty() {
        return Err(AppError::invalid(Reason::MissingEventTypes, "event_types must list at least one event type"));
    }
    if types.len() > MAX_EVENT_TYPES {
        return Err(AppError::invalid(
            Reason::TooManyEventTypes,
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
    pub(super) async fn check_endpoint_url(&self, raw: &str) -> AppResult<String> {
        if raw.len() > MAX_URL_LEN {
            return Err(AppError::invalid(
                Reason::EndpointUrlRejected,
                format!("url may be at most {MAX_URL_LEN} bytes, got {}", raw.len()),
            ));
        }
        let url = self.url_policy.check_url(raw).map_err(rejection)?;
        if let Some(Host::Domain(name)) = url.host() {
            let addrs: Vec<IpAddr> = self.resolver.lookup(name).await.unwrap_or_default();
            self.url_policy.check_addresses(name, &addrs).map_err(rejection)?;
        }
        Ok(url.to_string())
    }

    /// Registers an endpoint; returns it and its secret (none under the
    /// ed25519 scheme: receivers verify with its public key).
    pub async fn create_endpoint(&self, tenant: Tenant, new: NewEndpoint) -> AppResult<(Endpoint, Option<SigningSecret>)> {
        require_nonempty("url", &new.url)?;
        let url = self.check_endpoint_url(&new.url).await?;
        let event_types = normalise_event_types(&new.event_types)?;
        self.check_subscriptions(tenant.environment_id, &event_types).await?;
        let scheme = if new.signature_scheme.is_empty() { Scheme::default() } else { parse_scheme(&new.signature_scheme)? };
        let headers = self.seal_headers(new.headers)?;
        let max_in_flight = new.max_in_flight.map(check_max_in_flight).transpose()?;
        let filter = if matches!(new.filter.trim(), "" | "null") { None } else { Some(check_filter(&new.filter)?) };
        let rate_limit = new.rate_limit.map(check_rate_limit).transpose()?;
        let ordering = if new.ordering.is_empty() { Default::default() } else { parse_ordering(&new.ordering)? };
        let client_tls = client_tls_change(false, new.client_certificate, new.client_key)?
            .flatten()
            .map(|pair| self.check_client_tls(pair).and_then(|identity| self.seal_client_tls(identity)))
            .transpose()?;
        let ca_bundle =
            ca_bundle_change(false, new.ca_bundle)?.flatten().map(|pem| super::client_tls::check_ca_bundle(&pem)).transpose()?;
        let oauth2 = match new.oauth2 {
            Some(c) => Some(self.seal_oauth2(c).await?),
            None => None,
        };

        let mut tx = self.db.begin().await?;
        // Locking the environment row serialises concurrent creates, so two
        // racing requests cannot both take the last slot.
        let quota = db::endpoints::lock_quota(&mut tx, tenant.environment_id).await?.ok_or_else(|| AppError::not_found("environment"))?;
        let live = db::endpoints::count_live(&mut tx, tenant.environment_id).await?;
        if live >= i64::from(quota) {
            return Err(AppError::precondition(
                Reason::EndpointQuotaExceeded,
                format!("an environment may have at most {quota} webhook endpoints; this one already has {live}"),
            ));
        }
        let minted = Minted::for_scheme(scheme);
        let (key_id, ciphertext) = self.keyring.encrypt(&minted.stored);
        let material = NewSigningMaterial { key_id: &key_id, ciphertext: &ciphertext, public_key: minted.public_key.as_deref() };
        let row = NewEndpointRow {
            environment_id: tenant.environment_id,
            url: &url,
            event_types: &event_types,
            scheme,
            material,
            headers: headers.as_ref(),
            max_in_flight,
            filter: filter.as_deref(),
            rate_limit,
            client_tls: client_tls.as_ref(),
            ca_bundle: ca_bundle.as_deref(),
            oauth2: oauth2.as_ref(),
            ordering,
        };
        let id = db::endpoints::insert(&mut tx, row).await?;
        db::health::insert(&mut tx, id).await?;
        let endpoint =
            db::endpoints::get(&mut tx, tenant.environment_id, id, self.clock.now()).await?.context("reading back a new endpoint")?;
        tx.commit().await.context("committing a new endpoint")?;
        Ok((endpoint, minted.shown()))
    }

    /// Changes an endpoint's url, event types or signature scheme (see the
    /// proto's UpdateWebhookEndpoint); returns it, and a secret when the
    /// change minted one.
    pub async fn update_endpoint(
        &self,
        tenant: Tenant,
        id: EndpointId,
        change: EndpointChange,
    ) -> AppResult<(Endpoint, Option<SigningSecret>)> {
        // Another tenant's endpoint answers 404 whatever the body says, as
        // one that never existed does; then everything is checked before the
        // row is locked (the URL check resolves the host).
        if db::endpoints::environment_of(&self.db, id).await? != Some(tenant.environment_id) {
            return Err(AppError::not_found("webhook endpoint"));
        }
        let url = match &change.url {
            // A listener's endpoint exists for its listener alone: given an
            // https URL it would send the tenant's events there until the
            // listener ends, then vanish with it.
            Some(_) if db::listeners::is_listener(&self.db, id).await? => {
                return Err(AppError::invalid(
                    Reason::ListenerUrlFixed,
                    "this endpoint belongs to a relay-dev listener and delivers only to it; register an endpoint of your own for another URL",
                ));
            }
            Some(url) => {
                require_nonempty("url", url)?;
                Some(self.check_endpoint_url(url).await?)
            }
            None => None,
        };
        let event_types = if change.event_types.is_empty() { None } else { Some(normalise_event_types(&change.event_types)?) };
        if let Some(types) = &event_types {
            self.check_subscriptions(tenant.environment_id, types).await?;
        }
        let scheme = change.signature_scheme.as_deref().map(parse_scheme).transpose()?;
        let ordering = change.ordering.as_deref().map(parse_ordering).transpose()?;
        let headers = header_change(change.clear_headers, change.headers)?.map(|pairs| self.seal_headers(pairs)).transpose()?;
        let max_in_flight = change.max_in_flight.map(|n| n.map(check_max_in_flight).transpose()).transpose()?;
        let filter = filter_change(change.clear_filter, change.filter)?.map(|f| f.as_deref().map(check_filter).transpose()).transpose()?;
        let rate_limit =
            rate_limit_change(change.clear_rate_limit, change.rate_limit)?.map(|r| r.map(check_rate_limit).transpose()).transpose()?;
        let client_tls = client_tls_change(change.clear_client_certificate, change.client_certificate, change.client_key)?
            .map(|pair| pair.map(|pair| self.check_client_tls(pair)).transpose())
            .transpose()?;
        let ca_bundle = ca_bundle_change(change.clear_ca_bundle, change.ca_bundle)?
            .map(|pem| pem.map(|pem| super::client_tls::check_ca_bundle(&pem)).transpose())
            .transpose()?;
        let oauth2 = match oauth2_change(change.clear_oauth2, change.oauth2)? {
            Some(Some(c)) => Some(Some(self.seal_oauth2(c).await?)),
            Some(None) => Some(None),
            None => None,
        };

        let mut tx = self.db.begin().await?;
        // Locked: an expansion share-locks the endpoint, so it reads the row
        // wholly before or wholly after this change.
        let (locked, current) = lock_signing(&mut tx, tenant, id).await?;
        // Material of the other kind when the change crosses between a shared
        // secret and a key pair; a symmetric-to-symmetric change keeps the
        // secret, which must then key the Standard Webhooks HMAC.
        let minted = match scheme {
            Some(new) if new.is_asymmetric() != current.is_asymmetric() => Some(Minted::for_scheme(new)),
            Some(Scheme::StandardWebhooks) if current != Scheme::StandardWebhooks => {
                let secret =
                    self.keyring.decrypt(&locked.secret_key_id, &locked.secret_ciphertext).context("decrypting a signing secret")?;
                if let Err(e) = relay_signing::standard::symmetric_key(&secret) {
                    return Err(AppError::precondition(
                        Reason::SecretNotStandardWebhooks,
                        format!(
                            "this endpoint's signing secret cannot key a Standard Webhooks signature ({e}): it was minted before \
                             Relay supported the scheme; rotate the secret (POST /v1/webhooks/{id}/rotate-secret), then switch"
                        ),
                    ));
                }
                None
            }
            _ => None,
        };
        let client_tls = self.client_tls_after(&locked, client_tls, change.end_client_certificate_overlap)?;
        let sealed = minted.as_ref().map(|m| self.keyring.encrypt(&m.stored));
        let material = sealed.as_ref().zip(minted.as_ref()).map(|((key_id, ciphertext), m)| NewSigningMaterial {
            key_id,
            ciphertext,
            public_key: m.public_key.as_deref(),
        });
        let update = EndpointUpdate {
            url: url.as_deref(),
            event_types: event_types.as_deref(),
            scheme,
            material,
            headers: headers.as_ref().map(Option::as_ref),
            max_in_flight,
            filter: filter.as_ref().map(Option::as_deref),
            rate_limit,
            client_tls: client_tls.as_ref().map(Option::as_ref),
            ca_bundle: ca_bundle.as_ref().map(Option::as_deref),
            oauth2: oauth2.as_ref().map(Option::as_ref),
            ordering,
        };
        db::endpoints::update(&mut tx, id, update).await?;
        let endpoint =
            db::endpoints::get(&mut tx, tenant.environment_id, id, self.clock.now()).await?.context("reading back an updated endpoint")?;
        tx.commit().await.context("committing an endpoint update")?;
        if scheme.is_some_and(|s| s != current) {
            tracing::info!(endpoint_id = %id, from = %current, to = %endpoint.signature_scheme, "signature scheme changed");
        }
        Ok((endpoint, minted.and_then(Minted::shown)))
    }

    pub async fn list_endpoints(&self, tenant: Tenant) -> AppResult<Vec<Endpoint>> {
        db::endpoints::list(&self.db, tenant.environment_id, self.clock.now()).await
    }

    pub async fn get_endpoint(&self, tenant: Tenant, id: EndpointId) -> AppResult<Endpoint> {
        let mut conn = self.db.acquire().await?;
        db::endpoints::get(&mut conn, tenant.environment_id, id, self.clock.now())
            .await?
            .ok_or_else(|| AppError::not_found("webhook endpoint"))
    }

    /// Mints new material of the endpoint's scheme (a secret, or a key
    /// pair); the current one becomes the previous one and keeps signing for
    /// the 24 h window. Returns the new secret; none for a key pair, whose
    /// public half is on the endpoint.
    pub async fn rotate_endpoint_secret(&self, tenant: Tenant, id: EndpointId) -> AppResult<(Endpoint, Option<SigningSecret>)> {
        let mut tx = self.db.begin().await?;
        let (_, scheme) = lock_signing(&mut tx, tenant, id).await?;
        let minted = Minted::for_scheme(scheme);
        let (key_id, ciphertext) = self.keyring.encrypt(&minted.stored);
        let material = NewSigningMaterial { key_id: &key_id, ciphertext: &ciphertext, public_key: minted.public_key.as_deref() };
        db::endpoints::rotate_secret(&mut tx, id, material).await?;
        let endpoint =
            db::endpoints::get(&mut tx, tenant.environment_id, id, self.clock.now()).await?.context("reading back a rotated endpoint")?;
        tx.commit().await.context("committing a secret rotation")?;
        Ok((endpoint, minted.shown()))
    }

    /// Disabling ends every pending or held delivery of the endpoint as a
    /// dead letter with reason `endpoint_disabled`: nothing already scheduled
    /// is sent, nothing waits forever, and the tenant can replay after
    /// re-enabling. Enabling starts its health afresh, recovering what the
    /// endpoint held while Relay had disabled it (as its answers come in).
    ///
    /// A disable is answered only once no attempt of the endpoint can start
    /// any more (see [`App::await_switch_off`]).
    pub async fn set_endpoint_enabled(&self, tenant: Tenant, id: EndpointId, enabled: bool) -> AppResult<Endpoint> {
        // The endpoint is locked first here and last by an outcome batch that
        // disables it automatically (deliveries → health → endpoint), so the
        // two can close a circle; Postgres then ends one of them, and this
        // one runs again.
        let (endpoint, held) = retry_lost_conflicts(|| self.set_endpoint_enabled_once(tenant, id, enabled)).await?;
        self.await_switch_off(id, held).await;
        Ok(endpoint)
    }

    async fn set_endpoint_enabled_once(&self, tenant: Tenant, id: EndpointId, enabled: bool) -> AppResult<(Endpoint, Vec<HeldClaim>)> {
        let mut tx = self.db.begin().await?;
        let reason = (!enabled).then_some(DisabledReason::Manual);
        db::endpoints::set_disabled(&mut tx, tenant.environment_id, id, reason)
            .await?
            .ok_or_else(|| AppError::not_found("webhook endpoint"))?;
        // The endpoint's lock first (expansions share-lock it, so none is
        // half-way through with the old state), then the deliveries, then the
        // health row: an outcome batch locks deliveries before health, so
        // taking health last cannot close a circle with it.
        // Enabled: what it held goes back as its answers come in (the
        // circuit recovers, see `health`), the ones not yet due at once.
        let (recovering, held) = if enabled {
            if db::health::release_not_due(&mut tx, &[id]).await? > 0 {
                db::deliveries::notify_due(&mut tx).await?;
            }
            (db::health::holds_any(&mut tx, id).await?, Vec::new())
        } else {
            (false, end_pending_of_endpoint(&mut tx, id, DeadLetterReason::EndpointDisabled).await?)
        };
        db::health::reset(&mut tx, id, recovering).await?;
        let endpoint =
            db::endpoints::get(&mut tx, tenant.environment_id, id, self.clock.now()).await?.context("reading back an endpoint")?;
        tx.commit().await.context("committing an endpoint state change")?;
        if recovering {
            self.probes_wake.wake();
        }
        Ok((endpoint, held))
    }

    /// Soft: the row stays so its dead letters can. Pending deliveries end
    /// as dead letters with reason `endpoint_deleted`. Answered only once no
    /// attempt of the endpoint can start any more (see
    /// [`App::await_switch_off`]).
    pub async fn delete_endpoint(&self, tenant: Tenant, id: EndpointId) -> AppResult<()> {
        self.delete_endpoint_as(tenant, id, DeadLetterReason::EndpointDeleted).await
    }

    /// Deletes an endpoint, its pending deliveries ending with `reason`.
    pub(crate) async fn delete_endpoint_as(&self, tenant: Tenant, id: EndpointId, reason: DeadLetterReason) -> AppResult<()> {
        let held = retry_lost_conflicts(|| self.delete_endpoint_once(tenant, id, reason)).await?;
        self.await_switch_off(id, held).await;
        Ok(())
    }

    async fn delete_endpoint_once(&self, tenant: Tenant, id: EndpointId, reason: DeadLetterReason) -> AppResult<Vec<HeldClaim>> {
        let mut tx = self.db.begin().await?;
        if !db::endpoints::soft_delete(&mut tx, tenant.environment_id, id).await? {
            return Err(AppError::not_found("webhook endpoint"));
        }
        let held = end_pending_of_endpoint(&mut tx, id, reason).await?;
        db::environments::forget_operations_endpoint(&mut tx, id).await?;
        tx.commit().await.context("committing an endpoint deletion")?;
        Ok(held)
    }

    /// After a switch-off (a tenant's disable or delete) committed: waits
    /// until no attempt it ended can still start, so that the tenant, once
    /// answered, receives no request of the endpoint's that starts later.
    ///
    /// Ending the deliveries is not enough on its own: a dispatcher sends
    /// the first attempts handed to it with an expansion (or an outcome's
    /// refill), and those whose material it fetched in the last 2 s, without
    /// asking the api again. Every such attempt is claimed for that
    /// dispatcher, and the switch-off's statement returned every live claim
    /// on the attempts it ended (and fenced off any claim still to be
    /// taken). So each dispatcher holding one is told which (a core-NATS
    /// request on its own subject); it refuses them from then on and
    /// answers once none of them is on the wire. Asking a dispatcher before
    /// every attempt instead would cost a round trip on the hot path for
    /// the sake of a rare call; this costs the sender a lookup in a set.
    ///
    /// Bounded: a dispatcher that does not answer (gone, cut off from the
    /// broker, or older than the notices) is waited out until its claims run
    /// out (the attempt timeout + 7 s; past its claim a dispatcher starts
    /// no attempt and has none on the wire), and never longer than
    /// [`SWITCH_OFF_WAIT`], so the tenant is answered inside its call's
    /// deadline (with an attempt timeout above 18 s, a dispatcher that is
    /// cut off could outlast that wait). A disable or delete therefore
    /// takes as long as the attempt on the wire has left, which the
    /// receiver decides, at most the attempt timeout.
    ///
    /// Cancel-safe: the switch-off is committed before this begins, and
    /// this only waits (no transaction, nothing half-written): a caller
    /// that gives up (tenant calls run detached, see `crate::detach`, so a
    /// vanished client does not even stop it) loses nothing but the wait.
    async fn await_switch_off(&self, endpoint_id: EndpointId, held: Vec<HeldClaim>) {
        if held.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut by_claimant: HashMap<DispatcherId, (Vec<DeliveryJob>, i64)> = HashMap::new();
        for c in held {
            let (attempts, remaining_ms) = by_claimant.entry(c.claimant).or_default();
            attempts.push(DeliveryJob {
                delivery_id: c.delivery_id.to_string(),
                endpoint_id: endpoint_id.to_string(),
                attempt: c.attempt as u32,
                generation: c.generation as u32,
                ..Default::default()
            });
            *remaining_ms = (*remaining_ms).max(c.remaining_ms);
        }
        let dispatchers = by_claimant.len();
        futures::future::join_all(by_claimant.into_iter().map(|(claimant, (attempts, remaining_ms))| async move {
            let within = Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0)).min(SWITCH_OFF_WAIT);
            let notice = SwitchedOff { endpoint_id: endpoint_id.to_string(), attempts };
            if let Err(why) = self.switch_offs.tell(claimant, &notice, within).await {
                let rest = within.saturating_sub(started.elapsed());
                tracing::warn!(%endpoint_id, %claimant, attempts = notice.attempts.len(), error = %why, wait_ms = rest.as_millis() as u64,
                    "a dispatcher holding attempts of a switched-off endpoint did not answer; waiting out its claims");
                tokio::time::sleep(rest).await;
            }
        }))
        .await;
        tracing::info!(%endpoint_id, dispatchers, waited_ms = started.elapsed().as_millis() as u64, "no attempt of the switched-off endpoint can start");
    }
}

/// The longest a disable or delete waits for dispatchers (see
/// [`App::await_switch_off`]): inside the tenant's call deadline, with room
/// for the transaction before it.
const SWITCH_OFF_WAIT: Duration = super::TENANT_WORK_DEADLINE.saturating_sub(Duration::from_secs(5));

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
