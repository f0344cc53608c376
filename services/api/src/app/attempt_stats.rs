//! Per-endpoint attempt statistics for the portal's charts: success rate and
//! p50/p99 latency in 5-minute buckets. The outcome path adds each recorded
//! attempt to a sum in memory ([`AttemptStats::add`], no I/O); a task of the
//! api writes the sums every [`FLUSH_EVERY`] (see the migration
//! `portal_pages` for why not in the outcome statement).

use std::{collections::HashMap, sync::Mutex, time::Duration};

use chrono::{DurationRound, TimeDelta};
use relay_domain::EndpointId;

use super::{App, Timestamp, endpoints::Endpoint};
use crate::{db, error::AppResult};

/// A chart's bucket.
pub const BUCKET: TimeDelta = TimeDelta::minutes(5);
/// How far back a chart reaches.
pub const WINDOW: TimeDelta = TimeDelta::hours(24);
/// How long buckets are kept: two windows.
pub const KEPT: Duration = Duration::from_secs(48 * 3600);
/// How often an api writes what it has added up.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);
/// Upper bounds of the latency histogram's buckets, in milliseconds; one
/// more bucket holds everything slower than the last.
pub const LATENCY_BOUNDS_MS: [u64; 22] =
    [5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 750, 1_000, 1_500, 2_000, 3_000, 5_000, 7_500, 10_000, 15_000, 20_000, 30_000];
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_MS.len() + 1;

/// One endpoint's attempts in one bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketSums {
    pub attempts: i64,
    pub succeeded: i64,
    pub latency_counts: Vec<i64>,
}

impl Default for BucketSums {
    fn default() -> Self {
        Self { attempts: 0, succeeded: 0, latency_counts: vec![0; LATENCY_BUCKETS] }
    }
}

impl BucketSums {
    pub fn add(&mut self, succeeded: bool, latency_ms: u64) {
        self.attempts += 1;
        self.succeeded += i64::from(succeeded);
        self.latency_counts[latency_bucket(latency_ms)] += 1;
    }

    pub fn merge(&mut self, other: &BucketSums) {
        self.attempts += other.attempts;
        self.succeeded += other.succeeded;
        for (a, b) in self.latency_counts.iter_mut().zip(&other.latency_counts) {
            *a += b;
        }
    }

    /// The latency below which `q` of the attempts fell, interpolated within
    /// its histogram bucket (the open-ended last bucket answers its lower
    /// bound); `None` without attempts.
    pub fn latency_quantile_ms(&self, q: f64) -> Option<f64> {
        let total: i64 = self.latency_counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q * total as f64;
        let mut below = 0i64;
        for (i, &n) in self.latency_counts.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let lower = if i == 0 { 0.0 } else { LATENCY_BOUNDS_MS[i - 1] as f64 };
                let Some(&upper) = LATENCY_BOUNDS_MS.get(i) else { return Some(lower) };
                let within = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
                return Some(lower + within * (upper as f64 - lower));
            }
            below += n;
        }
        Some(*LATENCY_BOUNDS_MS.last().expect("bounds") as f64)
    }
}

fn latency_bucket(latency_ms: u64) -> usize {
    LATENCY_BOUNDS_MS.partition_point(|&bound| bound < latency_ms)
}

/// The bucket a moment falls in.
pub fn bucket_of(at: Timestamp) -> Timestamp {
    at.duration_trunc(BUCKET).unwrap_or(at)
}

/// What this process recorded and has not written yet.
#[derive(Debug, Default)]
pub struct AttemptStats {
    pending: Mutex<HashMap<(EndpointId, Timestamp), BucketSums>>,
}

impl AttemptStats {
    /// Adds attempts just recorded: (endpoint, succeeded, latency).
    pub fn add(&self, at: Timestamp, attempts: impl IntoIterator<Item = (EndpointId, bool, u64)>) {
        let bucket = bucket_of(at);
        let mut pending = self.pending.lock().expect("attempt stats lock");
        for (endpoint, succeeded, latency_ms) in attempts {
            pending.entry((endpoint, bucket)).or_default().add(succeeded, latency_ms);
        }
    }

    fn take(&self) -> HashMap<(EndpointId, Timestamp), BucketSums> {
        std::mem::take(&mut *self.pending.lock().expect("attempt stats lock"))
    }

    /// Puts sums back that could not be written, to go with the next write.
    fn restore(&self, sums: HashMap<(EndpointId, Timestamp), BucketSums>) {
        let mut pending = self.pending.lock().expect("attempt stats lock");
        for (key, s) in sums {
            pending.entry(key).or_default().merge(&s);
        }
    }
}

/// One endpoint's chart: a bucket for each 5 minutes of the window, oldest
/// first, empty where nothing was attempted.
#[derive(Debug)]
pub struct Chart {
    pub from: Timestamp,
    pub buckets: Vec<BucketSums>,
}

impl App {
    /// Writes what this process has added up since the last write; on
    /// failure the sums stay for the next one.
    pub async fn flush_attempt_stats(&self) -> AppResult<usize> {
        let sums = self.attempt_stats.take();
        if sums.is_empty() {
            return Ok(0);
        }
        let n = sums.len();
        let mut rows = db::attempt_stats::Rows::default();
        for ((endpoint, bucket), s) in &sums {
            rows.push(*endpoint, *bucket, s.attempts, s.succeeded, &s.latency_counts);
        }
        if let Err(e) = db::attempt_stats::add(&self.db, &rows).await {
            self.attempt_stats.restore(sums);
            return Err(e);
        }
        Ok(n)
    }

    /// The chart of an endpoint over the last 24 h; the endpoint as read for
    /// a tenant (`get_endpoint`), which is what scopes it.
    pub async fn endpoint_chart(&self, endpoint: &Endpoint) -> AppResult<Chart> {
        let endpoint_id = endpoint.id;
        let now = self.clock.now();
        let from = bucket_of(now - WINDOW) + BUCKET;
        let count = (WINDOW.num_seconds() / BUCKET.num_seconds()) as usize;
        let mut buckets = vec![BucketSums::default(); count];
        for stored in db::attempt_stats::of_endpoint(&self.db, endpoint_id, from).await? {
            let i = ((stored.bucket_start - from).num_seconds() / BUCKET.num_seconds()) as usize;
            let mut latency_counts = stored.latency_counts;
            latency_counts.resize(LATENCY_BUCKETS, 0);
            if let Some(b) = buckets.get_mut(i) {
                b.merge(&BucketSums { attempts: stored.attempts, succeeded: stored.succeeded, latency_counts });
            }
        }
        Ok(Chart { from, buckets })
    }

    /// Deletes buckets older than [`KEPT`].
    pub async fn prune_attempt_stats(&self) -> AppResult<u64> {
        db::attempt_stats::prune(&self.db, KEPT).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_fall_in_the_bucket_whose_upper_bound_holds_them() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(5), 0);
        assert_eq!(latency_bucket(6), 1);
        assert_eq!(latency_bucket(30_000), LATENCY_BOUNDS_MS.len() - 1);
        assert_eq!(latency_bucket(30_001), LATENCY_BOUNDS_MS.len());
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket_and_the_open_bucket_answers_its_floor() {
        let mut s = BucketSums::default();
        assert_eq!(s.latency_quantile_ms(0.5), None);
        for _ in 0..100 {
            s.add(true, 60); // 50 < 60 <= 75
        }
        let p50 = s.latency_quantile_ms(0.5).unwrap();
        assert!((50.0..=75.0).contains(&p50), "{p50}");
        assert!((s.latency_quantile_ms(0.5).unwrap() - 62.5).abs() < 1e-9);
        s.add(false, 60_000);
        assert_eq!(s.latency_quantile_ms(1.0), Some(30_000.0));
        assert_eq!((s.attempts, s.succeeded), (101, 100));
    }

    #[test]
    fn sums_that_could_not_be_written_go_with_the_next_write() {
        let stats = AttemptStats::default();
        let at = chrono::Utc::now();
        let e = EndpointId::from_uuid(uuid::Uuid::nil());
        stats.add(at, [(e, true, 1), (e, false, 2)]);
        let taken = stats.take();
        stats.add(at, [(e, true, 1)]);
        stats.restore(taken);
        let again = stats.take();
        let s = &again[&(e, bucket_of(at))];
        assert_eq!((s.attempts, s.succeeded, s.latency_counts[0]), (3, 2, 3));
    }
}
