//! Material: what the dispatcher needs to sign and send an attempt that is
//! still current, claimed for the one dispatcher that asked.

use std::collections::{HashMap, HashSet};

use anyhow::Context;

use relay_domain::{
    DeliveryId, EndpointId, Reason,
    client_identity::ClientIdentities,
    delivery::{DeadLetterReason, DeliveryState},
    headers::CustomHeaders,
    health::DisabledReason,
};

use super::{App, Timestamp, deliveries::*};
use crate::{
    db,
    error::{AppError, AppResult, ErrorCode},
};

use relay_signing::{Scheme, SigningSecret};

impl App {
    /// What one attempt needs, if that attempt is still the delivery's current one.
    pub async fn material(&self, wanted: AttemptRef) -> AppResult<Material> {
        self.material_batch(&[wanted]).await?.pop().expect("one answer per request")
    }

    /// Material for many attempts with one query. The outer error is the
    /// batch failing as a whole (the database); each item answers on its own.
    pub async fn material_batch(&self, wanted: &[AttemptRef]) -> AppResult<Vec<AppResult<Material>>> {
        // One reply carries at most the budget's worth of payloads, counted
        // in request order over the items that will be sent: the first such
        // item always fits (an event is far smaller than the budget), the
        // rest past the budget are answered `deferred`, for the next call.
        // So a batch of large events never makes a reply the seam refuses,
        // and never fails the other items it shares a call with.
        let rows = db::deliveries::read_material(
            &self.db,
            &wanted.iter().map(|w| w.delivery_id).collect::<Vec<_>>(),
            &wanted.iter().map(|w| i32::try_from(w.attempt).unwrap_or(i32::MAX)).collect::<Vec<_>>(),
            &wanted.iter().map(|w| i32::try_from(w.generation).unwrap_or(i32::MAX)).collect::<Vec<_>>(),
            relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64,
        )
        .await?;
        let by_ord: HashMap<i64, db::deliveries::MaterialRow> = rows.into_iter().map(|r| (r.ord, r)).collect();
        let claimed = self.claim_attempts(wanted, &by_ord).await?;
        // Secrets are decrypted once per endpoint per batch, not per attempt.
        let mut sending_of = SendingByEndpoint::new();
        let now = self.clock.now();
        let mut out = Vec::with_capacity(wanted.len());
        let mut switched_off: Vec<(DeliveryId, DeadLetterReason)> = Vec::new();
        let mut to_hold: Vec<DeliveryId> = Vec::new();
        for (ord, w) in (1..).zip(wanted) {
            let row = match by_ord.get(&ord) {
                Some(r) => r,
                None => {
                    out.push(Err(AppError::not_found("delivery")));
                    continue;
                }
            };
            if row.servable && row.envelope.is_none() {
                out.push(Err(AppError::new(
                    ErrorCode::Unavailable,
                    Reason::Deferred,
                    "this reply's payload budget is spent; ask for this attempt again",
                )));
                continue;
            }
            if row.servable && w.claim.is_some() && !claimed.contains(&row.id) {
                out.push(Err(AppError::new(
                    ErrorCode::Unavailable,
                    Reason::InHandElsewhere,
                    format!("another dispatcher holds attempt {attempt} of delivery {}; ask again later", row.id, attempt = w.attempt),
                )));
                continue;
            }
            if row.state == DeliveryState::Pending && !accepts_attempts(row) {
                match (row.deleted, row.disabled_reason) {
                    (true, _) => switched_off.push((row.id, DeadLetterReason::EndpointDeleted)),
                    (false, Some(reason)) if reason.holds() => to_hold.push(row.id),
                    _ => switched_off.push((row.id, DeadLetterReason::EndpointDisabled)),
                }
            }
            out.push(self.material_from(row, w, now, &mut sending_of));
        }
        // Disabling or deleting an endpoint ends its pending deliveries in the
        // same transaction, and expansion cannot write new ones behind it, so
        // none should get here; if one ever does, it ends now rather than
        // waiting on a lease for an attempt that will never be made.
        for reason in [DeadLetterReason::EndpointDisabled, DeadLetterReason::EndpointDeleted] {
            let ids: Vec<DeliveryId> = switched_off.iter().filter(|(_, r)| *r == reason).map(|(id, _)| *id).collect();
            if !ids.is_empty() {
                let ended = db::deliveries::end_pending_by_id(&self.db, &ids, reason).await?;
                tracing::warn!(
                    ended,
                    reason = reason.as_str(),
                    "pending deliveries of an inactive endpoint found at material time; dead-lettered"
                );
            }
        }
        // A receiver's 410 holds its endpoint's pending deliveries in the
        // outcome's transaction; one leased at that moment is held here.
        if !to_hold.is_empty() {
            db::health::hold_by_id(&self.db, &to_hold).await?;
        }
        Ok(out)
    }

    /// Claims the attempts of a material batch that will be answered (the
    /// read just found them current), for their claimants: one statement,
    /// taking only attempts nobody else holds (or whose holder's claim ran
    /// out). A claim outlives its attempt's outcome on purpose: a second copy
    /// of the job asking before it runs out is refused, and asking after
    /// finds the attempt no longer current. Returns the deliveries claimed.
    async fn claim_attempts(
        &self,
        wanted: &[AttemptRef],
        rows: &HashMap<i64, db::deliveries::MaterialRow>,
    ) -> AppResult<HashSet<DeliveryId>> {
        let mut seen: HashSet<DeliveryId> = HashSet::new();
        let asked: Vec<(&AttemptRef, Claim)> = (1..)
            .zip(wanted)
            .filter_map(|(ord, w)| {
                let row = rows.get(&ord)?;
                let claim = w.claim?;
                (row.servable && row.envelope.is_some() && seen.insert(w.delivery_id)).then_some((w, claim))
            })
            .collect();
        if asked.is_empty() {
            return Ok(HashSet::new());
        }
        let mut claims = db::deliveries::ClaimsAsked::default();
        for (w, c) in asked {
            claims.delivery_id.push(w.delivery_id);
            claims.attempt.push(w.attempt as i32);
            claims.generation.push(w.generation as i32);
            claims.claimant.push(c.claimant);
            claims.hold_ms.push(c.hold.as_millis() as i64);
        }
        db::deliveries::claim_attempts(&self.db, &claims).await
    }

    fn material_from(
        &self,
        row: &db::deliveries::MaterialRow,
        w: &AttemptRef,
        now: Timestamp,
        sending_of: &mut SendingByEndpoint,
    ) -> AppResult<Material> {
        let AttemptRef { delivery_id, generation, attempt, .. } = *w;
        if row.state != DeliveryState::Pending || row.attempt as u32 != attempt || row.generation as u32 != generation {
            return Err(AppError::precondition(
                Reason::StaleAttempt,
                format!(
                    "delivery {delivery_id} is {} at attempt {} (generation {}); attempt {attempt} (generation {generation}) is not current",
                    row.state.as_str(),
                    row.attempt,
                    row.generation
                ),
            ));
        }
        if !accepts_attempts(row) {
            return Err(AppError::precondition(Reason::EndpointInactive, format!("endpoint {} is disabled or deleted", row.endpoint_id)));
        }
        let stored = StoredSecrets::new(
            &row.signature_scheme,
            &row.secret_key_id,
            &row.secret_ciphertext,
            &row.previous_secret_key_id,
            &row.previous_secret_ciphertext,
            row.secret_rotated_at,
            (&row.headers_key_id, &row.headers_ciphertext),
        )
        .with_auth(
            (&row.client_tls_key_id, &row.client_tls_ciphertext),
            &row.ca_bundle,
            (&row.oauth2_key_id, &row.oauth2_ciphertext),
        );
        let sending = self.sending_for(sending_of, row.endpoint_id, stored, now)?;
        Ok(Material {
            delivery_id,
            endpoint_id: row.endpoint_id,
            environment_id: row.environment_id,
            event_id: row.event_id,
            url: row.url.clone(),
            attempt,
            generation,
            scheme: sending.scheme,
            secrets: sending.secrets,
            headers: sending.headers,
            auth: sending.auth,
            max_in_flight: row.max_in_flight.and_then(|n| u32::try_from(n).ok()),
            ordering: row.ordering_key.clone().zip(row.ordering_position),
            payload: row.envelope.clone().context("a servable row carries its envelope")?,
            traceparent: None,
            followers: Vec::new(),
        })
    }
}

/// An endpoint's signing secrets as stored: encrypted, under their key ids.
pub(crate) struct StoredSecrets<'a> {
    /// The endpoint's `signature_scheme`: what the secrets are and sign.
    scheme: &'a str,
    current: (&'a str, &'a [u8]),
    previous: Option<(&'a str, &'a [u8])>,
    rotated_at: Option<Timestamp>,
    headers: Option<(&'a str, &'a [u8])>,
    client_tls: Option<(&'a str, &'a [u8])>,
    ca_bundle: Option<&'a str>,
    oauth2: Option<(&'a str, &'a [u8])>,
}

fn sealed<'a>(k: &'a Option<String>, c: &'a Option<Vec<u8>>) -> Option<(&'a str, &'a [u8])> {
    match (k, c) {
        (Some(k), Some(c)) => Some((k.as_str(), c.as_slice())),
        _ => None,
    }
}

impl<'a> StoredSecrets<'a> {
    pub(crate) fn new(
        scheme: &'a str,
        key_id: &'a str,
        ciphertext: &'a [u8],
        previous_key_id: &'a Option<String>,
        previous_ciphertext: &'a Option<Vec<u8>>,
        rotated_at: Option<Timestamp>,
        headers: (&'a Option<String>, &'a Option<Vec<u8>>),
    ) -> Self {
        Self {
            scheme,
            current: (key_id, ciphertext),
            previous: sealed(previous_key_id, previous_ciphertext),
            rotated_at,
            headers: sealed(headers.0, headers.1),
            client_tls: None,
            ca_bundle: None,
            oauth2: None,
        }
    }

    /// With how Relay authenticates to the receiver beyond signing: its
    /// client certificate (sealed), pinned CA bundle and OAuth2 client
    /// credentials (sealed).
    pub(crate) fn with_auth(
        mut self,
        client_tls: (&'a Option<String>, &'a Option<Vec<u8>>),
        ca_bundle: &'a Option<String>,
        oauth2: (&'a Option<String>, &'a Option<Vec<u8>>),
    ) -> Self {
        self.client_tls = sealed(client_tls.0, client_tls.1);
        self.ca_bundle = ca_bundle.as_deref();
        self.oauth2 = sealed(oauth2.0, oauth2.1);
        self
    }
}

/// What sending to an endpoint needs besides the delivery: how to sign,
/// with what, and its custom headers.
#[derive(Clone)]
pub(crate) struct Sending {
    pub scheme: Scheme,
    pub secrets: Vec<SigningSecret>,
    pub headers: CustomHeaders,
    pub auth: ReceiverAuth,
}

/// What sending needs, decrypted in one batch, by endpoint: each endpoint's
/// once, however many of its attempts the batch hands out.
pub(crate) type SendingByEndpoint = HashMap<EndpointId, Sending>;

impl App {
    /// An endpoint's scheme, signing secrets and custom headers, decrypted
    /// (once per batch): the current secret, and the previous one while its
    /// rotation window lasts (current first).
    pub(crate) fn sending_for(
        &self,
        decrypted: &mut SendingByEndpoint,
        endpoint_id: EndpointId,
        stored: StoredSecrets<'_>,
        now: Timestamp,
    ) -> AppResult<Sending> {
        if let Some(s) = decrypted.get(&endpoint_id) {
            return Ok(s.clone());
        }
        let scheme = db::models::stored_scheme(endpoint_id, stored.scheme)?;
        let (key_id, ciphertext) = stored.current;
        let mut secrets = vec![self.keyring.decrypt(key_id, ciphertext).context("decrypting a signing secret")?];
        if let Some((key_id, ct)) = stored.previous.filter(|_| relay_domain::signing::previous_still_signs(stored.rotated_at, now)) {
            secrets.push(self.keyring.decrypt(key_id, ct).context("decrypting a previous signing secret")?);
        }
        let headers = match stored.headers {
            Some((key_id, ct)) => {
                let plain = self.keyring.open(key_id, ct).context("decrypting custom headers")?;
                let pairs: Vec<(String, String)> = serde_json::from_slice(&plain).context("reading decrypted custom headers")?;
                CustomHeaders::parse(pairs)
                    .map_err(|e| anyhow::anyhow!("endpoint {endpoint_id} has stored headers that no longer pass: {e}"))?
            }
            None => CustomHeaders::default(),
        };
        let (identity_pem, previous_identity_pem) = match stored.client_tls {
            Some((key_id, ct)) => {
                let plain = self.keyring.open(key_id, ct).context("decrypting a client key")?;
                let identities = ClientIdentities::decode(&String::from_utf8(plain).context("reading a decrypted client key")?)
                    .with_context(|| format!("endpoint {endpoint_id}'s sealed client identity"))?;
                let previous = identities.previous_at(now).map(str::to_owned);
                (Some(identities.current), previous)
            }
            None => (None, None),
        };
        let oauth2 = match stored.oauth2 {
            Some((key_id, ct)) => {
                let plain = self.keyring.open(key_id, ct).context("decrypting OAuth2 client credentials")?;
                Some(serde_json::from_slice(&plain).context("reading decrypted OAuth2 client credentials")?)
            }
            None => None,
        };
        let auth = ReceiverAuth { identity_pem, previous_identity_pem, ca_bundle: stored.ca_bundle.map(str::to_owned), oauth2 };
        let sending = Sending { scheme, secrets, headers, auth };
        decrypted.insert(endpoint_id, sending.clone());
        Ok(sending)
    }
}

/// Whether the row's endpoint is sent to: enabled, or disabled as `failing`
/// (its only pending delivery is then the probe).
fn accepts_attempts(row: &db::deliveries::MaterialRow) -> bool {
    !row.deleted && (row.enabled || row.disabled_reason == Some(DisabledReason::Failing))
}
