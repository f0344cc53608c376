//! The failure window's arithmetic: two aligned buckets, rolled on as
//! results come, the previous one weighed by how much of it is still inside.

use std::time::Duration;

use super::{FailureWindow, millis};
use crate::Timestamp;

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

    pub(super) fn count(&mut self, at: Timestamp, window: Duration, failed: bool) {
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
