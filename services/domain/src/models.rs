//! What the services read about a tenant's things, as plain data: the api's
//! storage produces these, its transports show them. No row types leak past
//! storage; ids are typed.

use relay_signing::Scheme;

use crate::{
    Timestamp,
    delivery::{DeadLetterReason, DeliveryState},
    health::{DisabledReason, EndpointHealth},
    ids::{ApiKeyId, DeadLetterId, DeliveryId, EndpointId, EnvironmentId, EventId, OperationId},
};

#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub id: DeadLetterId,
    pub delivery_id: DeliveryId,
    pub endpoint_id: EndpointId,
    pub event_id: EventId,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub reason: DeadLetterReason,
    pub dead_lettered_at: Timestamp,
    /// Its delivery is no longer dead: replayed (or recovered) since. The
    /// record stays as the evidence that the attempts once ran out.
    pub replayed: bool,
    /// At an endpoint that orders per key: its key, and how many later
    /// deliveries of the key have been sent since it died.
    pub ordering_key: Option<String>,
    pub later_in_key: Option<i64>,
}

#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: DeliveryId,
    pub event_id: EventId,
    pub endpoint_id: EndpointId,
    pub state: DeliveryState,
    pub attempt: i32,
    pub next_attempt_at: Timestamp,
    pub created_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub generation: i32,
    pub attempts: Vec<Attempt>,
    /// In an ordered endpoint's lane: its key, and the number the lane gave
    /// it when it became the key's next to send (`None` while queued).
    pub ordering_key: Option<String>,
    pub ordering_position: Option<i64>,
}

/// One row of the attempt log.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub delivery_id: DeliveryId,
    pub generation: i32,
    pub attempt: i32,
    pub attempted_at: Timestamp,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub latency_ms: i64,
    pub response_body: Option<Vec<u8>>,
    pub next_attempt_at: Option<Timestamp>,
    /// The scheme it was signed with, as the log stores it.
    pub signature_scheme: Option<String>,
}

/// An endpoint as every read shows it. The ciphertexts are not even selected.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub id: EndpointId,
    pub url: String,
    pub event_types: Vec<String>,
    pub enabled: bool,
    /// Why it is disabled; `None` exactly when enabled.
    pub disabled_reason: Option<DisabledReason>,
    pub created_at: Timestamp,
    pub secret_rotated_at: Option<Timestamp>,
    pub signature_scheme: Scheme,
    /// `whpk_…`, under the ed25519 scheme.
    pub public_key: Option<String>,
    /// The previous public key, while its rotation window lasts.
    pub previous_public_key: Option<String>,
    pub signature_scheme_changed_at: Option<Timestamp>,
    pub health: EndpointHealth,
    /// Attempts and failures over the circuit's window, as read.
    pub recent: (u32, u32),
    /// Deliveries held for this endpoint's recovery.
    pub held: i64,
    /// Custom headers sent with every delivery, values masked
    /// (`headers::mask`).
    pub headers: Vec<(String, String)>,
    /// The most attempts it may have out at once; `None`: the platform's cap.
    pub max_in_flight: Option<u32>,
    /// The payload filter as the tenant wrote it; `None`: every event of
    /// its types.
    pub filter: Option<String>,
    /// Its rate limit; `None`: unlimited.
    pub rate_limit: Option<crate::rate::RateLimit>,
    /// What reads show of its client certificate (subject, issuer,
    /// not_after, fingerprint_sha256); `None`: none is presented.
    pub client_certificate: Option<ClientCertificateShown>,
    /// The certificate the current one replaced, while the overlap lasts:
    /// presented when the receiver refuses the current one.
    pub previous_client_certificate: Option<ClientCertificateShown>,
    /// The CA bundle it pins; `None`: the platform's trusted roots.
    pub ca_bundle: Option<String>,
    /// Its OAuth2 client credentials as reads show them (no secret).
    pub oauth2: Option<OAuth2Shown>,
    /// How it orders its deliveries (`crate::ordering::Ordering`).
    pub ordering: crate::ordering::Ordering,
}

#[derive(Debug, Clone)]
pub struct Environment {
    pub id: EnvironmentId,
    pub name: String,
    pub endpoint_quota: i32,
    pub created_at: Timestamp,
    pub disable_after_secs: i32,
    pub disable_min_failures: i32,
    /// Held deliveries older than this become dead letters `endpoint_failing`.
    pub max_held_secs: i32,
}

#[derive(Debug, Clone)]
pub struct ApiKey {
    pub id: ApiKeyId,
    pub environment_id: EnvironmentId,
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

/// A held delivery as the tenant lists it.
#[derive(Debug, Clone)]
pub struct HeldDelivery {
    pub id: DeliveryId,
    pub event_id: EventId,
    /// The attempt it will make next.
    pub attempt: i32,
    pub next_attempt_at: Timestamp,
    pub created_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
}

/// A recovery as stored.
#[derive(Debug, Clone)]
pub struct Operation {
    pub id: OperationId,
    pub environment_id: EnvironmentId,
    pub endpoint_id: EndpointId,
    pub since: Timestamp,
    pub until: Timestamp,
    pub state: String,
    pub total: i32,
    pub completed: i32,
    pub cursor_at: Option<Timestamp>,
    pub cursor_id: Option<DeliveryId>,
    pub error: Option<String>,
}

/// An event as the log lists it, with its deliveries counted by state.
pub struct LoggedEvent {
    pub id: EventId,
    pub event_type: String,
    pub created_at: Timestamp,
    pub seq: i64,
    pub deliveries: i64,
    pub delivered: i64,
    pub failing: i64,
    pub dead: i64,
}

/// Which of an environment's events a page of the event log shows.
#[derive(Debug, Default, Clone)]
pub struct EventFilter {
    pub event_type: Option<String>,
    pub since: Option<Timestamp>,
    pub until: Option<Timestamp>,
    /// Older than this (created_at, seq): the next page.
    pub before: Option<(Timestamp, i64)>,
}

/// What reads show of an endpoint's client certificate (never its key).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClientCertificateShown {
    pub subject: String,
    pub issuer: String,
    /// RFC 3339.
    pub not_after: String,
    /// SHA-256 of the leaf certificate's DER, hex.
    pub fingerprint_sha256: String,
    /// Only on a previous certificate: when its overlap ends (see
    /// [`crate::client_identity`]).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub presented_until: Option<crate::Timestamp>,
}

/// What is stored to show of an endpoint's client certificates: the current
/// one and, after a change, the one it replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClientCertificatesShown {
    #[cfg_attr(feature = "serde", serde(flatten))]
    pub current: ClientCertificateShown,
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub previous: Option<ClientCertificateShown>,
}

impl ClientCertificatesShown {
    /// The previous certificate while its overlap lasts at `now`.
    pub fn previous_at(&self, now: crate::Timestamp) -> Option<&ClientCertificateShown> {
        self.previous.as_ref().filter(|p| p.presented_until.is_some_and(|until| now < until))
    }
}

/// An endpoint's OAuth2 client credentials (RFC 6749 §4.4): where the
/// dispatcher asks for a token, as whom, and for what. `Debug` redacts the
/// secret.
#[derive(Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct OAuth2Credentials {
    pub token_url: String,
    pub client_id: String,
    pub client_secret: String,
    /// Empty: none asked for.
    pub scope: String,
    /// Empty: none asked for.
    pub audience: String,
}

impl std::fmt::Debug for OAuth2Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuth2Credentials")
            .field("token_url", &self.token_url)
            .field("client_id", &self.client_id)
            .field("client_secret", &"[redacted]")
            .field("scope", &self.scope)
            .field("audience", &self.audience)
            .finish()
    }
}

impl OAuth2Credentials {
    /// What reads show: everything but the secret.
    pub fn shown(&self) -> OAuth2Shown {
        OAuth2Shown {
            token_url: self.token_url.clone(),
            client_id: self.client_id.clone(),
            scope: self.scope.clone(),
            audience: self.audience.clone(),
        }
    }
}

/// What reads show of an endpoint's OAuth2 client credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct OAuth2Shown {
    pub token_url: String,
    pub client_id: String,
    pub scope: String,
    pub audience: String,
}
