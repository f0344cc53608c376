//! An endpoint's rate limit, and the gate that enforces it: a generic cell
//! rate algorithm (GCRA) over one instant per endpoint, the theoretical
//! arrival time `tat`. The api's lease statements apply these same rules in
//! SQL, under the endpoint's health row lock, so the limit holds for the
//! endpoint across every api and dispatcher.
//!
//! Invariants:
//! - an attempt may be leased at `now` when `now >= tat - (burst - 1) / rate`;
//!   each lease moves `tat` to `max(tat, now) + 1 / rate`;
//! - so over any interval of `w` seconds at most `burst + w × rate` attempts
//!   are leased (tested below by simulation);
//! - attempts over the limit wait, due, in the schedule: never dropped and
//!   never counted as failures.

use std::time::Duration;

use crate::Timestamp;

/// The most attempts a second an endpoint may ask for, and the largest burst.
pub const MAX_PER_SECOND: u32 = 10_000;
pub const MAX_BURST: u32 = 10_000;

/// At most `per_second` attempts a second, `burst` of them at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    per_second: u32,
    burst: u32,
}

impl RateLimit {
    /// A limit within bounds; `burst` 0 means the default, 1.
    pub fn new(per_second: u32, burst: u32) -> Result<RateLimit, String> {
        if !(1..=MAX_PER_SECOND).contains(&per_second) {
            return Err(format!("rate_limit.per_second must be 1–{MAX_PER_SECOND}, got {per_second}"));
        }
        if burst > MAX_BURST {
            return Err(format!("rate_limit.burst must be 1–{MAX_BURST}, got {burst}"));
        }
        Ok(RateLimit { per_second, burst: burst.max(1) })
    }

    pub fn per_second(self) -> u32 {
        self.per_second
    }

    pub fn burst(self) -> u32 {
        self.burst
    }

    fn interval(self) -> Duration {
        Duration::from_secs(1) / self.per_second
    }

    /// How many attempts may be leased at `now` with the gate at `tat`.
    pub fn available(self, tat: Timestamp, now: Timestamp) -> u32 {
        let ahead = (tat.max(now) - now).to_std().unwrap_or_default();
        // floor((now - max(tat, now)) × rate) + burst, at least 0.
        let owed = (ahead.as_nanos() * u128::from(self.per_second)).div_ceil(1_000_000_000);
        u32::try_from(i128::from(self.burst) - owed as i128).unwrap_or(0)
    }

    /// The gate after leasing `n` attempts at `now`.
    pub fn spend(self, tat: Timestamp, now: Timestamp, n: u32) -> Timestamp {
        tat.max(now) + self.interval() * n
    }

    /// When the next attempt may be leased, with the gate at `tat`.
    pub fn next_at(self, tat: Timestamp) -> Timestamp {
        tat - self.interval() * (self.burst - 1)
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    use super::*;

    fn at(ms: i64) -> Timestamp {
        chrono::Utc.timestamp_millis_opt(1_800_000_000_000 + ms).unwrap()
    }

    #[test]
    fn bounds_are_named() {
        assert!(RateLimit::new(0, 1).unwrap_err().contains("per_second must be 1–10000, got 0"));
        assert!(RateLimit::new(10_001, 1).unwrap_err().contains("got 10001"));
        assert!(RateLimit::new(5, 10_001).unwrap_err().contains("burst must be 1–10000, got 10001"));
        assert_eq!(RateLimit::new(5, 0).unwrap().burst(), 1, "burst defaults to 1");
    }

    #[test]
    fn a_fresh_gate_lets_a_burst_through_then_paces() {
        let limit = RateLimit::new(5, 5).unwrap();
        let start = at(0);
        let tat = chrono::DateTime::<chrono::Utc>::MIN_UTC;
        assert_eq!(limit.available(tat, start), 5);
        let tat = limit.spend(tat, start, 5);
        assert_eq!(tat, at(1000));
        assert_eq!(limit.available(tat, start), 0);
        assert_eq!(limit.next_at(tat), at(200));
        assert_eq!(limit.available(tat, at(199)), 0);
        assert_eq!(limit.available(tat, at(200)), 1);
        assert_eq!(limit.available(tat, at(1000)), 5);
    }

    /// Leases asked at random instants, as many as allowed each time: no
    /// window of one second ever holds more than rate + burst, and the long
    /// run goes at the rate.
    #[test]
    fn no_window_holds_more_than_rate_plus_burst() {
        let mut rng = StdRng::seed_from_u64(27);
        for (rate, burst) in [(5, 5), (5, 1), (1, 1), (50, 3), (1000, 1000)] {
            let limit = RateLimit::new(rate, burst).unwrap();
            let mut tat = chrono::DateTime::<chrono::Utc>::MIN_UTC;
            let mut sent: Vec<i64> = Vec::new();
            let mut now = 0i64;
            while now < 20_000 {
                now += rng.random_range(0..150);
                let n = limit.available(tat, at(now)).min(rng.random_range(0..2 * burst + 2));
                tat = limit.spend(tat, at(now), n);
                sent.extend(std::iter::repeat_n(now, n as usize));
            }
            for (i, &t) in sent.iter().enumerate() {
                let within = sent[i..].iter().take_while(|&&u| u < t + 1000).count();
                assert!(within <= (rate + burst) as usize, "{rate}/s burst {burst}: {within} in the second from {t} ms");
            }
            let expected = 20 * rate as usize;
            assert!(sent.len() <= expected + burst as usize, "{rate}/s: {} sent", sent.len());
        }
    }
}
