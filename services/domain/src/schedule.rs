//! The retry schedule: seven requests, the delays as data.
//!
//! `attempt` is an index into the tier table, so the due time of attempt N is
//! a lookup from the moment attempt N-1 failed, never an accumulation.

use std::time::Duration;

/// A retry schedule that cannot be used, named.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("the tiers must be comma-separated milliseconds, got {0:?}")]
    NotMillis(String),
    #[error("the first tier must be 0: a first attempt is sent immediately")]
    FirstNotImmediate,
    #[error("a tier of {} ms is longer than the {} days a dead letter is kept", .0.as_millis(), MAX_TIER.as_secs() / 86_400)]
    TooLong(Duration),
}

/// No delay is longer than a dead letter is kept.
const MAX_TIER: Duration = Duration::from_secs(7 * 86_400);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySchedule {
    /// Delay before attempt N, at index N-1. Index 0 is the first attempt: 0.
    tiers: Vec<Duration>,
}

impl RetrySchedule {
    /// Immediately, then 1 s, 5 s, 30 s, 5 min, 30 min, 2 h after each failure:
    /// a customer gets about two and a half hours of outage before a dead letter.
    pub fn production() -> Self {
        let s = Duration::from_secs;
        Self { tiers: vec![s(0), s(1), s(5), s(30), s(300), s(1800), s(7200)] }
    }

    /// Comma-separated milliseconds, e.g. `0,10,10,10,10,10,10`; tests use it
    /// to walk all seven attempts in well under a second each.
    pub fn parse(spec: &str) -> Result<Self, ScheduleError> {
        let tiers = spec
            .split(',')
            .map(|t| t.trim().parse::<u64>().map(Duration::from_millis))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| ScheduleError::NotMillis(spec.to_owned()))?;
        if tiers.is_empty() || tiers[0] != Duration::ZERO {
            return Err(ScheduleError::FirstNotImmediate);
        }
        if let Some(t) = tiers.iter().find(|t| **t > MAX_TIER) {
            return Err(ScheduleError::TooLong(*t));
        }
        Ok(Self { tiers })
    }

    pub fn max_attempts(&self) -> u32 {
        self.tiers.len() as u32
    }

    /// The delay before `attempt` (1-based), or `None` past the last tier —
    /// the signal to dead-letter instead of rescheduling.
    pub fn delay_before(&self, attempt: u32) -> Option<Duration> {
        attempt.checked_sub(1).and_then(|i| self.tiers.get(i as usize)).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn production_is_seven_requests_on_the_published_tiers() {
        let s = RetrySchedule::production();
        assert_eq!(s.max_attempts(), 7);
        let secs: Vec<u64> = (1..=7).map(|a| s.delay_before(a).unwrap().as_secs()).collect();
        assert_eq!(secs, [0, 1, 5, 30, 300, 1800, 7200]);
        assert_eq!(s.delay_before(8), None);
        assert_eq!(s.delay_before(0), None);
    }

    #[test]
    fn test_tiers_must_start_immediately() {
        assert!(RetrySchedule::parse("10,20").is_err());
        assert_eq!(RetrySchedule::parse("0,5").unwrap().max_attempts(), 2);
        let long = RetrySchedule::parse("0,604800001").unwrap_err().to_string();
        assert!(long.contains("604800001 ms"), "{long}");
    }
}
