//! An endpoint's health, in one place: the circuit, automatic disabling, and
//! what each change does to the endpoint's deliveries. Pure, like `state`:
//! the outcome path and the prober store what this decides.
//!
//! The circuit exists to keep a dead endpoint from costing anyone else, and
//! must never decide on its own that a working receiver gets nothing. So it
//! opens on evidence that the endpoint is down, not unlucky: over the
//! window (2 minutes), at least `min_attempts` attempts of which at least
//! `failure_permille` failed, no success for `quiet` (30 s), and at least
//! `min_failed_retries` of the failures retries (a receiver that refuses
//! each webhook's first request and accepts its retry never opens it, however
//! large the burst). Back-pressure — a 429, or a 503 with `Retry-After` — is
//! not failure: it slows the endpoint (the dispatcher waits as asked), and
//! counts neither way.
//!
//! Short of opening, an endpoint whose failures cost its lane — the last one
//! went unanswered (a timeout, a refused connection), or its retries fail
//! too — is handed one attempt at a time instead of its in-flight cap, until
//! a success; a fast 5xx from a receiver that fails sometimes does not
//! narrow it.
//!
//! ```text
//!   closed | recovering ──evidence of down──► open (pending deliveries held)
//!   open ──next_probe_at, a held delivery due──► half_open (the due one with most attempts sent)
//!   open ──next_probe_at, nothing held, enabled──► closed
//!   half_open ──failure──► open (next probe: the interval doubled, or sooner when a held retry falls due)
//!   open | half_open ──success──► recovering (held ones not yet due go back; due ones two per success)
//!   recovering ──nothing held──► closed
//!   any ──410──► open, disabled `gone` (held, never probed)
//!   enabled ──failures for the environment's window, and at least its count──► disabled `failing` (held, probed)
//! ```
//!
//! A held delivery keeps its attempt number and due time: when it comes back
//! it is attempted as the retry it was, and the dead-letter rule counts as
//! without the circuit.

use std::time::Duration;

use crate::Timestamp;

/// Why an endpoint is disabled (`webhook_endpoints.disabled_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(type_name = "text", rename_all = "lowercase"))]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(type_name = "text", rename_all = "snake_case"))]
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
/// the window, successes are not counted (the rules in `relay_domain::health`).
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
    /// costs its lane (see `relay_domain::health`).
    pub one_at_a_time: bool,
}

/// The platform's circuit settings.
#[derive(Debug, Clone, Copy)]
pub struct CircuitPolicy {
    /// Off: the circuit never opens (a development switch, to compare a
    /// run with the plain retry schedule; production refuses it).
    pub enabled: bool,
    /// The sliding window the failure rate is measured over.
    pub window: Duration,
    /// Opening needs at least this many attempts in the window…
    pub min_attempts: u32,
    /// …at least this share of them failed, in thousandths…
    pub failure_permille: u32,
    /// …no success for this long…
    pub quiet: Duration,
    /// …and at least this many failed retries in the current run.
    pub min_failed_retries: u32,
    /// The wait before the first probe; doubled after each failed probe, up
    /// to `max_probe`. Also the shortest wait between two probes.
    pub first_probe: Duration,
    pub max_probe: Duration,
    /// How long a half-open circuit waits for its probe's result before it
    /// sends another (the probe may have been lost with a crashed process).
    pub probe_guard: Duration,
}

impl CircuitPolicy {
    pub const PRODUCTION_PROBES: (Duration, Duration) = (Duration::from_secs(10), Duration::from_secs(600));

    /// The production rule, with the given probe guard.
    pub const fn production(probe_guard: Duration) -> Self {
        Self {
            enabled: true,
            window: Duration::from_secs(120),
            min_attempts: 20,
            failure_permille: 900,
            quiet: Duration::from_secs(30),
            min_failed_retries: 5,
            first_probe: Self::PRODUCTION_PROBES.0,
            max_probe: Self::PRODUCTION_PROBES.1,
            probe_guard,
        }
    }

    /// How often the prober looks at a recovering endpoint: the floor of its
    /// release when no answer comes back to pace it.
    pub fn release_tick(&self) -> Duration {
        self.first_probe.min(Duration::from_secs(1))
    }
}

/// Held deliveries a success of a recovering endpoint releases: the release
/// doubles what is in flight each round trip while the receiver succeeds,
/// and stops growing when it fails.
pub const RELEASED_PER_SUCCESS: u32 = 2;
/// Held deliveries the prober releases at each tick of a recovering
/// endpoint, whatever the answers (so a release whose attempts all failed
/// still moves on, at the failures' pace).
pub const RELEASED_PER_TICK: u32 = 2;

/// An environment's rule for disabling a failing endpoint: every attempt
/// failed for `after`, and at least `min_failures` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisablePolicy {
    pub after: Duration,
    pub min_failures: u32,
}

impl Default for DisablePolicy {
    fn default() -> Self {
        Self { after: Duration::from_secs(24 * 3600), min_failures: 10 }
    }
}

/// What an attempt's result says about its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Success,
    /// A failure with an answer (a status that is not 2xx, 410 or
    /// back-pressure). `retry`: the attempt was not the delivery's first.
    Failure {
        retry: bool,
    },
    /// A failure without an answer: a timeout, a connection refused or
    /// reset. It held the endpoint's lane for as long as it took.
    Unanswered {
        retry: bool,
    },
    /// 410: the receiver says the endpoint is gone for good.
    Gone,
    /// 429, or 503 with `Retry-After`: the receiver asks to be sent less,
    /// which says nothing about whether it is up.
    Throttled,
}

impl Seen {
    pub fn of(http_status: Option<u32>, retry_after: Option<Duration>, attempt: u32) -> Self {
        match http_status {
            _ if crate::delivery::is_success(http_status) => Self::Success,
            Some(410) => Self::Gone,
            Some(429) => Self::Throttled,
            Some(503) if retry_after.is_some() => Self::Throttled,
            None => Self::Unanswered { retry: attempt > 1 },
            _ => Self::Failure { retry: attempt > 1 },
        }
    }

    pub fn is_success(self) -> bool {
        self == Self::Success
    }
}

/// An endpoint as the health rules read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointStanding {
    pub health: EndpointHealth,
    pub disabled: Option<DisabledReason>,
}

/// What a change of health does beyond the health row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Effects {
    /// Hold the endpoint's pending deliveries (its circuit is open).
    pub hold: bool,
    /// It opened from closed or recovering (announced as failing).
    pub opened: bool,
    /// It started recovering: the held deliveries not yet due go back to
    /// pending with their due times (the schedule paces those).
    pub recover: bool,
    /// Held deliveries due now to release, in the order they fell due.
    pub release: u32,
    /// Disable it, for this reason.
    pub disable: Option<DisabledReason>,
    /// Re-enable it (it was disabled as `failing` and an attempt succeeded).
    pub enable: bool,
}

impl EndpointHealth {
    pub fn new() -> Self {
        Self {
            circuit: Circuit::Closed,
            consecutive_failures: 0,
            failing_since: None,
            last_success_at: None,
            last_failure_at: None,
            next_probe_at: None,
            probe_interval_ms: 0,
            window: FailureWindow::default(),
            failed_retries: 0,
            one_at_a_time: false,
        }
    }

    /// A closed circuit with nothing to watch: its last result a success and
    /// no failure inside the window. Successes of such an endpoint change
    /// nothing the rules read, so the outcome path writes none of them.
    pub fn is_plainly_healthy(&self, at: Timestamp, policy: &CircuitPolicy) -> bool {
        self.circuit == Circuit::Closed
            && self.consecutive_failures == 0
            && (self.window.length_ms != millis(policy.window) || self.window.is_clean(at))
    }
}

impl Default for EndpointHealth {
    fn default() -> Self {
        Self::new()
    }
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn after_ms(at: Timestamp, ms: i64) -> Timestamp {
    at + chrono::Duration::milliseconds(ms)
}

mod rules;
mod window;

pub use rules::ProbeStep;

#[cfg(test)]
mod tests;
