//! The contracts every Relay service speaks, generated from `proto/`.
//!
//! One crate, so that the api and the dispatcher can never disagree about a
//! field: a rename breaks the build on both sides at once.

use std::fmt;

include!(concat!(env!("OUT_DIR"), "/relay.rs"));

/// The encoded `FileDescriptorSet` of every contract (imports included):
/// served by gRPC reflection and read by the REST facade for its routes.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/relay_descriptor.bin"));

/// The metadata key a failing RPC uses to name its reason in machine-readable
/// form, one of `relay_domain::Reason` (`endpoint_quota_exceeded`, ...). The REST
/// facade copies it into the JSON error body.
pub const ERROR_REASON_METADATA: &str = "relay-error-reason";
/// On a RESOURCE_EXHAUSTED status: seconds until the same request would
/// pass (REST sends it as Retry-After).
pub const RETRY_AFTER_METADATA: &str = "retry-after";

/// Response metadata by which a tenant method tells the REST facade its
/// success status when that depends on the request (a dry run's 200 where
/// the real call is 202); absent, the method's declared status holds.
pub const HTTP_STATUS_METADATA: &str = "relay-http-status";

/// The largest message either end of the internal seam sends or accepts, set
/// the same on both. Batches stay well below it by construction: the api
/// answers a material batch only up to [`SEAM_MATERIAL_REPLY_BUDGET_BYTES`]
/// of payload and defers the rest to the next call.
pub const SEAM_MESSAGE_LIMIT_BYTES: usize = 16 * 1024 * 1024;

/// How much of a receiver's response body an attempt keeps: the dispatcher
/// reads no more, the attempt log stores no more.
pub const RESPONSE_BODY_KEPT_BYTES: usize = 4096;
/// Payload bytes one material batch reply carries at most (the first item
/// always fits: an event is at most 256 KiB).
pub const SEAM_MATERIAL_REPLY_BUDGET_BYTES: usize = 4 * 1024 * 1024;

const REDACTED: &str = "[redacted]";

/// Custom header values are often credentials: names only.
fn header_names(headers: &std::collections::HashMap<String, String>) -> Vec<&str> {
    let mut names: Vec<&str> = headers.keys().map(String::as_str).collect();
    names.sort_unstable();
    names
}

impl fmt::Debug for relay::tenant::v1::CreateWebhookEndpointRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreateWebhookEndpointRequest")
            .field("url", &self.url)
            .field("event_types", &self.event_types)
            .field("signature_scheme", &self.signature_scheme)
            .field("headers", &header_names(&self.headers))
            .field("max_in_flight", &self.max_in_flight)
            .field("filter", &self.filter)
            .field("rate_limit", &self.rate_limit)
            .field("client_certificate_len", &self.client_certificate.len())
            .field("client_key", &REDACTED)
            .field("ca_bundle_len", &self.ca_bundle.len())
            .field("oauth2", &self.oauth2)
            .finish()
    }
}

impl fmt::Debug for relay::tenant::v1::UpdateWebhookEndpointRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpdateWebhookEndpointRequest")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("event_types", &self.event_types)
            .field("signature_scheme", &self.signature_scheme)
            .field("headers", &header_names(&self.headers))
            .field("clear_headers", &self.clear_headers)
            .field("max_in_flight", &self.max_in_flight)
            .field("filter", &self.filter)
            .field("clear_filter", &self.clear_filter)
            .field("rate_limit", &self.rate_limit)
            .field("clear_rate_limit", &self.clear_rate_limit)
            .field("client_certificate_len", &self.client_certificate.len())
            .field("client_key", &REDACTED)
            .field("clear_client_certificate", &self.clear_client_certificate)
            .field("end_client_certificate_overlap", &self.end_client_certificate_overlap)
            .field("ca_bundle_len", &self.ca_bundle.len())
            .field("clear_ca_bundle", &self.clear_ca_bundle)
            .field("oauth2", &self.oauth2)
            .field("clear_oauth2", &self.clear_oauth2)
            .finish()
    }
}

impl fmt::Debug for relay::tenant::v1::CreateWebhookEndpointResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreateWebhookEndpointResponse").field("endpoint", &self.endpoint).field("secret", &REDACTED).finish()
    }
}

impl fmt::Debug for relay::tenant::v1::RotateWebhookEndpointSecretResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RotateWebhookEndpointSecretResponse").field("endpoint", &self.endpoint).field("secret", &REDACTED).finish()
    }
}

impl fmt::Debug for relay::tenant::v1::ListenReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenReady")
            .field("endpoint_id", &self.endpoint_id)
            .field("secret", &REDACTED)
            .field("signature_scheme", &self.signature_scheme)
            .finish()
    }
}

impl fmt::Debug for relay::tenant::v1::CreatePortalSessionResponse {
    /// The link carries the one-time token.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreatePortalSessionResponse").field("url", &REDACTED).field("expires_at", &self.expires_at).finish()
    }
}

impl fmt::Debug for relay::admin::v1::CreateApiKeyResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreateApiKeyResponse").field("api_key", &self.api_key).field("key", &REDACTED).finish()
    }
}

impl fmt::Debug for relay::dispatch::v1::MaterialResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MaterialResponse")
            .field("delivery_id", &self.delivery_id)
            .field("endpoint_id", &self.endpoint_id)
            .field("environment_id", &self.environment_id)
            .field("event_id", &self.event_id)
            .field("url", &self.url)
            .field("attempt", &self.attempt)
            .field("secrets", &format_args!("[{} redacted]", self.secrets.len()))
            .field("headers", &header_names(&self.headers))
            .field("client_identity", &if self.client_identity_pem.is_empty() { "none" } else { REDACTED })
            .field("previous_client_identity", &if self.previous_client_identity_pem.is_empty() { "none" } else { REDACTED })
            .field("ca_bundle_len", &self.ca_bundle.len())
            .field("oauth2", &self.oauth2)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// OAuth2 client credentials, tenant-side and seam-side: the secret redacted.
macro_rules! oauth2_debug {
    ($t:ty) => {
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct("OAuth2ClientCredentials")
                    .field("token_url", &self.token_url)
                    .field("client_id", &self.client_id)
                    .field("client_secret", &REDACTED)
                    .field("scope", &self.scope)
                    .field("audience", &self.audience)
                    .finish()
            }
        }
    };
}
oauth2_debug!(relay::tenant::v1::OAuth2ClientCredentials);
oauth2_debug!(relay::dispatch::v1::OAuth2ClientCredentials);

#[cfg(test)]
mod tests {
    use super::relay::dispatch::v1::MaterialResponse;

    #[test]
    fn material_debug_never_shows_a_secret() {
        let m = MaterialResponse {
            secrets: vec!["whsec-very-secret".into()],
            client_identity_pem: "-----BEGIN PRIVATE KEY-----current".into(),
            previous_client_identity_pem: "-----BEGIN PRIVATE KEY-----previous".into(),
            ..Default::default()
        };
        let shown = format!("{m:?}");
        assert!(!shown.contains("whsec-very-secret") && !shown.contains("PRIVATE"), "{shown}");
        assert!(shown.contains("1 redacted"), "{shown}");
    }
}

/// Stream, subject and durable names: one definition for the side that
/// publishes and the side that consumes, so a rename cannot leave a consumer
/// silently reading nothing. The prefix keeps tests and local stacks that
/// share one NATS server apart; production uses none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamNames {
    prefix: String,
}

impl StreamNames {
    /// `prefix` may hold letters, digits, `_` and `-` only, since it becomes
    /// part of stream names and subject tokens.
    pub fn new(prefix: &str) -> Result<Self, String> {
        if prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            Ok(Self { prefix: prefix.to_owned() })
        } else {
            Err(format!("stream prefix {prefix:?} may hold only letters, digits, '_' and '-'"))
        }
    }

    pub fn events_stream(&self) -> String {
        format!("{}EVENTS", self.prefix)
    }

    pub fn events_subject(&self, environment_id: &str) -> String {
        format!("{}events.{environment_id}", self.prefix)
    }

    pub fn all_events(&self) -> String {
        format!("{}events.>", self.prefix)
    }

    pub fn deliveries_stream(&self) -> String {
        format!("{}DELIVERIES", self.prefix)
    }

    pub fn deliveries_subject(&self, environment_id: &str) -> String {
        format!("{}deliveries.{environment_id}", self.prefix)
    }

    pub fn all_deliveries(&self) -> String {
        format!("{}deliveries.>", self.prefix)
    }

    pub fn expand_durable(&self) -> String {
        format!("{}dispatcher-expand", self.prefix)
    }

    pub fn deliver_durable(&self) -> String {
        format!("{}dispatcher-deliver", self.prefix)
    }

    /// The core-NATS subject on which one dispatcher (by its claimant id)
    /// hears that attempts it holds were switched off
    /// (`relay.queue.v1.SwitchedOff`).
    pub fn switched_off_subject(&self, claimant: &str) -> String {
        format!("{}switched-off.{claimant}", self.prefix)
    }

    /// The core-NATS subject on which the api holding a `listen`
    /// endpoint's listener takes its attempts (`relay.queue.v1.ListenAttempt`).
    pub fn listen_subject(&self, endpoint_id: &str) -> String {
        format!("{}listen.{endpoint_id}", self.prefix)
    }

    /// The broker message id of one event. Event ids are chosen by tenants and
    /// unique per environment, so the environment is part of the id.
    pub fn event_message_id(environment_id: &str, event_id: &str) -> String {
        format!("{environment_id}:{event_id}")
    }
}

/// One attempt of one delivery, as both ends of the queue name it: the
/// broker message id of its job (a re-publish of the same attempt is
/// recognisable and dropped inside the duplicate window; a new attempt, or a
/// replay's attempt, is new work) and the dispatcher's key for the attempts
/// it has in hand. One spelling, `delivery:attempt`, with `:rG` for a
/// replay's generation G (so ids from before replays existed still match).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AttemptKey {
    pub delivery_id: String,
    pub generation: u32,
    pub attempt: u32,
}

impl AttemptKey {
    pub fn of(job: &relay::queue::v1::DeliveryJob) -> Self {
        Self { delivery_id: job.delivery_id.clone(), generation: job.generation, attempt: job.attempt }
    }
}

impl fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.generation {
            0 => write!(f, "{}:{}", self.delivery_id, self.attempt),
            g => write!(f, "{}:{}:r{g}", self.delivery_id, self.attempt),
        }
    }
}

#[cfg(test)]
mod attempt_key_tests {
    use super::AttemptKey;

    #[test]
    fn one_spelling_for_every_attempt_and_generation() {
        let key = |generation, attempt| AttemptKey { delivery_id: "d".into(), generation, attempt }.to_string();
        assert_eq!(key(0, 1), "d:1");
        assert_eq!(key(2, 7), "d:7:r2");
        assert_ne!(key(0, 1), key(1, 1), "a replay's attempt is new work");
    }
}

/// NATS headers on an EVENTS message, beside the envelope body.
pub mod event_headers {
    pub const ENVIRONMENT_ID: &str = "relay-environment-id";
    pub const EVENT_TYPE: &str = "relay-event-type";
}

/// Platform identities, carried as URI SANs in client certificates on the
/// api's internal mTLS port.
pub mod identity {
    /// The dispatcher: may call DispatchService, nothing else.
    pub const DISPATCHER: &str = "spiffe://relay.internal/dispatcher";
    /// Operators (`…/operator/<name>`): may call AdminService, nothing else.
    pub const OPERATOR_PREFIX: &str = "spiffe://relay.internal/operator/";
}
