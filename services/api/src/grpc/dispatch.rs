//! The internal seam the dispatcher calls: Expand, Material, Outcome, Replay.

use relay_contracts::relay::dispatch::v1::{self as pb, dispatch_service_server::DispatchService};
use tonic::{Request, Response, Status};
use tracing::field::Empty;

use super::{id, status, ts};
use crate::{
    app::{
        App,
        deliveries::{AttemptRef, AttemptReport, Decision, ExpandItem, Material},
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
    let reason = e.reason.to_owned();
    let st = status(e);
    pb::ItemError { code: st.code() as i32, reason, message: st.message().to_owned() }
}

fn material_message(m: Material) -> pb::MaterialResponse {
    pb::MaterialResponse {
        delivery_id: m.delivery_id.to_string(),
        endpoint_id: m.endpoint_id.to_string(),
        environment_id: m.environment_id.to_string(),
        event_id: m.event_id.to_string(),
        url: m.url,
        attempt: m.attempt,
        generation: m.generation,
        secrets: m.secrets.iter().map(|s| s.expose().to_owned()).collect(),
        payload: m.payload,
    }
}

fn outcome_message(d: Decision) -> pb::OutcomeResponse {
    let (decision, next) = match d {
        Decision::Delivered => (pb::OutcomeDecision::Delivered, None),
        Decision::Rescheduled { next_attempt_at } => (pb::OutcomeDecision::Rescheduled, Some(ts(next_attempt_at))),
        Decision::DeadLettered => (pb::OutcomeDecision::DeadLettered, None),
    };
    pb::OutcomeResponse { decision: decision as i32, next_attempt_at: next }
}

fn report(r: pb::OutcomeRequest) -> Result<AttemptReport, Status> {
    Ok(AttemptReport {
        delivery_id: id("delivery_id", &r.delivery_id)?,
        generation: r.generation,
        attempt: r.attempt,
        http_status: r.http_status,
        error: r.error,
        latency_ms: r.latency_ms,
        response_body: r.response_body,
    })
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
    ) -> Result<Vec<Result<pb::ExpandResponse, AppError>>, Status> {
        let mut spans = Vec::with_capacity(items.len());
        let mut parsed = Vec::with_capacity(items.len());
        for r in items {
            let span = tracing::info_span!("expand", event_id = %r.event_id, created = Empty, duplicate = Empty);
            match (r.traceparent.is_empty(), metadata) {
                (false, _) => relay_telemetry::set_parent_from_traceparent(&span, &r.traceparent),
                (true, Some(m)) => relay_telemetry::set_parent(&span, &relay_telemetry::GrpcMetadataRef(m)),
                (true, None) => {}
            }
            parsed.push(ExpandItem {
                event_id: id("event_id", &r.event_id)?,
                environment_id: id("environment_id", &r.environment_id)?,
                event_type: r.r#type,
                trace_context: span.in_scope(relay_telemetry::current_traceparent),
            });
            spans.push(span);
        }
        let answers = self.app.expand_batch(parsed).await.map_err(status)?;
        Ok(answers
            .into_iter()
            .zip(&spans)
            .map(|(a, span)| {
                a.map(|x| {
                    span.record("created", x.created).record("duplicate", x.duplicate);
                    pb::ExpandResponse { created: x.created, duplicate: x.duplicate }
                })
            })
            .collect())
    }
}

#[tonic::async_trait]
impl DispatchService for DispatchApi {
    async fn expand(&self, req: Request<pb::ExpandRequest>) -> Result<Response<pb::ExpandResponse>, Status> {
        let (metadata, _, item) = req.into_parts();
        let mut answers = self.expand_items(vec![item], Some(&metadata)).await?;
        match answers.pop().expect("one answer per item") {
            Ok(x) => Ok(Response::new(x)),
            Err(e) => Err(status(e)),
        }
    }

    async fn expand_batch(&self, req: Request<pb::ExpandBatchRequest>) -> Result<Response<pb::ExpandBatchResponse>, Status> {
        let items = req.into_inner().items;
        check_batch(items.len())?;
        let answers = self.expand_items(items, None).await?;
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
        let r = req.into_inner();
        let m = self.app.material(id("delivery_id", &r.delivery_id)?, r.generation, r.attempt).await.map_err(status)?;
        Ok(Response::new(material_message(m)))
    }

    async fn outcome(&self, req: Request<pb::OutcomeRequest>) -> Result<Response<pb::OutcomeResponse>, Status> {
        let decision = self.app.record_outcome(report(req.into_inner())?).await.map_err(status)?;
        Ok(Response::new(outcome_message(decision)))
    }

    async fn material_batch(&self, req: Request<pb::MaterialBatchRequest>) -> Result<Response<pb::MaterialBatchResponse>, Status> {
        let items = req.into_inner().items;
        check_batch(items.len())?;
        let wanted = items
            .iter()
            .map(|r| Ok(AttemptRef { delivery_id: id("delivery_id", &r.delivery_id)?, generation: r.generation, attempt: r.attempt }))
            .collect::<Result<Vec<_>, Status>>()?;
        let answers = self.app.material_batch(&wanted).await.map_err(status)?;
        let items = answers
            .into_iter()
            .map(|a| pb::MaterialResult {
                result: Some(match a {
                    Ok(m) => pb::material_result::Result::Material(material_message(m)),
                    Err(e) => pb::material_result::Result::Error(item_error(e)),
                }),
            })
            .collect();
        Ok(Response::new(pb::MaterialBatchResponse { items }))
    }

    async fn outcome_batch(&self, req: Request<pb::OutcomeBatchRequest>) -> Result<Response<pb::OutcomeBatchResponse>, Status> {
        let items = req.into_inner().items;
        check_batch(items.len())?;
        let reports = items.into_iter().map(report).collect::<Result<Vec<_>, Status>>()?;
        let answers = self.app.record_outcomes(reports).await.map_err(status)?;
        let items = answers
            .into_iter()
            .map(|a| pb::OutcomeResult {
                result: Some(match a {
                    Ok(d) => pb::outcome_result::Result::Outcome(outcome_message(d)),
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
