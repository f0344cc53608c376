//! How an attempt in a lane's hands is settled: where it came from (which
//! says what the broker is told), its report to the api, retried briefly
//! (a lane follower's while its predecessor's report has not landed), and
//! the lane followers lately sent, whose copies handed back are dropped.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use async_nats::jetstream::{AckKind, message::Message};
use relay_config::timing::MATERIAL_FRESH;
use relay_contracts::{
    AttemptKey,
    relay::{
        dispatch::v1::{MaterialResponse, OutcomeRequest},
        queue::v1::DeliveryJob,
    },
};
use relay_domain::Reason;
use std::sync::Arc;

use crate::{
    batch,
    unreported::Unreported,
    verdict::{Verdict, retry_later, settle_by},
};

/// Where a job came from, which is how it is settled.
pub(crate) enum Source {
    /// A DELIVERIES message, acked once the outcome is recorded.
    Broker(Arc<Message>),
    /// Handed over by an expansion, leased to this process in Postgres: there
    /// is nothing to ack, and a job given up on falls due again when its
    /// lease runs out. Carries its event's trace context.
    InHand { traceparent: Option<String> },
}

impl Source {
    pub(crate) async fn settle(&self, v: Verdict) {
        match self {
            Self::Broker(msg) => settle_by(msg, v).await,
            Self::InHand { .. } => {
                if v != Verdict::Ack {
                    tracing::debug!(verdict = ?v, "an attempt in hand given up; its lease brings it back");
                }
            }
        }
    }

    pub(crate) async fn retry_later(&self) {
        if let Self::Broker(msg) = self {
            crate::verdict::settle(msg, retry_later(msg)).await;
        }
    }

    /// Asks for a job back soon: its attempt is in another claimant's
    /// hands, which ends within the claim's hold.
    pub(crate) async fn retry_soon(&self) {
        if let Self::Broker(msg) = self {
            crate::verdict::settle(msg, crate::verdict::retry_soon(msg)).await;
        }
    }

    /// Asks the broker for a copy back once `after` has passed: the copy of
    /// an attempt this process holds stays in the stream (not acked) until
    /// the original has surely ended, so that if this process dies
    /// meanwhile the copy, not the attempt's next lease, brings it back.
    pub(crate) async fn back_after(&self, after: Duration) {
        if let Self::Broker(msg) = self {
            crate::verdict::settle(msg, AckKind::Nak(Some(after))).await;
        }
    }

    pub(crate) async fn in_progress(&self) {
        if let Self::Broker(msg) = self {
            let _ = msg.ack_with(AckKind::Progress).await;
        }
    }
}

/// Lane followers' attempts this process sent and settled within
/// `MATERIAL_FRESH`. A follower is sent before its predecessor's outcome is
/// recorded, and the api may meanwhile hand the same attempt back as its
/// lane's new head, with material still fresh: that copy is dropped, not
/// sent again (and not its followers after it). Older material is asked
/// for again, and the api refuses a recorded attempt's.
#[derive(Default)]
pub(crate) struct SentLately(std::sync::Mutex<HashMap<AttemptKey, Instant>>);

impl SentLately {
    pub(crate) fn note(&self, key: AttemptKey) {
        let mut sent = self.0.lock().expect("unpoisoned");
        if sent.len() >= 4096 {
            sent.retain(|_, at| at.elapsed() <= MATERIAL_FRESH);
        }
        sent.insert(key, Instant::now());
    }

    pub(crate) fn holds(&self, key: &AttemptKey) -> bool {
        self.0.lock().expect("unpoisoned").get(key).is_some_and(|at| at.elapsed() <= MATERIAL_FRESH)
    }
}

/// How long a lane follower's report waits before it is sent again while
/// its predecessor's outcome is unrecorded, by how many times it has been
/// told so: a millisecond for the first 64 (the predecessor's report is
/// usually in the batch call beside it, landing within milliseconds; a
/// longer wait would hold up the key's next run, which is handed out only
/// once the last of this one is recorded), then doubling to half a
/// second, about 12 s in all, then given up like any report.
fn predecessor_wait(told: u32) -> Option<u64> {
    match told {
        0..64 => Some(1),
        64..94 => Some(2u64 << (told - 64).min(8)),
        _ => None,
    }
}

/// Where reports go: the api's outcome batcher, the outcomes it has not
/// taken, and what takes the next attempts a decision hands back.
pub(crate) struct Reporting<'a, H: Fn(MaterialResponse)> {
    pub outcomes: &'a batch::Outcomes,
    pub unreported: &'a Unreported,
    pub hand: H,
}

/// The POST has happened; report it, retrying briefly. If the api stays away
/// the outcome is kept (`unreported`) and reported again in the background;
/// a broker job comes back meanwhile, and an attempt in hand falls due again
/// when its lease runs out, and either is reported from what is kept rather
/// than sent again when it reaches this process (another dispatcher may
/// send it once this one's claim runs out: the receiver may then see the
/// event id twice, and the schedule still advances once). An attempt in
/// hand is retried for longer first, as nothing else would bring it back
/// sooner. `urgent`: the next delivery of the attempt's ordering key waits
/// on it, so its call does not linger for company.
pub(crate) async fn report<H: Fn(MaterialResponse)>(
    to: &Reporting<'_, H>,
    source: &Source,
    job: &DeliveryJob,
    event_id: &str,
    outcome: OutcomeRequest,
    urgent: bool,
) {
    let (status, error) = (outcome.http_status, outcome.error.clone());
    let backoffs: &[u64] = match source {
        Source::Broker(_) => &[0, 200, 1000],
        Source::InHand { .. } => &[0, 200, 1000, 2000, 4000, 8000],
    };
    let mut backoffs = backoffs.iter().copied();
    let mut behind_predecessor = 0u32;
    let mut backoff = backoffs.next();
    while let Some(wait) = backoff {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let recorded = if urgent { to.outcomes.call_now(outcome.clone()).await } else { to.outcomes.call(outcome.clone()).await };
        match recorded {
            Ok(mut decision) => {
                // The endpoint's next attempts, taking the slot this one freed.
                for next in std::mem::take(&mut decision.next) {
                    (to.hand)(next);
                }
                tracing::Span::current().record("outcome", decision.decision().as_str_name());
                tracing::info!(
                    delivery_id = %job.delivery_id, event_id = %event_id, attempt = job.attempt, status = ?status, error = %error,
                    decision = decision.decision, "attempt recorded"
                );
                return source.settle(Verdict::Ack).await;
            }
            // A lane follower's report that overtook its predecessor's:
            // again in a moment, for a few seconds at most (its
            // predecessor's report is on its way from this process).
            Err(st)
                if crate::verdict::reason_of(&st) == Some(Reason::PredecessorUnrecorded)
                    && predecessor_wait(behind_predecessor).is_some() =>
            {
                backoff = predecessor_wait(behind_predecessor);
                behind_predecessor += 1;
            }
            // The api knows better (the attempt is no longer current): nothing to keep.
            Err(st) if crate::verdict::verdict(&st, false) != Verdict::Retry => {
                tracing::info!(delivery_id = %job.delivery_id, code = ?st.code(), message = st.message(), "the api refused an outcome");
                return source.settle(Verdict::Ack).await;
            }
            Err(st) => {
                tracing::warn!(delivery_id = %job.delivery_id, code = ?st.code(), message = st.message(), "reporting an outcome failed");
                backoff = backoffs.next();
            }
        }
    }
    to.unreported.keep(job, event_id, outcome);
    source.retry_later().await
}
