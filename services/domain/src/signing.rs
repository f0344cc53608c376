//! Signing rules every service shares: how long a rotated-out secret keeps
//! signing.

use crate::Timestamp;

/// How long a rotated-out secret (or key pair) keeps signing. A promise
/// recipients code against, not a tuning knob.
pub const ROTATION_WINDOW: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// Whether the previous secret of an endpoint rotated at `rotated_at` still
/// signs at `now`.
pub fn previous_still_signs(rotated_at: Option<Timestamp>, now: Timestamp) -> bool {
    let window = chrono::Duration::from_std(ROTATION_WINDOW).expect("24 h fits");
    rotated_at.is_some_and(|at| now < at + window)
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    #[test]
    fn the_previous_secret_signs_for_exactly_the_window() {
        let at = chrono::Utc.timestamp_opt(1_800_000_000, 0).unwrap();
        let window = chrono::Duration::hours(24);
        assert!(previous_still_signs(Some(at), at));
        assert!(previous_still_signs(Some(at), at + window - chrono::Duration::milliseconds(1)));
        assert!(!previous_still_signs(Some(at), at + window));
        assert!(!previous_still_signs(None, at));
    }
}
