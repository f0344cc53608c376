//! A delivery's state machine, in one place: the states, what an attempt's
//! result does to a delivery, and how a report that is not for the current
//! attempt is answered. Pure: no SQL and no clock of its own, so every rule
//! is unit-tested here and the database code only stores what this decides.
//!
//! ```text
//!   expansion ──► pending(generation g, attempt 1)
//!   pending(a) ──2xx──────────────────────────► delivered
//!   pending(a) ──failure, a < 7──────────────► pending(a + 1, due after the schedule's delay)
//!   pending ──its endpoint's circuit opens / disabled gone or failing──► held (attempt and due time kept)
//!   held ──endpoint recovers──► pending (released in due order, throttled); the first due one is the probe
//!   held(a), attempt a sent before it was held ──result──► as pending(a) would
//!   pending(7) ──failure─────────────────────► dead (+ dead letter, same transaction)
//!   pending    ──endpoint disabled/deleted───► dead (+ dead letter with the reason)
//!   dead by switch-off, attempt a in flight ──2xx──► delivered (dead letter withdrawn)
//!                                           ──else─► dead (dead letter updated)
//!   dead ──replay──► pending(generation g + 1, attempt 1)
//!
//!   in a lane (an ordered endpoint's deliveries of one ordering key, see
//!   `crate::ordering`): expansion and replay write queued; the lane's
//!   lowest-ranked queued row is promoted to pending (held, if its endpoint
//!   is down) once no row of the lane is pending or held
//!   queued ──endpoint disabled/deleted──► dead (+ dead letter with the reason)
//! ```

use chrono::SubsecRound;

use crate::{Timestamp, schedule::RetrySchedule};

/// Where a delivery stands. Stored as checked text (`webhook_deliveries.state`,
/// CHECK constraint in the first migration); these spellings are the only
/// ones the Rust code writes or reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(type_name = "text", rename_all = "lowercase"))]
pub enum DeliveryState {
    /// Due at `next_attempt_at`, or leased to the broker for its current attempt.
    Pending,
    /// Waiting for its endpoint to recover (circuit open, or disabled as
    /// `gone` or `failing`): no relay pass looks at it. Released to pending
    /// in order when the endpoint recovers; the oldest is sent as the probe.
    Held,
    /// Waiting behind the head of its lane (an ordered endpoint's
    /// deliveries of one ordering key): no relay pass looks at it until it
    /// is promoted, when every delivery ahead of it has ended.
    Queued,
    /// An attempt got a 2xx. Final.
    Delivered,
    /// The attempts ran out, or the endpoint was switched off; a dead letter
    /// holds the record. Final until replayed.
    Dead,
}

impl DeliveryState {
    pub const ALL: [Self; 5] = [Self::Pending, Self::Held, Self::Queued, Self::Delivered, Self::Dead];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Held => "held",
            Self::Queued => "queued",
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
            DeliveryState::Pending | DeliveryState::Held | DeliveryState::Queued => Self::Rescheduled { next_attempt_at },
        }
    }
}

/// Why a delivery became a dead letter (`webhook_dead_letters.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(type_name = "text", rename_all = "snake_case"))]
pub enum DeadLetterReason {
    /// Every attempt failed.
    AttemptsExhausted,
    /// The tenant disabled the endpoint while the delivery was pending or held.
    EndpointDisabled,
    /// The tenant deleted the endpoint while the delivery was pending or held.
    EndpointDeleted,
    /// Held longer than its environment allows while its endpoint was down.
    EndpointFailing,
    /// Its endpoint was a listener (relay-dev listen) whose call ended.
    ListenerGone,
}

impl DeadLetterReason {
    pub const ALL: [Self; 5] =
        [Self::AttemptsExhausted, Self::EndpointDisabled, Self::EndpointDeleted, Self::EndpointFailing, Self::ListenerGone];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::EndpointDisabled => "endpoint_disabled",
            Self::EndpointDeleted => "endpoint_deleted",
            Self::EndpointFailing => "endpoint_failing",
            Self::ListenerGone => "listener_gone",
        }
    }

    pub fn parse(stored: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == stored)
    }

    /// A switch-off by the tenant: provisional while the attempt in flight
    /// at the switch-off may still report.
    pub fn is_switch_off(self) -> bool {
        matches!(self, Self::EndpointDisabled | Self::EndpointDeleted | Self::ListenerGone)
    }
}

pub fn is_success(http_status: Option<u32>) -> bool {
    matches!(http_status, Some(200..=299))
}

/// The longest wait a receiver's `Retry-After` can impose on one delivery.
pub const MAX_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// What an attempt's result means were it the delivery's current attempt:
/// a 2xx delivers; otherwise the schedule says when the next attempt is due,
/// or that the attempts have run out. A 429 or 503 with `Retry-After` puts
/// the next attempt no earlier than it asks (at most `MAX_RETRY_AFTER`); the
/// attempt still counts.
pub fn decide(
    schedule: &RetrySchedule,
    attempt: u32,
    http_status: Option<u32>,
    retry_after: Option<std::time::Duration>,
    now: Timestamp,
) -> Decision {
    if is_success(http_status) {
        return Decision::Delivered;
    }
    let asked = match http_status {
        Some(429 | 503) => retry_after.map(|d| d.min(MAX_RETRY_AFTER)).unwrap_or_default(),
        _ => std::time::Duration::ZERO,
    };
    match schedule.delay_before(attempt.saturating_add(1)).and_then(|d| chrono::Duration::from_std(d.max(asked)).ok()) {
        // Truncated to Postgres's microseconds, so a repeated report answers
        // with exactly the instant the first one stored.
        Some(delay) => Decision::Rescheduled { next_attempt_at: (now + delay).trunc_subsecs(6) },
        None => Decision::DeadLettered,
    }
}

/// A delivery as the careful outcome path reads it, locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryStanding {
    pub state: DeliveryState,
    pub generation: u32,
    pub attempt: u32,
    pub next_attempt_at: Timestamp,
    /// Dead because its endpoint was switched off while this attempt was
    /// on the wire (the dead letter counts the attempts before it).
    pub switched_off_in_flight: bool,
}

/// A report as the state machine needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    pub generation: u32,
    pub attempt: u32,
    pub http_status: Option<u32>,
}

/// What to do with one report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The delivery's current attempt: record it and apply the decision.
    Advance(Decision),
    /// The attempt that was in flight when the endpoint was switched off:
    /// record it; `Delivered` withdraws the provisional dead letter (the
    /// receiver has the event), `DeadLettered` updates it with this result.
    Settle(Decision),
    /// Already recorded, or not the current attempt (a straggler from before
    /// a replay, say): answer with this and change nothing.
    Answer(Decision),
}

impl DeliveryStanding {
    fn is_current(&self, r: &Reported) -> bool {
        self.attempt == r.attempt && self.generation == r.generation
    }

    /// The report is for the attempt this delivery is waiting on: the one
    /// case `step` advances, and the one case that cannot have been recorded.
    /// A held delivery may be waiting on one too: it was sent while pending
    /// and held (its endpoint's circuit opened) before the result came.
    pub fn awaits(&self, r: &Reported) -> bool {
        matches!(self.state, DeliveryState::Pending | DeliveryState::Held) && self.is_current(r)
    }

    /// The one transition function. `recorded` is what the attempt log
    /// already holds for this exact attempt (a repeat gets its first answer);
    /// `decide` is consulted only for a report that advances the delivery.
    pub fn step(&self, r: &Reported, recorded: Option<Decision>, decide: impl FnOnce() -> Decision) -> Step {
        if let Some(first) = recorded {
            return Step::Answer(first);
        }
        match self.state {
            DeliveryState::Pending | DeliveryState::Held if self.awaits(r) => Step::Advance(decide()),
            DeliveryState::Dead if self.switched_off_in_flight && self.is_current(r) => {
                Step::Settle(if is_success(r.http_status) { Decision::Delivered } else { Decision::DeadLettered })
            }
            _ => Step::Answer(Decision::standing(self.state, self.next_attempt_at)),
        }
    }

    /// Where the delivery stands after a step.
    pub fn after(&self, step: Step) -> DeliveryStanding {
        match step {
            Step::Answer(_) => *self,
            Step::Advance(d) | Step::Settle(d) => DeliveryStanding {
                state: d.state(),
                attempt: d.next_attempt(self.attempt),
                next_attempt_at: d.next_attempt_at().unwrap_or(self.next_attempt_at),
                switched_off_in_flight: false,
                ..*self
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};

    use super::*;

    fn at(secs: i64) -> Timestamp {
        Utc.timestamp_opt(1_800_000_000 + secs, 0).unwrap()
    }

    fn pending(generation: u32, attempt: u32) -> DeliveryStanding {
        DeliveryStanding { state: DeliveryState::Pending, generation, attempt, next_attempt_at: at(0), switched_off_in_flight: false }
    }

    fn report(generation: u32, attempt: u32, http_status: Option<u32>) -> Reported {
        Reported { generation, attempt, http_status }
    }

    #[test]
    fn retry_after_on_429_and_503_delays_the_next_attempt_within_an_hour() {
        let schedule = RetrySchedule::production();
        let now = at(0);
        let secs = std::time::Duration::from_secs;
        let next = |status, asked| decide(&schedule, 1, Some(status), asked, now).next_attempt_at().map(|t| (t - now).num_seconds());
        assert_eq!(next(429, Some(secs(120))), Some(120));
        assert_eq!(next(503, Some(secs(120))), Some(120));
        assert_eq!(next(429, Some(secs(0))), Some(1), "never sooner than the schedule");
        assert_eq!(next(503, Some(secs(86_400))), Some(3600), "bounded at an hour");
        assert_eq!(next(500, Some(secs(120))), Some(1), "only 429 and 503 ask the sender to wait");
        assert_eq!(next(429, None), Some(1));
        assert_eq!(decide(&schedule, 7, Some(429), Some(secs(60)), now), Decision::DeadLettered, "the attempt still counts");
    }

    #[test]
    fn the_schedule_decides_the_current_attempt() {
        let schedule = RetrySchedule::production();
        let now = at(0);
        let want_delays = [1u64, 5, 30, 300, 1800, 7200];
        for attempt in 1..=7u32 {
            assert_eq!(decide(&schedule, attempt, Some(204), None, now), Decision::Delivered, "attempt {attempt}");
            for failure in [None, Some(199), Some(300), Some(429), Some(500)] {
                let d = decide(&schedule, attempt, failure, None, now);
                match want_delays.get(attempt as usize - 1) {
                    Some(&secs) => assert_eq!(d, Decision::Rescheduled { next_attempt_at: at(secs as i64) }, "attempt {attempt}"),
                    None => assert_eq!(d, Decision::DeadLettered, "attempt {attempt} is the last"),
                }
            }
        }
        // Out-of-range attempts never panic and never reschedule forever.
        assert_eq!(decide(&schedule, u32::MAX, Some(500), None, now), Decision::DeadLettered);
    }

    #[test]
    fn every_state_and_report_kind_has_one_step() {
        let redeliver = || Decision::Rescheduled { next_attempt_at: at(5) };
        let cases: Vec<(&str, DeliveryStanding, Reported, Option<Decision>, Step)> = vec![
            ("current attempt fails", pending(0, 2), report(0, 2, Some(500)), None, Step::Advance(redeliver())),
            (
                "repeat of a recorded attempt",
                pending(0, 3),
                report(0, 2, Some(500)),
                Some(Decision::Delivered),
                Step::Answer(Decision::Delivered),
            ),
            (
                "straggler: an older attempt never recorded",
                pending(0, 3),
                report(0, 1, Some(200)),
                None,
                Step::Answer(Decision::Rescheduled { next_attempt_at: at(0) }),
            ),
            (
                "straggler: an earlier generation",
                pending(1, 1),
                report(0, 1, Some(200)),
                None,
                Step::Answer(Decision::Rescheduled { next_attempt_at: at(0) }),
            ),
            (
                "report after delivery",
                DeliveryStanding { state: DeliveryState::Delivered, ..pending(0, 1) },
                report(0, 1, Some(500)),
                None,
                Step::Answer(Decision::Delivered),
            ),
            (
                "report on a dead delivery",
                DeliveryStanding { state: DeliveryState::Dead, ..pending(0, 7) },
                report(0, 7, Some(200)),
                None,
                Step::Answer(Decision::DeadLettered),
            ),
            (
                "in flight at switch-off, answered 2xx",
                DeliveryStanding { state: DeliveryState::Dead, switched_off_in_flight: true, ..pending(0, 2) },
                report(0, 2, Some(200)),
                None,
                Step::Settle(Decision::Delivered),
            ),
            (
                "in flight at switch-off, failed",
                DeliveryStanding { state: DeliveryState::Dead, switched_off_in_flight: true, ..pending(0, 2) },
                report(0, 2, None),
                None,
                Step::Settle(Decision::DeadLettered),
            ),
            (
                "switched off, but the report is for another attempt",
                DeliveryStanding { state: DeliveryState::Dead, switched_off_in_flight: true, ..pending(0, 2) },
                report(0, 1, Some(200)),
                None,
                Step::Answer(Decision::DeadLettered),
            ),
        ];
        for (name, standing, r, recorded, want) in cases {
            assert_eq!(standing.step(&r, recorded, redeliver), want, "{name}");
        }
    }

    #[test]
    fn steps_move_the_delivery_as_the_decision_says_and_answers_move_nothing() {
        let s = pending(2, 3);
        assert_eq!(s.after(Step::Answer(Decision::Delivered)), s);
        let delivered = s.after(Step::Advance(Decision::Delivered));
        assert_eq!((delivered.state, delivered.attempt, delivered.generation), (DeliveryState::Delivered, 3, 2));
        let later = s.after(Step::Advance(Decision::Rescheduled { next_attempt_at: at(30) }));
        assert_eq!((later.state, later.attempt, later.next_attempt_at), (DeliveryState::Pending, 4, at(30)));
        let dead = s.after(Step::Advance(Decision::DeadLettered));
        assert_eq!((dead.state, dead.attempt), (DeliveryState::Dead, 3));
        let off = DeliveryStanding { state: DeliveryState::Dead, switched_off_in_flight: true, ..s };
        assert_eq!(off.after(Step::Settle(Decision::Delivered)).state, DeliveryState::Delivered);
        assert!(!off.after(Step::Settle(Decision::DeadLettered)).switched_off_in_flight);
    }

    #[test]
    fn a_repeat_after_a_step_gets_the_first_answer() {
        // Record once, then the same report again: the log answers it.
        let s = pending(0, 1);
        let r = report(0, 1, Some(500));
        let first = s.step(&r, None, || Decision::Rescheduled { next_attempt_at: at(1) });
        let Step::Advance(d) = first else { panic!("{first:?}") };
        let moved = s.after(first);
        assert_eq!(moved.step(&r, Some(d), || unreachable!("a repeat is never decided again")), Step::Answer(d));
    }

    #[test]
    fn the_log_spelling_reads_back() {
        for d in [Decision::Delivered, Decision::Rescheduled { next_attempt_at: at(7) }, Decision::DeadLettered] {
            assert_eq!(Decision::from_log(d.as_str(), d.next_attempt_at()), Some(d));
        }
        assert_eq!(Decision::from_log("rescheduled", None), None, "a reschedule without its instant is not one");
        assert_eq!(Decision::from_log("dead", None), None);
        let spelled: Vec<&str> = DeliveryState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(spelled, ["pending", "held", "queued", "delivered", "dead"]);
    }
}
