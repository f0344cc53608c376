//! What a tenant asks of an endpoint, before it is stored: a new one, a
//! change to one, and the checks that need no storage (the in-flight cap,
//! custom headers, sealed for storage with the key ring).

use anyhow::Context;
use relay_domain::{
    Reason,
    client_identity::ClientIdentities,
    filter::Filter,
    headers::CustomHeaders,
    models::{ClientCertificateShown, ClientCertificatesShown, OAuth2Credentials},
    rate::RateLimit,
};

use super::{App, client_tls::ClientIdentity};
use crate::db::{endpoint_secrets::Sealed, endpoints::LockedSigning};
use crate::error::{AppError, AppResult};

/// A new endpoint as asked for.
#[derive(Default)]
pub struct NewEndpoint {
    pub url: String,
    pub event_types: Vec<String>,
    /// Empty: relay-v1.
    pub signature_scheme: String,
    pub headers: Vec<(String, String)>,
    /// `None`: the platform's cap.
    pub max_in_flight: Option<u32>,
    /// A payload filter's JSON text; empty: none.
    pub filter: String,
    /// (per second, burst) as asked; `None`: unlimited.
    pub rate_limit: Option<(u32, u32)>,
    /// A client certificate (PEM chain) and its key (PEM), or neither.
    pub client_certificate: String,
    pub client_key: String,
    /// A CA bundle to pin (PEM); empty: the platform's trusted roots.
    pub ca_bundle: String,
    /// OAuth2 client credentials (their `Debug` redacts the secret).
    pub oauth2: Option<OAuth2Credentials>,
    /// "none", "per_key"; empty: none.
    pub ordering: String,
}

impl std::fmt::Debug for NewEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Header values are often credentials: names only.
        f.debug_struct("NewEndpoint")
            .field("url", &self.url)
            .field("event_types", &self.event_types)
            .field("signature_scheme", &self.signature_scheme)
            .field("headers", &self.headers.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>())
            .field("max_in_flight", &self.max_in_flight)
            .field("filter", &self.filter)
            .field("rate_limit", &self.rate_limit)
            .field("client_certificate", &self.client_certificate.len())
            .field("client_key", &"[redacted]")
            .field("ca_bundle", &self.ca_bundle.len())
            .field("oauth2", &self.oauth2)
            .field("ordering", &self.ordering)
            .finish()
    }
}

/// The most characters of an OAuth2 client id, and of a secret, scope or audience.
const MAX_CLIENT_ID: usize = 256;
const MAX_OAUTH2_FIELD: usize = 1024;

/// OAuth2 client credentials' fields, but the token URL (which the caller
/// checks like an endpoint URL, resolving its host).
pub(super) fn check_oauth2_fields(c: &OAuth2Credentials) -> AppResult<()> {
    let refuse = |m: String| Err(AppError::invalid(Reason::InvalidOauthCredentials, m));
    for (name, value, required, max) in [
        ("client_id", &c.client_id, true, MAX_CLIENT_ID),
        ("client_secret", &c.client_secret, true, MAX_OAUTH2_FIELD),
        ("scope", &c.scope, false, MAX_OAUTH2_FIELD),
        ("audience", &c.audience, false, MAX_OAUTH2_FIELD),
    ] {
        let length = value.chars().count();
        if required && value.is_empty() {
            return refuse(format!("oauth2.{name} is required"));
        }
        if length > max {
            return refuse(format!("oauth2.{name} may be at most {max} characters; this one is {length}"));
        }
        if let Some(at) = value.chars().position(char::is_control) {
            return refuse(format!("oauth2.{name} may not hold control characters (one at character {})", at + 1));
        }
    }
    if c.token_url.trim().is_empty() {
        return refuse("oauth2.token_url is required".into());
    }
    Ok(())
}

/// What a request does to the OAuth2 credentials, as for the rate limit.
pub(super) fn oauth2_change(clear: bool, asked: Option<OAuth2Credentials>) -> AppResult<Option<Option<OAuth2Credentials>>> {
    clear_or_replace(
        clear,
        asked,
        Reason::InvalidOauthCredentials,
        "clear_oauth2 removes the credentials: ask for it or for new ones, not both",
    )
}

/// What a request does to the client certificate: both parts replace it,
/// neither keeps it, `clear` removes it; one part alone, or a new one with
/// `clear`, is a mistake.
pub(super) fn client_tls_change(clear: bool, certificate: String, key: String) -> AppResult<Option<Option<(String, String)>>> {
    let refuse = |m: &str| AppError::invalid(Reason::InvalidClientCertificate, m.to_owned());
    let asked = match (certificate.trim().is_empty(), key.trim().is_empty()) {
        (true, true) => None,
        (false, false) => Some((certificate, key)),
        _ if clear => Some((certificate, key)),
        (false, true) => return Err(refuse("client_certificate needs its client_key")),
        (true, false) => return Err(refuse("client_key needs its client_certificate")),
    };
    clear_or_replace(
        clear,
        asked,
        Reason::InvalidClientCertificate,
        "clear_client_certificate removes the certificate: ask for it or for a new one, not both",
    )
}

/// What a request does to the CA bundle, as for the filter.
pub(super) fn ca_bundle_change(clear: bool, pem: String) -> AppResult<Option<Option<String>>> {
    let asked = (!pem.trim().is_empty()).then_some(pem);
    clear_or_replace(clear, asked, Reason::InvalidCaBundle, "clear_ca_bundle removes the bundle: ask for it or for a new one, not both")
}

/// A rate limit checked against its bounds.
pub(super) fn check_rate_limit((per_second, burst): (u32, u32)) -> AppResult<RateLimit> {
    RateLimit::new(per_second, burst).map_err(|e| AppError::invalid(Reason::RateLimitOutOfRange, e))
}

/// What an update does to the rate limit, as for headers: `clear` removes
/// it, a new one replaces it, neither keeps it.
pub(super) fn rate_limit_change(clear: bool, asked: Option<(u32, u32)>) -> AppResult<Option<Option<(u32, u32)>>> {
    clear_or_replace(
        clear,
        asked,
        Reason::RateLimitOutOfRange,
        "clear_rate_limit removes the rate limit: ask for it or for a new limit, not both",
    )
}

/// A payload filter checked (`relay_domain::filter`), kept as written.
pub(super) fn check_filter(text: &str) -> AppResult<String> {
    Filter::parse(text).map(|f| f.text().to_owned()).map_err(|e| AppError::invalid(Reason::InvalidFilter, e.to_string()))
}

/// What an update does to the payload filter, as for headers: `clear`
/// removes it, a new one replaces it, neither keeps it.
pub(super) fn filter_change(clear: bool, text: String) -> AppResult<Option<Option<String>>> {
    // JSON null (REST `"filter": null`) removes it, as a merge patch would.
    if text.trim() == "null" && !clear {
        return Ok(Some(None));
    }
    let asked = (!text.trim().is_empty()).then_some(text);
    clear_or_replace(clear, asked, Reason::InvalidFilter, "clear_filter removes the filter: ask for it or for a new filter, not both")
}

/// What an update does to the custom headers: `clear` removes them all, new
/// pairs replace them, neither keeps them; both at once is a mistake.
pub(super) fn header_change(clear: bool, pairs: Vec<(String, String)>) -> AppResult<Option<Vec<(String, String)>>> {
    let asked = (!pairs.is_empty()).then_some(pairs);
    let change = clear_or_replace(
        clear,
        asked,
        Reason::InvalidHeaders,
        "clear_headers removes every header: ask for it or for new headers, not both",
    )?;
    // Cleared: no pairs at all.
    Ok(change.map(Option::unwrap_or_default))
}

/// The rule every optional setting of an update follows: a new value
/// replaces it (`Some(Some)`), `clear` removes it (`Some(None)`), neither
/// keeps it (`None`); a new value and `clear` at once is refused with
/// `reason` and `both`.
fn clear_or_replace<T>(clear: bool, asked: Option<T>, reason: Reason, both: &str) -> AppResult<Option<Option<T>>> {
    match (clear, asked) {
        (true, Some(_)) => Err(AppError::invalid(reason, both.to_owned())),
        (true, None) => Ok(Some(None)),
        (false, None) => Ok(None),
        (false, Some(value)) => Ok(Some(Some(value))),
    }
}

/// The most attempts out at once an endpoint may ask for.
const MAX_IN_FLIGHT: u32 = 1000;

/// The ordering a request names ("none", "per_key").
pub(super) fn parse_ordering(name: &str) -> AppResult<relay_domain::ordering::Ordering> {
    relay_domain::ordering::Ordering::parse(name).map_err(|e| AppError::invalid(Reason::InvalidOrdering, e))
}

pub(super) fn check_max_in_flight(n: u32) -> AppResult<i32> {
    if !(1..=MAX_IN_FLIGHT).contains(&n) {
        return Err(AppError::invalid(Reason::MaxInFlightOutOfRange, format!("max_in_flight must be 1–{MAX_IN_FLIGHT}, got {n}")));
    }
    Ok(n as i32)
}

/// What an update asks for, as asked; empty or `None` fields stay as they
/// are. Nothing here is judged before the endpoint is found to be the
/// tenant's: another tenant's endpoint answers 404 whatever the body says.
#[derive(Default)]
pub struct EndpointChange {
    pub url: Option<String>,
    pub event_types: Vec<String>,
    pub signature_scheme: Option<String>,
    /// New custom headers, replacing all of them (none: kept)…
    pub headers: Vec<(String, String)>,
    /// …or removing them all (see [`header_change`]).
    pub clear_headers: bool,
    /// A new in-flight cap; `Some(None)` returns to the platform's.
    pub max_in_flight: Option<Option<u32>>,
    /// A new payload filter's JSON (empty: kept; `null`: removed)…
    pub filter: String,
    /// …or removing it (see [`filter_change`]).
    pub clear_filter: bool,
    /// A new rate limit, (per second, burst) (`None`: kept)…
    pub rate_limit: Option<(u32, u32)>,
    /// …or removing it (see [`rate_limit_change`]).
    pub clear_rate_limit: bool,
    /// A new client certificate and key (both empty: kept)…
    pub client_certificate: String,
    pub client_key: String,
    /// …or removing them (see [`client_tls_change`]).
    pub clear_client_certificate: bool,
    /// Ends the client certificate's overlap now (see
    /// [`App::client_tls_after`]).
    pub end_client_certificate_overlap: bool,
    /// A new CA bundle (empty: kept)…
    pub ca_bundle: String,
    /// …or removing it.
    pub clear_ca_bundle: bool,
    /// New OAuth2 client credentials (`None`: kept)…
    pub oauth2: Option<OAuth2Credentials>,
    /// …or removing them.
    pub clear_oauth2: bool,
    /// A new ordering, for deliveries created from now on (`None`: kept).
    pub ordering: Option<String>,
}

impl std::fmt::Debug for EndpointChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Header values are often credentials: names only.
        let headers = self.headers.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>();
        f.debug_struct("EndpointChange")
            .field("url", &self.url)
            .field("event_types", &self.event_types)
            .field("signature_scheme", &self.signature_scheme)
            .field("headers", &headers)
            .field("clear_headers", &self.clear_headers)
            .field("max_in_flight", &self.max_in_flight)
            .field("filter", &self.filter)
            .field("clear_filter", &self.clear_filter)
            .field("rate_limit", &self.rate_limit)
            .field("clear_rate_limit", &self.clear_rate_limit)
            .field("client_certificate", &self.client_certificate.len())
            .field("client_key", &"[redacted]")
            .field("clear_client_certificate", &self.clear_client_certificate)
            .field("end_client_certificate_overlap", &self.end_client_certificate_overlap)
            .field("ca_bundle", &self.ca_bundle.len())
            .field("clear_ca_bundle", &self.clear_ca_bundle)
            .field("oauth2", &self.oauth2)
            .field("clear_oauth2", &self.clear_oauth2)
            .field("ordering", &self.ordering)
            .finish()
    }
}

impl App {
    /// Checks OAuth2 client credentials (the token URL as strictly as an
    /// endpoint's) and seals them.
    pub(super) async fn seal_oauth2(&self, credentials: OAuth2Credentials) -> AppResult<Sealed> {
        check_oauth2_fields(&credentials)?;
        let token_url = self
            .check_endpoint_url(credentials.token_url.trim())
            .await
            .map_err(|e| AppError::invalid(Reason::InvalidOauthCredentials, format!("oauth2.token_url: {}", e.message)))?;
        let credentials = OAuth2Credentials { token_url, ..credentials };
        let plain = serde_json::to_vec(&credentials).context("encoding OAuth2 client credentials")?;
        let (key_id, ciphertext) = self.keyring.seal(&plain);
        let shown = serde_json::to_value(credentials.shown()).context("encoding shown OAuth2 client credentials")?;
        Ok(Sealed { key_id, ciphertext, shown })
    }

    /// Checks a client certificate and key (at this instant).
    pub(super) fn check_client_tls(&self, (certificate, key): (String, String)) -> AppResult<ClientIdentity> {
        super::client_tls::check_client_identity(&certificate, &key, self.clock.now())
    }

    /// A new endpoint's client identity, sealed: no overlap.
    pub(super) fn seal_client_tls(&self, identity: ClientIdentity) -> AppResult<Sealed> {
        let shown = ClientCertificatesShown { current: identity.shown, previous: None };
        self.seal_identities(&ClientIdentities::single(identity.pem), &shown)
    }

    fn seal_identities(&self, identities: &ClientIdentities, shown: &ClientCertificatesShown) -> AppResult<Sealed> {
        let (key_id, ciphertext) = self.keyring.seal(identities.encode().as_bytes());
        let shown = serde_json::to_value(shown).context("encoding a shown client certificate")?;
        Ok(Sealed { key_id, ciphertext, shown })
    }

    /// What an update makes of the endpoint's sealed client identity, given
    /// the row as locked (`None`: left as it is). A new certificate replacing
    /// another starts an overlap (see `relay_domain::client_identity`) unless
    /// `end_overlap` asks for an outright replacement; `end_overlap` alone
    /// drops the previous certificate now.
    pub(super) fn client_tls_after(
        &self,
        locked: &LockedSigning,
        asked: Option<Option<ClientIdentity>>,
        end_overlap: bool,
    ) -> AppResult<Option<Option<Sealed>>> {
        let stored = || -> AppResult<Option<(ClientIdentities, ClientCertificatesShown)>> {
            let (Some(key_id), Some(ciphertext), Some(shown)) =
                (&locked.client_tls_key_id, &locked.client_tls_ciphertext, &locked.client_certificate_shown)
            else {
                return Ok(None);
            };
            let plain = self.keyring.open(key_id, ciphertext).context("decrypting a client key")?;
            let identities = ClientIdentities::decode(&String::from_utf8(plain).context("reading a decrypted client key")?)
                .context("reading a sealed client identity")?;
            let shown = serde_json::from_value(shown.clone()).context("reading a shown client certificate")?;
            Ok(Some((identities, shown)))
        };
        match asked {
            Some(None) => Ok(Some(None)),
            Some(Some(new)) => {
                let replaced = if end_overlap { None } else { stored()? };
                let (identities, shown) = match replaced {
                    // The same certificate again is no rotation.
                    Some((old, old_shown)) if old_shown.current.fingerprint_sha256 != new.shown.fingerprint_sha256 => {
                        let identities = old.rotated(new.pem, self.clock.now());
                        let until = identities.previous.as_ref().map(|(_, until)| *until);
                        let previous = ClientCertificateShown { presented_until: until, ..old_shown.current };
                        (identities, ClientCertificatesShown { current: new.shown, previous: Some(previous) })
                    }
                    _ => (ClientIdentities::single(new.pem), ClientCertificatesShown { current: new.shown, previous: None }),
                };
                Ok(Some(Some(self.seal_identities(&identities, &shown)?)))
            }
            None if end_overlap => match stored()? {
                Some((identities, shown)) if identities.previous.is_some() => {
                    let shown = ClientCertificatesShown { previous: None, ..shown };
                    Ok(Some(Some(self.seal_identities(&identities.without_previous(), &shown)?)))
                }
                _ => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// Checks custom headers and seals them; none at all is `None`.
    pub(super) fn seal_headers(&self, pairs: Vec<(String, String)>) -> AppResult<Option<Sealed>> {
        let headers = CustomHeaders::parse(pairs).map_err(|e| AppError::invalid(Reason::InvalidHeaders, e.0))?;
        if headers.is_empty() {
            return Ok(None);
        }
        let plain = serde_json::to_vec(headers.pairs()).context("encoding custom headers")?;
        let (key_id, ciphertext) = self.keyring.seal(&plain);
        let shown = serde_json::to_value(headers.masked()).context("encoding masked custom headers")?;
        Ok(Some(Sealed { key_id, ciphertext, shown }))
    }
}
