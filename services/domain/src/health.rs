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
pub struct Standing {
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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn after_ms(at: Timestamp, ms: i64) -> Timestamp {
    at + chrono::Duration::milliseconds(ms)
}

impl FailureWindow {
    fn bucket_of(&self, at: Timestamp) -> i64 {
        at.timestamp_millis().div_euclid(self.length_ms.max(1))
    }

    /// Moves the buckets on to `at`'s (a result stamped earlier than the
    /// current bucket, from another api's clock, counts in the current one).
    /// A window kept under another length starts again.
    fn roll(&mut self, at: Timestamp, window: Duration) {
        if self.length_ms != millis(window) {
            *self = Self { length_ms: millis(window).max(1), ..Self::default() };
        }
        let bucket = self.bucket_of(at);
        if bucket <= self.bucket {
            return;
        }
        (self.previous_attempts, self.previous_failures) = if bucket == self.bucket + 1 { (self.attempts, self.failures) } else { (0, 0) };
        (self.attempts, self.failures, self.bucket) = (0, 0, bucket);
    }

    fn count(&mut self, at: Timestamp, window: Duration, failed: bool) {
        self.roll(at, window);
        self.attempts = self.attempts.saturating_add(1);
        if failed {
            self.failures = self.failures.saturating_add(1);
        }
    }

    /// Attempts and failures over the window that ends at `at`: the current
    /// bucket's, and the previous one's weighed by how much of it is still
    /// inside the window.
    pub fn estimate(&self, at: Timestamp) -> (f64, f64) {
        let length = self.length_ms.max(1);
        let bucket = self.bucket_of(at);
        let (current, previous) = match bucket - self.bucket {
            i64::MIN..=0 => ((self.attempts, self.failures), (self.previous_attempts, self.previous_failures)),
            1 => ((0, 0), (self.attempts, self.failures)),
            _ => ((0, 0), (0, 0)),
        };
        let into = at.timestamp_millis().rem_euclid(length) as f64 / length as f64;
        let weight = if bucket < self.bucket { 1.0 } else { (1.0 - into).clamp(0.0, 1.0) };
        (current.0 as f64 + previous.0 as f64 * weight, current.1 as f64 + previous.1 as f64 * weight)
    }

    /// Attempts and failures over the window, rounded, as a tenant reads them.
    pub fn recent(&self, at: Timestamp) -> (u32, u32) {
        let (attempts, failures) = self.estimate(at);
        (attempts.round() as u32, failures.round() as u32)
    }

    /// No failure inside the window that ends at `at`.
    pub fn is_clean(&self, at: Timestamp) -> bool {
        self.estimate(at).1 == 0.0
    }
}

impl Standing {
    /// Whether the endpoint looks down at `at`, by the policy's evidence.
    fn looks_down(&self, at: Timestamp, policy: &CircuitPolicy) -> bool {
        let h = &self.health;
        let quiet = chrono::Duration::from_std(policy.quiet).unwrap_or(chrono::Duration::MAX);
        let (attempts, failures) = h.window.estimate(at);
        policy.enabled
            && h.failing_since.is_some_and(|since| at - since >= quiet)
            && h.failed_retries >= policy.min_failed_retries as i32
            && attempts >= f64::from(policy.min_attempts)
            && failures * 1000.0 >= attempts * f64::from(policy.failure_permille)
    }

    /// The endpoint after `seen` at `at`, one result at a time.
    fn observe_one(mut self, seen: Seen, at: Timestamp, policy: &CircuitPolicy, disable: &DisablePolicy, effects: &mut Effects) -> Self {
        let h = &mut self.health;
        match seen {
            // Counts neither way: the dispatcher slows down as asked.
            Seen::Throttled => return self,
            Seen::Success => {
                h.window.count(at, policy.window, false);
                h.consecutive_failures = 0;
                h.failing_since = None;
                h.failed_retries = 0;
                h.one_at_a_time = false;
                h.last_success_at = Some(at);
                if self.disabled == Some(DisabledReason::Failing) {
                    self.disabled = None;
                }
                // A tenant's or receiver's disable stands; only the counters move.
                if self.disabled.is_none() {
                    match h.circuit {
                        Circuit::Open | Circuit::HalfOpen => {
                            h.circuit = Circuit::Recovering;
                            h.next_probe_at = Some(after_ms(at, millis(policy.release_tick())));
                            h.probe_interval_ms = 0;
                            effects.recover = true;
                            effects.release = effects.release.saturating_add(RELEASED_PER_SUCCESS);
                        }
                        Circuit::Recovering => effects.release = effects.release.saturating_add(RELEASED_PER_SUCCESS),
                        Circuit::Closed => {}
                    }
                }
                return self;
            }
            Seen::Failure { retry } | Seen::Unanswered { retry } => {
                if retry {
                    h.failed_retries = h.failed_retries.saturating_add(1);
                }
                // Failing costs the lane: each attempt waits out a timeout,
                // or retrying does not help. The backlog then waits in
                // Postgres, handed out one at a time, not queued in a lane.
                if matches!(seen, Seen::Unanswered { .. }) || h.failed_retries >= policy.min_failed_retries as i32 {
                    h.one_at_a_time = true;
                }
            }
            Seen::Gone => {}
        }
        h.window.count(at, policy.window, true);
        h.consecutive_failures = h.consecutive_failures.saturating_add(1);
        h.failing_since.get_or_insert(at);
        h.last_failure_at = Some(at);
        let first = millis(policy.first_probe);
        if seen == Seen::Gone {
            if self.disabled != Some(DisabledReason::Manual) {
                self.disabled = Some(DisabledReason::Gone);
                h.circuit = Circuit::Open;
                // The receiver said so: nothing is sent until the tenant
                // enables the endpoint again.
                h.next_probe_at = None;
            }
            return self;
        }
        let down = self.looks_down(at, policy);
        let h = &mut self.health;
        match h.circuit {
            Circuit::Closed | Circuit::Recovering if down => {
                h.circuit = Circuit::Open;
                h.probe_interval_ms = first;
                h.next_probe_at = Some(after_ms(at, first));
                effects.opened = true;
            }
            Circuit::HalfOpen => {
                h.circuit = Circuit::Open;
                h.probe_interval_ms = (h.probe_interval_ms.saturating_mul(2)).clamp(first, millis(policy.max_probe).max(first));
                h.next_probe_at = Some(after_ms(at, h.probe_interval_ms));
            }
            // Open: a result of an attempt sent before the circuit opened.
            _ => {}
        }
        let failing_for = h.failing_since.map(|since| at - since).and_then(|d| d.to_std().ok()).unwrap_or_default();
        if self.disabled.is_none() && failing_for >= disable.after && h.consecutive_failures >= disable.min_failures as i32 {
            self.disabled = Some(DisabledReason::Failing);
            if !h.circuit.holds() {
                h.circuit = Circuit::Open;
                h.probe_interval_ms = h.probe_interval_ms.max(first);
                h.next_probe_at = Some(after_ms(at, h.probe_interval_ms));
            }
        }
        self
    }

    /// The endpoint after a batch of results, in the order they happened,
    /// and what that does to its deliveries.
    pub fn observe(self, seen: &[(Seen, Timestamp)], policy: &CircuitPolicy, disable: &DisablePolicy) -> (Self, Effects) {
        let mut effects = Effects::default();
        let after = seen.iter().fold(self, |s, &(seen, at)| s.observe_one(seen, at, policy, disable, &mut effects));
        let unsent_again = seen.iter().any(|(s, _)| !s.is_success());
        effects.hold = after.health.circuit.holds() && unsent_again;
        // Opened again within the batch: nothing goes back after all.
        if after.health.circuit.holds() {
            (effects.recover, effects.release) = (false, 0);
        }
        effects.disable = after.disabled.filter(|_| after.disabled != self.disabled);
        effects.enable = self.disabled.is_some() && after.disabled.is_none();
        // A disable opens the circuit too; announced as the disable.
        effects.opened &= after.disabled.is_none();
        (after, effects)
    }

    /// After a failed probe, the next one comes no later than the earliest
    /// held retry falls due (`held_retry_due`, a due time later than `at`),
    /// though never sooner than the first probe's wait: each retry the
    /// schedule would have made while the circuit is open meets a probe
    /// soon after its time, and a receiver that answers again is found then.
    pub fn probe_by_held_retry(mut self, at: Timestamp, held_retry_due: Option<Timestamp>, policy: &CircuitPolicy) -> Self {
        let h = &mut self.health;
        if let (Circuit::Open, Some(next), Some(due)) = (h.circuit, h.next_probe_at, held_retry_due) {
            h.next_probe_at = Some(next.min(due.max(after_ms(at, millis(policy.first_probe)))));
        }
        self
    }

    /// Whether the prober should look at this endpoint at `at`.
    pub fn probe_due(&self, at: Timestamp) -> bool {
        self.health.circuit != Circuit::Closed
            && self.health.next_probe_at.is_some_and(|next| next <= at)
            && self.disabled.is_none_or(|d| d == DisabledReason::Failing)
    }

    /// The prober's step for an endpoint whose probe is due, given its held
    /// delivery to probe or wait for (`held`: when it falls due; the one
    /// with most attempts among the due ones, else the first to fall due).
    /// Open or half-open: a due one is sent as the probe and the circuit
    /// waits half-open for the result; one not yet due is waited for, so a
    /// probe never spends an attempt before the schedule would; with
    /// nothing held an enabled endpoint's circuit closes and a disabled one
    /// waits another interval. Recovering: `RELEASED_PER_TICK` more go back
    /// at each tick while anything is held; then it closes.
    pub fn probe(mut self, at: Timestamp, held: Option<Timestamp>, policy: &CircuitPolicy) -> (Self, ProbeStep) {
        let h = &mut self.health;
        let step = match (h.circuit, held) {
            (Circuit::Recovering, Some(_)) => {
                h.next_probe_at = Some(after_ms(at, millis(policy.release_tick())));
                ProbeStep::Release(RELEASED_PER_TICK)
            }
            (_, Some(due)) if due <= at => {
                h.circuit = Circuit::HalfOpen;
                h.next_probe_at = Some(after_ms(at, h.probe_interval_ms.max(millis(policy.probe_guard))));
                ProbeStep::Probe
            }
            (Circuit::Recovering, None) => {
                (h.circuit, h.next_probe_at) = (Circuit::Closed, None);
                ProbeStep::Closed
            }
            (_, Some(due)) => {
                h.next_probe_at = Some(due);
                ProbeStep::Wait
            }
            (_, None) if self.disabled.is_none() => {
                (h.circuit, h.next_probe_at) = (Circuit::Closed, None);
                ProbeStep::Closed
            }
            (_, None) => {
                h.next_probe_at = Some(after_ms(at, h.probe_interval_ms.max(millis(policy.first_probe))));
                ProbeStep::Wait
            }
        };
        (self, step)
    }
}

/// What the prober does for an endpoint whose probe is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeStep {
    /// Send the held delivery it was given as the probe.
    Probe,
    /// Release this many due held deliveries (recovering).
    Release(u32),
    /// The circuit closed: release whatever is still held.
    Closed,
    /// Nothing to do before `next_probe_at`.
    Wait,
}

#[cfg(test)]
mod tests;
