//! An endpoint's health, in one place: the circuit (closed → open after a
//! run of failures → half-open while a probe is on its way), automatic
//! disabling, and what each change does to the endpoint's deliveries. Pure,
//! like `state`: the outcome path and the prober store what this decides.
//!
//! ```text
//!   closed ──`open_after` consecutive failures──► open (deliveries held)
//!   open ──next_probe_at, a held delivery──► half_open (the oldest one sent)
//!   open ──next_probe_at, nothing held, enabled──► closed (the next failure re-opens)
//!   half_open ──failure──► open (probe interval doubled, up to the maximum)
//!   any ──success──► closed (held deliveries released; `failing` re-enabled)
//!   any ──410──► open, disabled `gone` (held, never probed)
//!   enabled ──failures for the environment's window, and at least its count──► disabled `failing` (held, probed)
//! ```

use std::time::Duration;

use crate::db::models::Timestamp;
pub use crate::db::models::{Circuit, DisabledReason, EndpointHealth};

/// The platform's circuit settings.
#[derive(Debug, Clone, Copy)]
pub struct CircuitPolicy {
    /// Consecutive failures that open a closed circuit.
    pub open_after: u32,
    /// The wait before the first probe; doubled after each failed probe.
    pub first_probe: Duration,
    pub max_probe: Duration,
    /// How long a half-open circuit waits for its probe's result before it
    /// sends another (the probe may have been lost with a crashed process).
    pub probe_guard: Duration,
}

impl CircuitPolicy {
    pub const PRODUCTION_PROBES: (Duration, Duration) = (Duration::from_secs(60), Duration::from_secs(3600));
}

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
    Failure,
    /// 410: the receiver says the endpoint is gone for good.
    Gone,
}

impl Seen {
    pub fn of(http_status: Option<u32>) -> Self {
        match http_status {
            _ if super::state::is_success(http_status) => Self::Success,
            Some(410) => Self::Gone,
            _ => Self::Failure,
        }
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
    /// Hold the endpoint's pending deliveries (its circuit is not closed).
    pub hold: bool,
    /// Release its held deliveries (it recovered).
    pub release: bool,
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
        }
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

impl Standing {
    /// The endpoint after `seen` at `at`, one result at a time.
    fn observe_one(mut self, seen: Seen, at: Timestamp, policy: &CircuitPolicy, disable: &DisablePolicy) -> Self {
        let h = &mut self.health;
        if seen == Seen::Success {
            h.consecutive_failures = 0;
            h.failing_since = None;
            h.last_success_at = Some(at);
            if self.disabled == Some(DisabledReason::Failing) {
                self.disabled = None;
            }
            // A tenant's or receiver's disable stands; only the counters move.
            if self.disabled.is_none() {
                h.circuit = Circuit::Closed;
                h.next_probe_at = None;
                h.probe_interval_ms = 0;
            }
            return self;
        }
        h.consecutive_failures = h.consecutive_failures.saturating_add(1);
        h.failing_since.get_or_insert(at);
        h.last_failure_at = Some(at);
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
        let first = millis(policy.first_probe);
        match h.circuit {
            Circuit::Closed if h.consecutive_failures >= policy.open_after as i32 => {
                h.circuit = Circuit::Open;
                h.probe_interval_ms = first;
                h.next_probe_at = Some(after_ms(at, first));
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
            if h.circuit != Circuit::Open {
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
        let after = seen.iter().fold(self, |s, &(seen, at)| s.observe_one(seen, at, policy, disable));
        let failed = seen.iter().any(|(s, _)| *s != Seen::Success);
        let effects = Effects {
            hold: after.health.circuit != Circuit::Closed && failed,
            release: after.health.circuit == Circuit::Closed && after.disabled.is_none() && self.health.circuit != Circuit::Closed,
            disable: after.disabled.filter(|_| after.disabled != self.disabled),
            enable: self.disabled.is_some() && after.disabled.is_none(),
        };
        (after, effects)
    }

    /// Whether the prober should look at this endpoint at `at`.
    pub fn probe_due(&self, at: Timestamp) -> bool {
        self.health.circuit != Circuit::Closed
            && self.health.next_probe_at.is_some_and(|next| next <= at)
            && self.disabled.is_none_or(|d| d == DisabledReason::Failing)
    }

    /// The prober's step for an endpoint whose probe is due, given when its
    /// first held delivery falls due. A due one is sent as the probe and the
    /// circuit waits half-open for the result; one not yet due is waited
    /// for, so a probe never spends an attempt before the schedule would.
    /// With nothing held, an enabled endpoint's circuit closes (its next
    /// failure re-opens it, the run of failures being kept) and a disabled
    /// one waits another interval.
    pub fn probe(mut self, at: Timestamp, first_held_due: Option<Timestamp>, policy: &CircuitPolicy) -> Self {
        let h = &mut self.health;
        match first_held_due {
            Some(due) if due <= at => {
                h.circuit = Circuit::HalfOpen;
                h.next_probe_at = Some(after_ms(at, h.probe_interval_ms.max(millis(policy.probe_guard))));
            }
            Some(due) => h.next_probe_at = Some(due),
            None if self.disabled.is_none() => {
                h.circuit = Circuit::Closed;
                h.next_probe_at = None;
            }
            None => h.next_probe_at = Some(after_ms(at, h.probe_interval_ms.max(millis(policy.first_probe)))),
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};

    use super::*;

    fn at(secs: i64) -> Timestamp {
        Utc.timestamp_opt(1_800_000_000 + secs, 0).unwrap()
    }

    const POLICY: CircuitPolicy = CircuitPolicy {
        open_after: 5,
        first_probe: Duration::from_secs(60),
        max_probe: Duration::from_secs(3600),
        probe_guard: Duration::from_secs(120),
    };

    fn healthy() -> Standing {
        Standing { health: EndpointHealth::new(), disabled: None }
    }

    fn failures(from: i64, n: i64) -> Vec<(Seen, Timestamp)> {
        (0..n).map(|i| (Seen::Failure, at(from + i))).collect()
    }

    #[test]
    fn the_circuit_opens_after_the_run_of_failures_and_holds_deliveries() {
        let (s, e) = healthy().observe(&failures(0, 4), &POLICY, &DisablePolicy::default());
        assert_eq!(s.health.circuit, Circuit::Closed);
        assert_eq!(s.health.consecutive_failures, 4);
        assert_eq!(e, Effects::default(), "four failures change nothing but the counters");
        let (s, e) = s.observe(&failures(4, 1), &POLICY, &DisablePolicy::default());
        assert_eq!(s.health.circuit, Circuit::Open);
        assert_eq!(s.health.next_probe_at, Some(at(64)));
        assert_eq!(s.health.failing_since, Some(at(0)));
        assert!(e.hold && !e.release && e.disable.is_none());
    }

    #[test]
    fn a_success_in_between_resets_the_run() {
        let mut seen = failures(0, 4);
        seen.push((Seen::Success, at(4)));
        seen.extend(failures(5, 4));
        let (s, _) = healthy().observe(&seen, &POLICY, &DisablePolicy::default());
        assert_eq!(s.health.circuit, Circuit::Closed);
        assert_eq!(s.health.consecutive_failures, 4);
        assert_eq!(s.health.failing_since, Some(at(5)));
        assert_eq!(s.health.last_success_at, Some(at(4)));
    }

    #[test]
    fn probes_back_off_from_the_first_interval_to_the_maximum() {
        let (mut s, _) = healthy().observe(&failures(0, 5), &POLICY, &DisablePolicy { after: Duration::MAX, min_failures: 10 });
        let mut waits = Vec::new();
        let mut now = 4;
        for _ in 0..8 {
            let next = s.health.next_probe_at.unwrap();
            now = (next - at(0)).num_seconds();
            assert!(s.probe_due(next) && !s.probe_due(next - chrono::Duration::seconds(1)));
            s = s.probe(next, Some(next), &POLICY);
            assert_eq!(s.health.circuit, Circuit::HalfOpen);
            let (after, e) = s.observe(&[(Seen::Failure, at(now))], &POLICY, &DisablePolicy { after: Duration::MAX, min_failures: 10 });
            assert!(e.hold);
            waits.push((after.health.next_probe_at.unwrap() - at(now)).num_seconds());
            s = after;
        }
        assert_eq!(waits, [120, 240, 480, 960, 1920, 3600, 3600, 3600]);
        let (s, e) =
            s.probe(at(now + 3600), Some(at(0)), &POLICY).observe(&[(Seen::Success, at(now + 3601))], &POLICY, &DisablePolicy::default());
        assert_eq!(
            s.health,
            EndpointHealth { last_success_at: Some(at(now + 3601)), last_failure_at: s.health.last_failure_at, ..EndpointHealth::new() }
        );
        assert!(e.release && !e.hold);
    }

    #[test]
    fn a_probe_waits_for_its_delivery_to_fall_due() {
        let (s, _) = healthy().observe(&failures(0, 5), &POLICY, &DisablePolicy::default());
        let s = s.probe(at(64), Some(at(1800)), &POLICY);
        assert_eq!((s.health.circuit, s.health.next_probe_at), (Circuit::Open, Some(at(1800))));
        let s = s.probe(at(1800), Some(at(1800)), &POLICY);
        assert_eq!(s.health.circuit, Circuit::HalfOpen);
        assert_eq!(s.health.next_probe_at, Some(at(1800 + 120)), "the guard, longer than the interval, bounds the wait for the result");
    }

    #[test]
    fn a_due_probe_with_nothing_held_closes_an_enabled_circuit_but_the_next_failure_reopens_it() {
        let (s, _) = healthy().observe(&failures(0, 5), &POLICY, &DisablePolicy::default());
        let s = s.probe(at(64), None, &POLICY);
        assert_eq!(s.health.circuit, Circuit::Closed);
        let (s, e) = s.observe(&failures(70, 1), &POLICY, &DisablePolicy::default());
        assert_eq!(s.health.circuit, Circuit::Open);
        assert!(e.hold);
    }

    #[test]
    fn failing_for_the_window_and_the_count_disables_and_a_success_re_enables() {
        let rule = DisablePolicy { after: Duration::from_secs(100), min_failures: 10 };
        // Long enough but too few.
        let (s, e) = healthy().observe(&[(Seen::Failure, at(0)), (Seen::Failure, at(200))], &POLICY, &rule);
        assert_eq!((s.disabled, e.disable), (None, None));
        // Enough failures, window reached.
        let (s, e) = s.observe(&failures(201, 8), &POLICY, &rule);
        assert_eq!(s.disabled, Some(DisabledReason::Failing));
        assert_eq!(e.disable, Some(DisabledReason::Failing));
        assert!(e.hold);
        assert!(s.probe_due(s.health.next_probe_at.unwrap()), "a failing endpoint is probed");
        // A probe that succeeds re-enables it.
        let s = s.probe(s.health.next_probe_at.unwrap(), Some(at(0)), &POLICY);
        let (s, e) = s.observe(&[(Seen::Success, at(1000))], &POLICY, &rule);
        assert_eq!((s.disabled, s.health.circuit), (None, Circuit::Closed));
        assert!(e.enable && e.release);
    }

    #[test]
    fn a_410_disables_at_once_and_is_never_probed() {
        let (s, e) = healthy().observe(&[(Seen::Gone, at(0))], &POLICY, &DisablePolicy::default());
        assert_eq!(s.disabled, Some(DisabledReason::Gone));
        assert_eq!(e.disable, Some(DisabledReason::Gone));
        assert!(e.hold);
        assert_eq!(s.health.next_probe_at, None);
        assert!(!s.probe_due(at(1_000_000)));
        // A late 2xx from an attempt sent before does not undo the receiver's word.
        let (s, e) = s.observe(&[(Seen::Success, at(1))], &POLICY, &DisablePolicy::default());
        assert_eq!(s.disabled, Some(DisabledReason::Gone));
        assert!(!e.release && !e.enable);
    }

    #[test]
    fn a_tenants_disable_is_not_overridden() {
        let manual = Standing { health: EndpointHealth::new(), disabled: Some(DisabledReason::Manual) };
        let (s, e) = manual.observe(&[(Seen::Gone, at(0)), (Seen::Success, at(1))], &POLICY, &DisablePolicy::default());
        assert_eq!(s.disabled, Some(DisabledReason::Manual));
        assert!(!e.enable && !e.release && e.disable.is_none());
        let (s, _) = manual.observe(&failures(0, 20), &POLICY, &DisablePolicy::default());
        assert!(!s.probe_due(at(1_000_000)), "a manually disabled endpoint is never probed");
    }

    #[test]
    fn statuses_map_to_what_they_say_about_the_endpoint() {
        assert_eq!(Seen::of(Some(204)), Seen::Success);
        assert_eq!(Seen::of(Some(410)), Seen::Gone);
        for s in [None, Some(301), Some(404), Some(429), Some(500), Some(503)] {
            assert_eq!(Seen::of(s), Seen::Failure, "{s:?}");
        }
    }
}
