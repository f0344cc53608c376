//! The internal seam the dispatcher calls: Expand, Material, Outcome, Replay.

use std::time::Duration;

use relay_contracts::relay::dispatch::v1::{self as pb, dispatch_service_server::DispatchService};
use relay_domain::{EndpointId, EnvironmentId, EventId, Reason};
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};
use tracing::field::Empty;

use super::{id, status, ts};
use crate::error::parse_id;
use crate::{
    app::{
        App,
        deliveries::{AttemptRef, AttemptReport, Claim, Decision, ExpandItem, MAX_CLAIM_HOLD, Material, OutcomeAsk},
        expansion::ExpandAsk,
    },
    error::AppError,
};

/// The most items one batch call may carry.
pub const MAX_BATCH: usize = 1000;

fn check_batch(len: usize) -> Result<(), Status> {
    if len > MAX_BATCH {
        return Err(Status::invalid_argument(format!("a batch may carry at most {MAX_BATCH} items; this one has {len}")));
    }
    Ok(())
}

fn item_error(e: AppError) -> pb::ItemError {
    let reason = e.reason.as_str().to_owned();
    let st = status(e);
    pb::ItemError { code: st.code() as i32, reason, message: st.message().to_owned() }
}

fn material_message(m: Material) -> pb::MaterialResponse {
    pb::MaterialResponse {
        followers: m.followers.into_iter().map(material_message).collect(),
        delivery_id: m.delivery_id.to_string(),
        endpoint_id: m.endpoint_id.to_string(),
        environment_id: m.environment_id.to_string(),
        event_id: m.event_id.to_string(),
        url: m.url,
        attempt: m.attempt,
        generation: m.generation,
        secrets: m.secrets.iter().map(|s| s.expose().to_owned()).collect(),
        payload: m.payload,
        traceparent: m.traceparent.unwrap_or_default(),
        signature_scheme: scheme_message(m.scheme) as i32,
        headers: m.headers.pairs().iter().cloned().collect(),
        client_identity_pem: m.auth.identity_pem.unwrap_or_default(),
        previous_client_identity_pem: m.auth.previous_identity_pem.unwrap_or_default(),
        max_in_flight: m.max_in_flight.unwrap_or(0),
        ordering_position: m.ordering.as_ref().map_or(0, |(_, p)| (*p).max(0) as u64),
        ordering_key: m.ordering.map(|(k, _)| k).unwrap_or_default(),
        ca_bundle: m.auth.ca_bundle.unwrap_or_default(),
        oauth2: m.auth.oauth2.map(|o| pb::OAuth2ClientCredentials {
            token_url: o.token_url,
            client_id: o.client_id,
            client_secret: o.client_secret,
            scope: o.scope,
            audience: o.audience,
        }),
    }
}

fn scheme_message(scheme: relay_signing::Scheme) -> pb::SignatureScheme {
    match scheme {
        relay_signing::Scheme::RelayV1 => pb::SignatureScheme::RelayV1,
        relay_signing::Scheme::StandardWebhooks => pb::SignatureScheme::StandardWebhooks,
        relay_signing::Scheme::StandardWebhooksEd25519 => pb::SignatureScheme::StandardWebhooksEd25519,
    }
}

fn outcome_message(d: Decision, next: Vec<Material>) -> pb::OutcomeResponse {
    let (decision, next_attempt_at) = match d {
        Decision::Delivered => (pb::OutcomeDecision::Delivered, None),
        Decision::Rescheduled { next_attempt_at } => (pb::OutcomeDecision::Rescheduled, Some(ts(next_attempt_at))),
        Decision::DeadLettered => (pb::OutcomeDecision::DeadLettered, None),
    };
    pb::OutcomeResponse { decision: decision as i32, next_attempt_at, next: next.into_iter().map(material_message).collect() }
}

/// The most bytes of an error text or response body a report may carry;
/// the attempt log keeps far less, so more can only be a broken caller.
const MAX_REPORT_TEXT: usize = 64 * 1024;
/// The longest an attempt can have taken and still be reported (a day).
const MAX_LATENCY_MS: u64 = 24 * 3600 * 1000;
/// The longest W3C traceparent accepted (they are 55 characters).
const MAX_TRACEPARENT: usize = 256;

fn invalid(reason: Reason, message: String) -> AppError {
    AppError::invalid(reason, message)
}

/// An attempt number and generation as the database holds them; the
/// schedule's own bound on attempts is the app's to check.
fn attempt_and_generation(attempt: u32, generation: u32) -> Result<(u32, u32), AppError> {
    if attempt == 0 || attempt > MAX_ATTEMPT {
        return Err(invalid(Reason::AttemptOutOfRange, format!("attempt must be from 1 to {MAX_ATTEMPT}, got {attempt}")));
    }
    if generation > i32::MAX as u32 {
        return Err(invalid(Reason::GenerationOutOfRange, format!("generation may be at most {}, got {generation}", i32::MAX)));
    }
    Ok((attempt, generation))
}

/// The most followers one report may release (a run hands out fewer).
const MAX_RELEASED_FOLLOWERS: usize = 1000;

/// The highest attempt number any schedule can reach.
const MAX_ATTEMPT: u32 = 1000;

/// A report as the app takes it, every field checked: a caller's mistake is
/// INVALID_ARGUMENT naming the field and the number, never a panic or a
/// silently wrapped value.
pub(crate) fn report(r: pb::OutcomeRequest) -> Result<AttemptReport, AppError> {
    let delivery_id = parse_id("delivery_id", &r.delivery_id)?;
    let (attempt, generation) = attempt_and_generation(r.attempt, r.generation)?;
    if let Some(s) = r.http_status
        && !(100..=599).contains(&s)
    {
        return Err(invalid(Reason::HttpStatusOutOfRange, format!("http_status must be from 100 to 599, got {s}")));
    }
    if r.error.len() > MAX_REPORT_TEXT || r.response_body.len() > MAX_REPORT_TEXT {
        return Err(invalid(
            Reason::ReportTooLarge,
            format!(
                "error and response_body may be at most {MAX_REPORT_TEXT} bytes each; got {} and {}",
                r.error.len(),
                r.response_body.len()
            ),
        ));
    }
    if r.latency_ms > MAX_LATENCY_MS {
        return Err(invalid(Reason::LatencyOutOfRange, format!("latency_ms may be at most {MAX_LATENCY_MS}, got {}", r.latency_ms)));
    }
    if r.released_followers.len() > MAX_RELEASED_FOLLOWERS {
        return Err(invalid(
            Reason::ReportTooLarge,
            format!("released_followers may name at most {MAX_RELEASED_FOLLOWERS} deliveries; got {}", r.released_followers.len()),
        ));
    }
    let released_followers = r.released_followers.iter().map(|id| parse_id("released_followers", id)).collect::<Result<_, _>>()?;
    let next_follower = Some(r.next_follower.as_str()).filter(|id| !id.is_empty()).map(|id| parse_id("next_follower", id)).transpose()?;
    Ok(AttemptReport {
        delivery_id,
        generation,
        attempt,
        http_status: r.http_status,
        error: r.error,
        latency_ms: r.latency_ms,
        response_body: r.response_body,
        retry_after: r.retry_after_ms.map(std::time::Duration::from_millis),
        lane_follower: r.lane_follower,
        released_followers,
        next_follower,
        signature_scheme: match pb::SignatureScheme::try_from(r.signature_scheme) {
            Ok(pb::SignatureScheme::Unspecified) => None,
            Ok(pb::SignatureScheme::RelayV1) => Some(relay_signing::Scheme::RelayV1),
            Ok(pb::SignatureScheme::StandardWebhooks) => Some(relay_signing::Scheme::StandardWebhooks),
            Ok(pb::SignatureScheme::StandardWebhooksEd25519) => Some(relay_signing::Scheme::StandardWebhooksEd25519),
            Err(_) => {
                return Err(invalid(
                    Reason::UnknownSignatureScheme,
                    format!("signature_scheme {} is not a known scheme", r.signature_scheme),
                ));
            }
        },
    })
}

pub(crate) fn attempt_ref(r: &pb::MaterialRequest) -> Result<AttemptRef, AppError> {
    let delivery_id = parse_id("delivery_id", &r.delivery_id)?;
    let (attempt, generation) = attempt_and_generation(r.attempt, r.generation)?;
    let claim = claim("claimant", &r.claimant, r.hold_ms)?;
    Ok(AttemptRef { delivery_id, generation, attempt, claim })
}

/// A dispatcher taking attempts in hand with a reply (ExpandBatch,
/// OutcomeBatch): it sends them without asking again while their material
/// is fresh, so its lease and claim must outlast that.
fn in_hand_claim(claimant: &str, hold_ms: u32) -> Result<Option<Claim>, AppError> {
    let claim = claim("claimant", claimant, hold_ms)?;
    if let Some(c) = claim
        && c.hold < relay_config::timing::MIN_IN_HAND_LEASE
    {
        return Err(invalid(
            Reason::HoldOutOfRange,
            format!(
                "hold_ms must be at least {} for attempts taken in hand, got {hold_ms}",
                relay_config::timing::MIN_IN_HAND_LEASE.as_millis()
            ),
        ));
    }
    Ok(claim)
}

/// A claimant and how long it holds what it takes; none when no claimant is named.
fn claim(field: &'static str, claimant: &str, hold_ms: u32) -> Result<Option<Claim>, AppError> {
    if claimant.is_empty() {
        return Ok(None);
    }
    let hold = Duration::from_millis(u64::from(hold_ms));
    if hold.is_zero() || hold > MAX_CLAIM_HOLD {
        return Err(invalid(
            Reason::HoldOutOfRange,
            format!("hold_ms must be from 1 to {} with a claimant, got {hold_ms}", MAX_CLAIM_HOLD.as_millis()),
        ));
    }
    Ok(Some(Claim { claimant: parse_id(field, claimant)?, hold }))
}

/// An expand item's fields, checked; the traceparent is dropped if it is
/// not one (tracing is best effort, never a reason to refuse an event).
fn expand_fields(r: &pb::ExpandRequest) -> Result<(EventId, EnvironmentId, Option<EndpointId>), AppError> {
    let event_id = parse_id("event_id", &r.event_id)?;
    let environment_id = parse_id("environment_id", &r.environment_id)?;
    crate::app::endpoints::check_event_type(&r.r#type)?;
    let target = if r.target_endpoint_id.is_empty() { None } else { Some(parse_id("target_endpoint_id", &r.target_endpoint_id)?) };
    Ok((event_id, environment_id, target))
}

#[derive(Debug, Clone)]
pub struct DispatchApi {
    pub app: App,
}

impl DispatchApi {
    /// Expands items with one span each, in its own event's trace: the
    /// item's traceparent, else (a single call) the request's metadata.
    async fn expand_items(
        &self,
        items: Vec<pb::ExpandRequest>,
        metadata: Option<&tonic::metadata::MetadataMap>,
        claim: Option<Claim>,
        express: bool,
    ) -> Result<Vec<Result<pb::ExpandResponse, AppError>>, Status> {
        let mut answers: Vec<Option<Result<pb::ExpandResponse, AppError>>> = Vec::with_capacity(items.len());
        let mut spans = Vec::with_capacity(items.len());
        let mut parsed = Vec::with_capacity(items.len());
        for r in items {
            let (event_id, environment_id, target) = match expand_fields(&r) {
                Ok(ids) => ids,
                Err(e) => {
                    answers.push(Some(Err(e)));
                    continue;
                }
            };
            let span = tracing::info_span!("expand", event_id = %event_id, created = Empty, duplicate = Empty);
            let traceparent = if r.traceparent.len() <= MAX_TRACEPARENT { r.traceparent.as_str() } else { "" };
            match (traceparent.is_empty(), metadata) {
                (false, _) => relay_telemetry::set_parent_from_traceparent(&span, traceparent),
                (true, Some(m)) => relay_telemetry::set_parent(&span, &relay_telemetry::GrpcMetadataRef(m)),
                (true, None) => {}
            }
            let item = ExpandItem {
                event_id,
                environment_id,
                event_type: r.r#type,
                trace_context: span.in_scope(relay_telemetry::current_traceparent),
                target,
            };
            parsed.push(ExpandAsk { item, claim });
            spans.push(span);
            answers.push(None);
        }
        let expanded = if parsed.is_empty() { Vec::new() } else { self.app.expand_batch(parsed, express).await.map_err(status)? };
        let mut expanded = expanded.into_iter().zip(spans).map(|(a, span)| {
            a.map(|x| {
                span.record("created", x.created).record("duplicate", x.duplicate);
                pb::ExpandResponse {
                    created: x.created,
                    duplicate: x.duplicate,
                    attempts: x.attempts.into_iter().map(material_message).collect(),
                }
            })
        });
        Ok(answers.into_iter().map(|a| a.unwrap_or_else(|| expanded.next().expect("one answer per valid item"))).collect())
    }
}

/// What `TakeAttempts` streams: each batch of attempts sent to this
/// dispatcher, for as long as it reads; its place among the takers goes
/// when the stream is dropped.
pub type TakenStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::TakeAttemptsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DispatchService for DispatchApi {
    type TakeAttemptsStream = TakenStream;

    async fn take_attempts(&self, req: Request<pb::TakeAttemptsRequest>) -> Result<Response<Self::TakeAttemptsStream>, Status> {
        let req = req.into_inner();
        let claim = in_hand_claim(&req.claimant, req.hold_ms)
            .and_then(|c| c.ok_or_else(|| invalid(Reason::MissingField, "claimant is required".to_owned())))
            .map_err(status)?;
        let (joined, rx) = self.app.at_publish().join(claim);
        let taken = crate::app::at_publish::Taken::new(self.app.clone(), joined, rx, claim)
            .map(|attempts| Ok(pb::TakeAttemptsResponse { attempts: attempts.into_iter().map(material_message).collect() }));
        Ok(Response::new(Box::pin(taken)))
    }

    async fn expand(&self, req: Request<pb::ExpandRequest>) -> Result<Response<pb::ExpandResponse>, Status> {
        let (metadata, _, item) = req.into_parts();
        let mut answers = self.expand_items(vec![item], Some(&metadata), None, false).await?;
        match answers.pop().expect("one answer per item") {
            Ok(x) => Ok(Response::new(x)),
            Err(e) => Err(status(e)),
        }
    }

    async fn expand_batch(&self, req: Request<pb::ExpandBatchRequest>) -> Result<Response<pb::ExpandBatchResponse>, Status> {
        let req = req.into_inner();
        check_batch(req.items.len())?;
        let claim = in_hand_claim(&req.claimant, req.hold_ms).map_err(status)?;
        let answers = self.expand_items(req.items, None, claim, req.express).await?;
        let items = answers
            .into_iter()
            .map(|a| pb::ExpandResult {
                result: Some(match a {
                    Ok(x) => pb::expand_result::Result::Expanded(x),
                    Err(e) => pb::expand_result::Result::Error(item_error(e)),
                }),
            })
            .collect();
        Ok(Response::new(pb::ExpandBatchResponse { items }))
    }

    async fn material(&self, req: Request<pb::MaterialRequest>) -> Result<Response<pb::MaterialResponse>, Status> {
        let m = self.app.material(attempt_ref(req.get_ref()).map_err(status)?).await.map_err(status)?;
        Ok(Response::new(material_message(m)))
    }

    async fn outcome(&self, req: Request<pb::OutcomeRequest>) -> Result<Response<pb::OutcomeResponse>, Status> {
        let decision = self.app.record_outcome(report(req.into_inner()).map_err(status)?).await.map_err(status)?;
        Ok(Response::new(outcome_message(decision, Vec::new())))
    }

    async fn material_batch(&self, req: Request<pb::MaterialBatchRequest>) -> Result<Response<pb::MaterialBatchResponse>, Status> {
        let items = req.into_inner().items;
        check_batch(items.len())?;
        let checked: Vec<Result<AttemptRef, AppError>> = items.iter().map(attempt_ref).collect();
        let wanted: Vec<AttemptRef> = checked.iter().filter_map(|c| c.as_ref().ok().copied()).collect();
        let served = if wanted.is_empty() { Vec::new() } else { self.app.material_batch(&wanted).await.map_err(status)? };
        let mut served = served.into_iter();
        let items = checked
            .into_iter()
            .map(|c| pb::MaterialResult {
                result: Some(match c.and_then(|_| served.next().expect("one answer per valid item")) {
                    Ok(m) => pb::material_result::Result::Material(material_message(m)),
                    Err(e) => pb::material_result::Result::Error(item_error(e)),
                }),
            })
            .collect();
        Ok(Response::new(pb::MaterialBatchResponse { items }))
    }

    async fn outcome_batch(&self, req: Request<pb::OutcomeBatchRequest>) -> Result<Response<pb::OutcomeBatchResponse>, Status> {
        let req = req.into_inner();
        check_batch(req.items.len())?;
        let claim = in_hand_claim(&req.claimant, req.hold_ms).map_err(status)?;
        let checked: Vec<Result<AttemptReport, AppError>> = req.items.into_iter().map(report).collect();
        let asks: Vec<OutcomeAsk> =
            checked.iter().filter_map(|c| c.as_ref().ok().cloned()).map(|report| OutcomeAsk { report, claim }).collect();
        let recorded = if asks.is_empty() { Vec::new() } else { self.app.record_outcomes(asks).await.map_err(status)? };
        let mut recorded = recorded.into_iter();
        let items = checked
            .into_iter()
            .map(|c| pb::OutcomeResult {
                result: Some(match c.and_then(|_| recorded.next().expect("one answer per valid item")) {
                    Ok(r) => pb::outcome_result::Result::Outcome(outcome_message(r.decision, r.next)),
                    Err(e) => pb::outcome_result::Result::Error(item_error(e)),
                }),
            })
            .collect();
        Ok(Response::new(pb::OutcomeBatchResponse { items }))
    }

    async fn replay(&self, req: Request<pb::ReplayRequest>) -> Result<Response<pb::ReplayResponse>, Status> {
        let delivery_id = self.app.replay_dead_letter(None, id("dead_letter_id", &req.get_ref().dead_letter_id)?).await.map_err(status)?;
        Ok(Response::new(pb::ReplayResponse { delivery_id: delivery_id.to_string() }))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_report_is_taken_only_with_every_field_in_range(
            id in prop_oneof![Just(uuid::Uuid::new_v4().to_string()), "\\PC{0,40}"],
            attempt in any::<u32>(),
            generation in any::<u32>(),
            http_status in proptest::option::of(any::<u32>()),
            error_len in 0usize..70_000,
            latency_ms in any::<u64>(),
            retry_after_ms in proptest::option::of(any::<u64>()),
            signature_scheme in -2i32..6,
            released_followers in proptest::collection::vec(prop_oneof![Just(uuid::Uuid::new_v4().to_string()), "\\PC{0,12}"], 0..3),
            next_follower in prop_oneof![Just(String::new()), Just(uuid::Uuid::new_v4().to_string()), "\\PC{1,12}"],
        ) {
            let ids_valid = released_followers.iter().all(|f| uuid::Uuid::parse_str(f.trim()).is_ok())
                && (next_follower.is_empty() || uuid::Uuid::parse_str(next_follower.trim()).is_ok());
            let r = pb::OutcomeRequest {
                delivery_id: id.clone(),
                attempt,
                generation,
                http_status,
                error: "e".repeat(error_len),
                latency_ms,
                response_body: Vec::new(),
                retry_after_ms,
                signature_scheme,
                lane_follower: latency_ms % 2 == 0,
                released_followers,
                next_follower,
            };
            let valid = ids_valid
                && uuid::Uuid::parse_str(id.trim()).is_ok()
                && (1..=MAX_ATTEMPT).contains(&attempt)
                && generation <= i32::MAX as u32
                && http_status.is_none_or(|s| (100..=599).contains(&s))
                && error_len <= MAX_REPORT_TEXT
                && latency_ms <= MAX_LATENCY_MS
                && (0..=3).contains(&signature_scheme);
            match report(r) {
                Ok(taken) => {
                    prop_assert!(valid);
                    prop_assert_eq!((taken.attempt, taken.generation), (attempt, generation));
                }
                Err(e) => {
                    prop_assert!(!valid, "refused a valid report: {e:?}");
                    prop_assert_eq!(e.code, crate::error::ErrorCode::InvalidArgument);
                    prop_assert!(e.message.len() < 300, "{}", e.message);
                }
            }
        }

        #[test]
        fn a_material_request_is_taken_only_with_its_numbers_in_range(attempt in any::<u32>(), generation in any::<u32>()) {
            let r = pb::MaterialRequest { delivery_id: uuid::Uuid::new_v4().to_string(), attempt, generation, ..Default::default() };
            let valid = (1..=MAX_ATTEMPT).contains(&attempt) && generation <= i32::MAX as u32;
            prop_assert_eq!(attempt_ref(&r).is_ok(), valid);
        }
    }
}
