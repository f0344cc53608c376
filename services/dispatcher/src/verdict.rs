//! What the broker is told about each message, decided in this one place
//! from the api's answer (its gRPC code and the reason from the contracts'
//! catalogue, `relay_contracts::reasons`).
//!
//! Each message ends in exactly one of: Ack (handled, including a customer's
//! failure, which is an outcome), Nak with a delay (we could not process it:
//! the api was unreachable; it comes back), or Term (it can never be
//! processed, e.g. undecodable bytes). The broker's redelivery budget is for
//! our failures only; the customer's attempt budget lives in the api.

use std::time::Duration;

use async_nats::jetstream::{AckKind, message::Message};
use tonic::Code;

/// Asking for a job back: 1 s, doubling with each redelivery, at most 30 s,
/// so an api outage is ridden out for many minutes within `MAX_DELIVER`.
pub(crate) fn retry_later(msg: &Message) -> AckKind {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).clamp(1, 6) as u32;
    AckKind::Nak(Some((Duration::from_secs(1) * 2u32.pow(delivered - 1)).min(Duration::from_secs(30))))
}

/// What the broker is told about a message, decided from the api's answer in
/// this one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Handled, or nothing left to do for it.
    Ack,
    /// Not handled this time; it comes back after a delay.
    Retry,
    /// It can never be handled.
    Term,
}

/// The verdict for an answer of the api that is not a success. `for_event`:
/// an EVENTS message (expansion), else a DELIVERIES job (material).
pub(crate) fn verdict(st: &tonic::Status, for_event: bool) -> Verdict {
    let reason = st.metadata().get(relay_contracts::ERROR_REASON_METADATA).and_then(|v| v.to_str().ok()).unwrap_or_default();
    match (st.code(), reason) {
        // Another dispatcher is sending this attempt: if it reports, the
        // attempt is done; if it died, its claim runs out. Either way, ask
        // again later rather than send.
        (_, relay_contracts::reasons::IN_HAND_ELSEWHERE) => Verdict::Retry,
        // An event the api does not know, or that does not match its record.
        (Code::NotFound | Code::InvalidArgument, _) if for_event => Verdict::Term,
        // The attempt is no longer current (reported, delivery finished,
        // endpoint switched off) or the delivery is gone: nothing to send.
        (Code::FailedPrecondition | Code::NotFound, _) => Verdict::Ack,
        // A job the api refuses to read will be refused every time.
        (Code::InvalidArgument, _) => Verdict::Term,
        // The api is away or failing: the job comes back.
        _ => Verdict::Retry,
    }
}

pub(crate) async fn settle_by(msg: &Message, v: Verdict) {
    let kind = match v {
        Verdict::Ack => AckKind::Ack,
        Verdict::Retry => retry_later(msg),
        Verdict::Term => AckKind::Term,
    };
    settle(msg, kind).await
}

pub(crate) async fn settle(msg: &Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "settling a message with the broker failed; it will be redelivered");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, reason: &str) -> tonic::Status {
        let mut st = tonic::Status::new(code, "x");
        if !reason.is_empty() {
            st.metadata_mut().insert(relay_contracts::ERROR_REASON_METADATA, reason.parse().unwrap());
        }
        st
    }

    #[test]
    fn the_apis_answers_map_to_one_broker_verdict_each() {
        use Verdict::*;
        for (code, reason, for_event, want) in [
            (Code::Unavailable, relay_contracts::reasons::IN_HAND_ELSEWHERE, false, Retry),
            (Code::FailedPrecondition, "stale_attempt", false, Ack),
            (Code::FailedPrecondition, "endpoint_inactive", false, Ack),
            (Code::NotFound, "not_found", false, Ack),
            (Code::InvalidArgument, "attempt_out_of_range", false, Term),
            (Code::Unavailable, "", false, Retry),
            (Code::Internal, "", false, Retry),
            (Code::DeadlineExceeded, "", false, Retry),
            (Code::NotFound, "not_found", true, Term),
            (Code::InvalidArgument, "event_mismatch", true, Term),
            (Code::Unavailable, "", true, Retry),
        ] {
            assert_eq!(verdict(&status(code, reason), for_event), want, "{code:?} {reason} event={for_event}");
        }
    }
}
