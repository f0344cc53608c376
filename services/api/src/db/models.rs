//! The rows the api stores and reads, as Rust types: what `db` returns and
//! the use-cases and adapters take. States and decisions are enums with one
//! spelling each; the rules that move between them are in `app::state`.

use chrono::{DateTime, Utc};

/// How long a rotated-out secret (or key pair) keeps signing. A promise
/// recipients code against, not a tuning knob.
pub const ROTATION_WINDOW: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// An endpoint's stored `signature_scheme`, read. The column's CHECK allows
/// only known names; one this build does not know means a newer schema.
pub fn stored_scheme(endpoint_id: Uuid, stored: &str) -> anyhow::Result<relay_signing::Scheme> {
    relay_signing::Scheme::parse(stored)
        .ok_or_else(|| anyhow::anyhow!("endpoint {endpoint_id} has signature scheme {stored:?}, which this api does not know"))
}
use uuid::Uuid;

pub type Timestamp = DateTime<Utc>;

/// Where a delivery stands. Stored as checked text (`webhook_deliveries.state`,
/// CHECK constraint in the first migration); these spellings are the only
/// ones the Rust code writes or reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum DeliveryState {
    /// Due at `next_attempt_at`, or leased to the broker for its current attempt.
    Pending,
    /// Waiting for its endpoint to recover (circuit open, or disabled as
    /// `gone` or `failing`): no relay pass looks at it. Released to pending
    /// in order when the endpoint recovers; the oldest is sent as the probe.
    Held,
    /// An attempt got a 2xx. Final.
    Delivered,
    /// The attempts ran out, or the endpoint was switched off; a dead letter
    /// holds the record. Final until replayed.
    Dead,
}

impl DeliveryState {
    pub const ALL: [Self; 4] = [Self::Pending, Self::Held, Self::Delivered, Self::Dead];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Held => "held",
            Self::Delivered => "delivered",
            Self::Dead => "dead",
        }
    }
}

/// What recording one attempt did to its delivery: the seam's answer to an
/// outcome, and the attempt log's `decision` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Delivered,
    Rescheduled { next_attempt_at: Timestamp },
    DeadLettered,
}

impl Decision {
    /// `as_str` of a reschedule.
    pub const RESCHEDULED: &'static str = "rescheduled";

    /// The delivery's state once this decision is applied.
    pub fn state(&self) -> DeliveryState {
        match self {
            Self::Delivered => DeliveryState::Delivered,
            Self::Rescheduled { .. } => DeliveryState::Pending,
            Self::DeadLettered => DeliveryState::Dead,
        }
    }

    /// The delivery's attempt number once this decision is applied to `attempt`.
    pub fn next_attempt(&self, attempt: u32) -> u32 {
        match self {
            Self::Rescheduled { .. } => attempt + 1,
            _ => attempt,
        }
    }

    pub fn next_attempt_at(&self) -> Option<Timestamp> {
        match self {
            Self::Rescheduled { next_attempt_at } => Some(*next_attempt_at),
            _ => None,
        }
    }

    /// The attempt log's spelling (and the metrics label).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Rescheduled { .. } => Self::RESCHEDULED,
            Self::DeadLettered => "dead_lettered",
        }
    }

    /// Reads back what `as_str` (and `next_attempt_at`) stored.
    pub fn from_log(decision: &str, next_attempt_at: Option<Timestamp>) -> Option<Self> {
        match (decision, next_attempt_at) {
            ("delivered", _) => Some(Self::Delivered),
            (Self::RESCHEDULED, Some(next_attempt_at)) => Some(Self::Rescheduled { next_attempt_at }),
            ("dead_lettered", _) => Some(Self::DeadLettered),
            _ => None,
        }
    }

    /// How a report that changes nothing is answered: with where the
    /// delivery stands now.
    pub fn standing(state: DeliveryState, next_attempt_at: Timestamp) -> Self {
        match state {
            DeliveryState::Delivered => Self::Delivered,
            DeliveryState::Dead => Self::DeadLettered,
            DeliveryState::Pending | DeliveryState::Held => Self::Rescheduled { next_attempt_at },
        }
    }
}

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

/// Why an endpoint is disabled (`webhook_endpoints.disabled_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum DisabledReason {
    /// The tenant disabled it: its pending deliveries became dead letters
    /// and new events are not delivered to it.
    Manual,
    /// The receiver answered 410 Gone: matching deliveries are held, and no
    /// probe is sent; enabling it releases them.
    Gone,
    /// Every attempt failed for the environment's window: matching
    /// deliveries are held and probed; the first success re-enables it.
    Failing,
}

impl DisabledReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Manual => "manual",
            Self::Gone => "gone",
            Self::Failing => "failing",
        }
    }

    /// Disabled by Relay, not the tenant: matching deliveries are held.
    pub fn holds(self) -> bool {
        matches!(self, Self::Gone | Self::Failing)
    }
}

/// An endpoint's circuit (`endpoint_health.circuit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum Circuit {
    /// Attempts flow, up to the endpoint's in-flight cap.
    Closed,
    /// Failing: deliveries are held; one is sent as a probe at `next_probe_at`.
    Open,
    /// A probe is on its way; its success starts the recovery, its failure
    /// re-opens the circuit.
    HalfOpen,
    /// A probe succeeded: new deliveries flow, and the held ones go back as
    /// the receiver's answers come in (two more for each success); closed
    /// once nothing is held.
    Recovering,
}

impl Circuit {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
            Self::Recovering => "recovering",
        }
    }

    /// Whether deliveries of the endpoint are held (written held by an
    /// expansion, held again after a failed attempt).
    pub fn holds(self) -> bool {
        matches!(self, Self::Open | Self::HalfOpen)
    }
}

/// An endpoint's recent attempts as the circuit counts them: two aligned
/// buckets of the window's length (`length_ms`, kept with the counts so a
/// read needs no settings), the current one numbered `bucket` (epoch ms /
/// length). Counted from the first failure on: while no failure is inside
/// the window, successes are not counted (the rules in `app::health`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailureWindow {
    pub length_ms: i64,
    pub bucket: i64,
    pub attempts: i32,
    pub failures: i32,
    pub previous_attempts: i32,
    pub previous_failures: i32,
}

/// An endpoint's health: its circuit and the run of results behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointHealth {
    pub circuit: Circuit,
    pub consecutive_failures: i32,
    pub failing_since: Option<Timestamp>,
    pub last_success_at: Option<Timestamp>,
    pub last_failure_at: Option<Timestamp>,
    pub next_probe_at: Option<Timestamp>,
    pub probe_interval_ms: i64,
    pub window: FailureWindow,
    /// Failed attempts after a delivery's first, in the current run of
    /// failures: evidence that retrying does not help either.
    pub failed_retries: i32,
    /// Handed one attempt at a time instead of its in-flight cap: failing
    /// costs its lane (see `app::health`).
    pub one_at_a_time: bool,
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
