//! The operator's AdminService, on the internal mTLS port.

use relay_contracts::relay::admin::v1::{self as pb, admin_service_server::AdminService};
use tonic::{Request, Response, Status};

use super::{
    id, status,
    tenant::{dead_letter, delivery, endpoint},
    ts,
};
use crate::app::{
    App,
    admin::{ApiKey, Environment},
};

#[derive(Debug, Clone)]
pub struct AdminApi {
    pub app: App,
}

fn environment(e: Environment) -> pb::Environment {
    pb::Environment {
        id: e.id.to_string(),
        name: e.name,
        endpoint_quota: e.endpoint_quota as u32,
        created_at: Some(ts(e.created_at)),
        disable_after_secs: e.disable_after_secs.max(0) as u32,
        disable_min_failures: e.disable_min_failures.max(0) as u32,
        max_held_secs: e.max_held_secs.max(0) as u32,
    }
}

fn api_key(k: ApiKey) -> pb::ApiKey {
    pb::ApiKey {
        id: k.id.to_string(),
        environment_id: k.environment_id.to_string(),
        name: k.name,
        prefix: k.lookup_prefix,
        created_at: Some(ts(k.created_at)),
        revoked_at: k.revoked_at.map(ts),
    }
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn create_environment(
        &self,
        req: Request<pb::CreateEnvironmentRequest>,
    ) -> Result<Response<pb::CreateEnvironmentResponse>, Status> {
        let r = req.into_inner();
        let env = self.app.create_environment(&r.name, r.endpoint_quota).await.map_err(status)?;
        Ok(Response::new(pb::CreateEnvironmentResponse { environment: Some(environment(env)) }))
    }

    async fn create_api_key(&self, req: Request<pb::CreateApiKeyRequest>) -> Result<Response<pb::CreateApiKeyResponse>, Status> {
        let r = req.into_inner();
        let (key, secret) = self.app.create_api_key(id("environment_id", &r.environment_id)?, &r.name).await.map_err(status)?;
        Ok(Response::new(pb::CreateApiKeyResponse { api_key: Some(api_key(key)), key: secret.expose().to_owned() }))
    }

    async fn revoke_api_key(&self, req: Request<pb::RevokeApiKeyRequest>) -> Result<Response<pb::RevokeApiKeyResponse>, Status> {
        let key = self.app.revoke_api_key(id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::RevokeApiKeyResponse { api_key: Some(api_key(key)) }))
    }

    async fn set_endpoint_quota(
        &self,
        req: Request<pb::SetEndpointQuotaRequest>,
    ) -> Result<Response<pb::SetEndpointQuotaResponse>, Status> {
        let r = req.into_inner();
        let env = self.app.set_endpoint_quota(id("environment_id", &r.environment_id)?, r.endpoint_quota).await.map_err(status)?;
        Ok(Response::new(pb::SetEndpointQuotaResponse { environment: Some(environment(env)) }))
    }

    async fn set_disable_policy(
        &self,
        req: Request<pb::SetDisablePolicyRequest>,
    ) -> Result<Response<pb::SetDisablePolicyResponse>, Status> {
        let r = req.into_inner();
        let env = self
            .app
            .set_disable_policy(id("environment_id", &r.environment_id)?, r.disable_after_secs, r.disable_min_failures, r.max_held_secs)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::SetDisablePolicyResponse { environment: Some(environment(env)) }))
    }

    async fn set_publish_limit(&self, req: Request<pb::SetPublishLimitRequest>) -> Result<Response<pb::SetPublishLimitResponse>, Status> {
        let r = req.into_inner();
        let (per_second, burst) =
            self.app.set_publish_limit(id("environment_id", &r.environment_id)?, r.per_second, r.burst).await.map_err(status)?;
        Ok(Response::new(pb::SetPublishLimitResponse { per_second, burst }))
    }

    async fn recover_endpoint(&self, req: Request<pb::RecoverEndpointRequest>) -> Result<Response<pb::RecoverEndpointResponse>, Status> {
        let r = req.get_ref();
        let (would_recover, operation_id, _) =
            super::recover(&self.app, None, &r.endpoint_id, r.since.as_ref(), r.until.as_ref(), r.dry_run).await?;
        Ok(Response::new(pb::RecoverEndpointResponse { would_recover, operation_id }))
    }

    async fn get_operation(&self, req: Request<pb::GetOperationRequest>) -> Result<Response<pb::GetOperationResponse>, Status> {
        let op = self.app.operation(None, id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::GetOperationResponse { operation: Some(super::operation(op)) }))
    }

    async fn set_operations_endpoint(
        &self,
        req: Request<pb::SetOperationsEndpointRequest>,
    ) -> Result<Response<pb::SetOperationsEndpointResponse>, Status> {
        let r = req.get_ref();
        let tenant = self.app.environment_scope(id("environment_id", &r.environment_id)?).await.map_err(status)?;
        let now = self.app.set_operations_endpoint(tenant, super::optional_id("endpoint_id", &r.endpoint_id)?).await.map_err(status)?;
        Ok(Response::new(pb::SetOperationsEndpointResponse { endpoint_id: now.map(|e| e.to_string()).unwrap_or_default() }))
    }

    async fn get_queue_depths(&self, _req: Request<pb::GetQueueDepthsRequest>) -> Result<Response<pb::GetQueueDepthsResponse>, Status> {
        let d = self.app.queue_depths().await.map_err(status)?;
        Ok(Response::new(pb::GetQueueDepthsResponse {
            outbox_unpublished: d.outbox_unpublished as u64,
            deliveries_pending: d.deliveries_pending as u64,
            deliveries_due: d.deliveries_due as u64,
            dead_letters: d.dead_letters as u64,
        }))
    }

    async fn list_endpoints(&self, req: Request<pb::ListEndpointsRequest>) -> Result<Response<pb::ListEndpointsResponse>, Status> {
        let scope = self.app.environment_scope(id("environment_id", &req.get_ref().environment_id)?).await.map_err(status)?;
        let list = self.app.list_endpoints(scope).await.map_err(status)?;
        Ok(Response::new(pb::ListEndpointsResponse { endpoints: list.into_iter().map(endpoint).collect() }))
    }

    async fn list_deliveries(&self, req: Request<pb::ListDeliveriesRequest>) -> Result<Response<pb::ListDeliveriesResponse>, Status> {
        let r = req.into_inner();
        let scope = self.app.environment_scope(id("environment_id", &r.environment_id)?).await.map_err(status)?;
        let list = self.app.list_event_deliveries(scope, id("event_id", &r.event_id)?).await.map_err(status)?;
        Ok(Response::new(pb::ListDeliveriesResponse { deliveries: list.into_iter().map(delivery).collect() }))
    }

    async fn list_dead_letters(&self, req: Request<pb::ListDeadLettersRequest>) -> Result<Response<pb::ListDeadLettersResponse>, Status> {
        let scope = self.app.environment_scope(id("environment_id", &req.get_ref().environment_id)?).await.map_err(status)?;
        let list = self.app.list_dead_letters(scope).await.map_err(status)?;
        Ok(Response::new(pb::ListDeadLettersResponse { dead_letters: list.into_iter().map(dead_letter).collect() }))
    }

    async fn replay_dead_letter(
        &self,
        req: Request<pb::ReplayDeadLetterRequest>,
    ) -> Result<Response<pb::ReplayDeadLetterResponse>, Status> {
        let delivery_id = self.app.replay_dead_letter(None, id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::ReplayDeadLetterResponse { delivery_id: delivery_id.to_string() }))
    }

    async fn rewrap_secrets(&self, _req: Request<pb::RewrapSecretsRequest>) -> Result<Response<pb::RewrapSecretsResponse>, Status> {
        let rewrapped = self.app.rewrap_secrets().await.map_err(status)?;
        tracing::info!(rewrapped, active_key_id = self.app.keyring().active_key_id(), "signing secrets rewrapped");
        Ok(Response::new(pb::RewrapSecretsResponse { rewrapped, active_key_id: self.app.keyring().active_key_id().to_owned() }))
    }
}
