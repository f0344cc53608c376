//! The circuit's rules: what each result does to an endpoint's standing
//! (`EndpointStanding::observe`) and what the prober does when a look is due
//! (`EndpointStanding::probe`).

use super::{
    Circuit, CircuitPolicy, DisablePolicy, DisabledReason, Effects, EndpointStanding, RELEASED_PER_SUCCESS, RELEASED_PER_TICK, Seen,
    after_ms, millis,
};
use crate::Timestamp;

impl EndpointStanding {
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
