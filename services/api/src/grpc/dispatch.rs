//! The internal seam the dispatcher calls: Expand, Material, Outcome, Replay.

use relay_contracts::relay::dispatch::v1::{self as pb, dispatch_service_server::DispatchService};
use tonic::{Request, Response, Status};

use super::{id, status, ts};
use crate::app::{
    App,
    deliveries::{AttemptReport, Decision},
};

#[derive(Debug, Clone)]
pub struct DispatchApi {
    pub app: App,
}

#[tonic::async_trait]
impl DispatchService for DispatchApi {
    async fn expand(&self, req: Request<pb::ExpandRequest>) -> Result<Response<pb::ExpandResponse>, Status> {
        let r = req.into_inner();
        let x = self.app.expand(id("event_id", &r.event_id)?, id("environment_id", &r.environment_id)?, &r.r#type).await.map_err(status)?;
        Ok(Response::new(pb::ExpandResponse { created: x.created, duplicate: x.duplicate }))
    }

    async fn material(&self, req: Request<pb::MaterialRequest>) -> Result<Response<pb::MaterialResponse>, Status> {
        let r = req.into_inner();
        let m = self.app.material(id("delivery_id", &r.delivery_id)?, r.generation, r.attempt).await.map_err(status)?;
        Ok(Response::new(pb::MaterialResponse {
            delivery_id: m.delivery_id.to_string(),
            endpoint_id: m.endpoint_id.to_string(),
            environment_id: m.environment_id.to_string(),
            event_id: m.event_id.to_string(),
            url: m.url,
            attempt: m.attempt,
            generation: m.generation,
            secrets: m.secrets.iter().map(|s| s.expose().to_owned()).collect(),
            payload: m.payload,
        }))
    }

    async fn outcome(&self, req: Request<pb::OutcomeRequest>) -> Result<Response<pb::OutcomeResponse>, Status> {
        let r = req.into_inner();
        let decision = self
            .app
            .record_outcome(AttemptReport {
                delivery_id: id("delivery_id", &r.delivery_id)?,
                generation: r.generation,
                attempt: r.attempt,
                http_status: r.http_status,
                error: r.error,
                latency_ms: r.latency_ms,
                response_body: r.response_body,
            })
            .await
            .map_err(status)?;
        let (decision, next) = match decision {
            Decision::Delivered => (pb::OutcomeDecision::Delivered, None),
            Decision::Rescheduled { next_attempt_at } => (pb::OutcomeDecision::Rescheduled, Some(ts(next_attempt_at))),
            Decision::DeadLettered => (pb::OutcomeDecision::DeadLettered, None),
        };
        Ok(Response::new(pb::OutcomeResponse { decision: decision as i32, next_attempt_at: next }))
    }

    async fn replay(&self, req: Request<pb::ReplayRequest>) -> Result<Response<pb::ReplayResponse>, Status> {
        let delivery_id = self.app.replay_dead_letter(None, id("dead_letter_id", &req.get_ref().dead_letter_id)?).await.map_err(status)?;
        Ok(Response::new(pb::ReplayResponse { delivery_id: delivery_id.to_string() }))
    }
}
