//! What the broker is told about each message, decided in this one place
//! from the api's answer (its gRPC code and the reason from the contracts'
//! catalogue, `relay_domain::Reason`).
//!
//! Each message ends in exactly one of: Ack (handled, including a customer's
//! failure, which is an outcome), Nak with a delay (we could not process it:
//! the api was unreachable; it comes back), or Term (it can never be
//! processed, e.g. undecodable bytes). The broker's redelivery budget is for
//! our failures only; the customer's attempt budget lives in the api.

use std::time::Duration;

use async_nats::jetstream::{AckKind, message::Message};
use relay_domain::Reason;
use tonic::Code;

/// Asking for a job back: 1 s, doubling with each redelivery, at most 30 s,
/// so an api outage is ridden out for many minutes within `MAX_DELIVER`.
pub(crate) fn retry_later(msg: &Message) -> AckKind {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).clamp(1, 6) as u32;
    AckKind::Nak(Some((Duration::from_secs(1) * 2u32.pow(delivered - 1)).min(Duration::from_secs(30))))
}

/// Asking for a job back whose attempt another dispatcher's claim holds:
/// 1 s, doubling, at most 4 s.
/// A claim ends with its outcome or runs out (a dead claimant's) within its
/// hold; at `retry_later`'s pace a job refused five times would wait 16–30 s
/// more after that. Well within `MAX_DELIVER`: the longest claim (an attempt
/// of 120 s) is outlived in about 35 tries.
pub(crate) fn retry_soon(msg: &Message) -> AckKind {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).clamp(1, 6) as u32;
    AckKind::Nak(Some((Duration::from_secs(1) * 2u32.pow(delivered - 1)).min(Duration::from_secs(4))))
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
    reason_of(st).and_then(|r| by_reason(r, for_event)).unwrap_or_else(|| by_code(st.code(), for_event))
}

/// The reason the api named in a status, if it is one of the catalogue's.
pub(crate) fn reason_of(st: &tonic::Status) -> Option<Reason> {
    st.metadata().get(relay_contracts::ERROR_REASON_METADATA).and_then(|v| v.to_str().ok()).and_then(Reason::parse)
}

/// The api asked for the same call again shortly (an event waiting for an
/// earlier event of its ordering key, a reply without room for an attempt).
pub(crate) fn is_deferred(st: &tonic::Status) -> bool {
    reason_of(st) == Some(Reason::Deferred)
}

/// The verdict for a reason in the contracts' catalogue, whatever the code.
fn by_reason(reason: Reason, for_event: bool) -> Option<Verdict> {
    use Reason::*;
    Some(match reason {
        // Another dispatcher is sending this attempt (if it reports, the
        // attempt is done; if it died, its claim runs out), or the reply had
        // no room for it: ask again later rather than send.
        InHandElsewhere | Deferred | PredecessorUnrecorded => Verdict::Retry,
        // The attempt is no longer current, or its endpoint was switched
        // off: nothing to send.
        StaleAttempt | EndpointInactive | AlreadyReplayed => Verdict::Ack,
        // An event the api does not know can never be expanded; a delivery
        // that is gone has nothing to send.
        NotFound if for_event => Verdict::Term,
        NotFound => Verdict::Ack,
        // An event that does not match the api's record never will.
        EventMismatch => Verdict::Term,
        _ => return None,
    })
}

/// The verdict for an answer whose reason is not in the catalogue (a
/// checked-input refusal, or a transport failure with no reason at all).
fn by_code(code: Code, for_event: bool) -> Verdict {
    match code {
        // A message the api refuses to read will be refused every time.
        Code::InvalidArgument => Verdict::Term,
        Code::NotFound if for_event => Verdict::Term,
        Code::FailedPrecondition | Code::NotFound => Verdict::Ack,
        // The api is away or failing: the message comes back.
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
            (Code::Unavailable, "in_hand_elsewhere", false, Retry),
            (Code::Unavailable, "deferred", false, Retry),
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

    #[test]
    fn every_reason_in_the_catalogue_has_its_own_verdict() {
        for reason in Reason::SEAM {
            let (reason, text) = (*reason, reason.as_str());
            for for_event in [false, true] {
                let v = by_reason(reason, for_event);
                assert!(v.is_some(), "{text} (event={for_event}) falls through to the code");
                // The reason decides, whatever code carries it.
                for code in [Code::Unavailable, Code::FailedPrecondition, Code::NotFound, Code::Internal] {
                    assert_eq!(Some(verdict(&status(code, text), for_event)), v, "{text} under {code:?}");
                }
            }
        }
    }
}
