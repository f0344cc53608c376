//! Outcomes the api has not taken: attempts this process sent whose report
//! was refused or unanswered through all of `settle::report`'s retries (the
//! api away or restarting, its database not keeping up).
//!
//! Sending such an attempt again costs the receiver a duplicate; reporting
//! the outcome this process already has costs nothing. So each is kept
//! here, and
//! - reported again in the background, backing off to `MAX_BACKOFF`, until
//!   the api answers: recorded, or no longer current (then it knows better);
//! - reported instead of sent when a job for the same attempt comes back to
//!   this process (the broker's redelivery, or the relay's re-hand once the
//!   lease ran out).
//!
//! Invariant: an entry is an attempt whose request reached the wire and
//! whose outcome the api has not acknowledged to this process. Bounded:
//! `MAX_KEPT` entries, each for `KEEP_FOR` at most (by then its lease has
//! long run out and another dispatcher may have sent it: the api's answer
//! to a late report says so, and nothing else is owed to it here).

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use relay_contracts::{
    AttemptKey,
    relay::{
        dispatch::v1::{MaterialResponse, OutcomeRequest},
        queue::v1::DeliveryJob,
    },
};

use crate::{
    batch,
    verdict::{Verdict, verdict},
};

/// Outcomes kept at most; the oldest goes first past it.
const MAX_KEPT: usize = 20_000;
/// How long an outcome is kept for the api at most.
const KEEP_FOR: Duration = Duration::from_secs(30 * 60);
/// The background retry's longest wait between two tries of one outcome.
const MAX_BACKOFF: Duration = Duration::from_secs(8);
/// How often the background retry looks for outcomes due a try.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// One outcome the api has not taken, and what reporting it needs.
pub(crate) struct Kept {
    pub job: DeliveryJob,
    pub event_id: String,
    pub outcome: OutcomeRequest,
    since: Instant,
    tries: u32,
    next_try: Instant,
}

#[derive(Default)]
pub(crate) struct Unreported(Mutex<HashMap<AttemptKey, Kept>>);

impl Unreported {
    /// Keeps an outcome the api did not take.
    pub(crate) fn keep(&self, job: &DeliveryJob, event_id: &str, outcome: OutcomeRequest) {
        let now = Instant::now();
        let kept = Kept { job: job.clone(), event_id: event_id.to_owned(), outcome, since: now, tries: 0, next_try: now + backoff(0) };
        self.put(kept);
        tracing::warn!(delivery_id = %job.delivery_id, attempt = job.attempt, waiting = self.len(),
            "the api did not take an outcome; it is kept and reported again, not sent again");
    }

    /// The outcome kept for an attempt, taken out (the caller reports it).
    pub(crate) fn take(&self, key: &AttemptKey) -> Option<Kept> {
        self.0.lock().expect("unpoisoned").remove(key)
    }

    /// How many outcomes wait for the api.
    pub(crate) fn len(&self) -> usize {
        self.0.lock().expect("unpoisoned").len()
    }

    /// Gives back an outcome whose report failed again, for a later try.
    pub(crate) fn again(&self, mut kept: Kept) {
        kept.tries += 1;
        kept.next_try = Instant::now() + backoff(kept.tries);
        self.put(kept);
    }

    fn put(&self, kept: Kept) {
        let mut map = self.0.lock().expect("unpoisoned");
        if map.len() >= MAX_KEPT {
            let oldest = map.iter().min_by_key(|(_, k)| k.since).map(|(key, _)| key.clone());
            if let Some(key) = oldest {
                map.remove(&key);
                tracing::warn!(attempt = %key, "too many outcomes wait for the api; the oldest is dropped (its attempt may be sent again)");
            }
        }
        map.insert(AttemptKey::of(&kept.job), kept);
    }

    /// Takes out the outcomes due a try, oldest first (a lane's earlier
    /// attempts before its later ones), dropping those kept too long.
    fn due(&self) -> Vec<Kept> {
        let now = Instant::now();
        let mut map = self.0.lock().expect("unpoisoned");
        map.retain(|key, k| {
            let keep = now.duration_since(k.since) <= KEEP_FOR;
            if !keep {
                tracing::warn!(attempt = %key, "an outcome the api never took is given up on (its attempt may be sent again)");
            }
            keep
        });
        let keys: Vec<AttemptKey> = map.iter().filter(|(_, k)| k.next_try <= now).map(|(key, _)| key.clone()).collect();
        let mut due: Vec<Kept> = keys.iter().filter_map(|key| map.remove(key)).collect();
        due.sort_by_key(|k| k.since);
        due
    }
}

/// 1 s, doubling, at most `MAX_BACKOFF`.
fn backoff(tries: u32) -> Duration {
    (Duration::from_secs(1) * 2u32.saturating_pow(tries.min(8))).min(MAX_BACKOFF)
}

/// Reports kept outcomes again until `stop`. `busy` marks an attempt as in
/// this process's hands while its report is on the way (`true`) and frees
/// it after (`false`), so a job for it arriving meanwhile is not sent;
/// `hand` takes the next attempts an outcome's decision hands back.
pub(crate) async fn retry(
    unreported: &Unreported,
    outcomes: &batch::Outcomes,
    busy: impl Fn(&AttemptKey, bool),
    hand: impl Fn(MaterialResponse),
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(LOOK_EVERY) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        let due = unreported.due();
        if due.is_empty() {
            continue;
        }
        for k in &due {
            busy(&AttemptKey::of(&k.job), true);
        }
        let answers = futures::future::join_all(due.iter().map(|k| outcomes.call(k.outcome.clone()))).await;
        for (kept, answer) in due.into_iter().zip(answers) {
            let key = AttemptKey::of(&kept.job);
            match answer {
                Ok(mut decision) => {
                    tracing::info!(delivery_id = %kept.job.delivery_id, event_id = %kept.event_id, attempt = kept.job.attempt,
                        decision = decision.decision, tries = kept.tries + 1, "an outcome the api had not taken is recorded");
                    for next in std::mem::take(&mut decision.next) {
                        hand(next);
                    }
                }
                Err(st) if verdict(&st, false) == Verdict::Retry => unreported.again(kept),
                Err(st) => tracing::info!(delivery_id = %kept.job.delivery_id, attempt = kept.job.attempt, code = ?st.code(),
                    message = st.message(), "a kept outcome is no longer wanted by the api"),
            }
            busy(&key, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(d: &str, attempt: u32) -> DeliveryJob {
        DeliveryJob { delivery_id: d.into(), attempt, ..Default::default() }
    }

    #[test]
    fn an_outcome_is_kept_until_taken_and_backs_off_while_refused() {
        let u = Unreported::default();
        u.keep(&job("d1", 2), "e1", OutcomeRequest { http_status: Some(200), ..Default::default() });
        assert_eq!(u.len(), 1);
        assert!(u.due().is_empty(), "the first try waits a second");
        let key = AttemptKey { delivery_id: "d1".into(), generation: 0, attempt: 2 };
        assert!(u.take(&AttemptKey { attempt: 1, ..key.clone() }).is_none(), "another attempt's job finds nothing");
        let kept = u.take(&key).expect("kept");
        assert_eq!(kept.outcome.http_status, Some(200));
        assert_eq!(u.len(), 0);
        u.again(kept);
        assert_eq!(u.len(), 1);
        assert_eq!([0, 1, 2, 3, 4, 9].map(|t| backoff(t).as_secs()), [1, 2, 4, 8, 8, 8]);
    }
}
