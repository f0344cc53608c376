//! The rows the api stores and reads, as Rust types: what `db` returns and
//! the use-cases and adapters take. States and decisions are enums with one
//! spelling each; the rules that move between them are in `app::state`.

pub use relay_domain::{
    Timestamp,
    delivery::{Decision, DeliveryState},
    health::{Circuit, DisabledReason, EndpointHealth, FailureWindow},
};

/// An endpoint's stored `signature_scheme`, read. The column's CHECK allows
/// only known names; one this build does not know means a newer schema.
pub fn stored_scheme(endpoint_id: Uuid, stored: &str) -> anyhow::Result<relay_signing::Scheme> {
    relay_signing::Scheme::parse(stored)
        .ok_or_else(|| anyhow::anyhow!("endpoint {endpoint_id} has signature scheme {stored:?}, which this api does not know"))
}
use uuid::Uuid;

#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub id: Uuid,
    pub delivery_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub reason: String,
    pub dead_lettered_at: Timestamp,
    /// Its delivery is no longer dead: replayed (or recovered) since. The
    /// record stays as the evidence that the attempts once ran out.
    pub replayed: bool,
}

#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: Uuid,
    pub event_id: Uuid,
    pub endpoint_id: Uuid,
    pub state: DeliveryState,
    pub attempt: i32,
    pub next_attempt_at: Timestamp,
    pub created_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub generation: i32,
    pub attempts: Vec<Attempt>,
}

/// One row of the attempt log.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub delivery_id: Uuid,
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
    pub id: Uuid,
    pub url: String,
    pub event_types: Vec<String>,
    pub enabled: bool,
    /// Why it is disabled; `None` exactly when enabled.
    pub disabled_reason: Option<DisabledReason>,
    pub created_at: Timestamp,
    pub secret_rotated_at: Option<Timestamp>,
    pub signature_scheme: relay_signing::Scheme,
    /// `whpk_…`, under the ed25519 scheme.
    pub public_key: Option<String>,
    /// The previous public key, while its rotation window lasts.
    pub previous_public_key: Option<String>,
    pub signature_scheme_changed_at: Option<Timestamp>,
    pub health: EndpointHealth,
    /// Deliveries held for this endpoint's recovery.
    pub held: i64,
}

#[derive(Debug, Clone)]
pub struct Environment {
    pub id: Uuid,
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
