//! The tenant services. Every handler resolves the tenant from the API key
//! first; the environment never comes from the request body.

use relay_contracts::relay::tenant::v1::{
    self as pb, dead_letter_service_server::DeadLetterService, event_service_server::EventService, portal_service_server::PortalService,
    webhook_endpoint_service_server::WebhookEndpointService,
};
use tonic::{Request, Response, Status};
use tracing::{Instrument as _, field::Empty};

use relay_domain::{DeliveryId, EndpointId, Reason, delivery::DeliveryState, models::HeldDelivery};

use super::{id, status, ts};
use crate::{
    app::{
        App,
        deliveries::DeadLetter,
        endpoints::{Endpoint, EndpointChange, NewEndpoint},
        events::{Attempt, Delivery},
    },
    auth,
    error::AppError,
};

#[derive(Debug, Clone)]
pub struct TenantApi {
    pub app: App,
}

fn client_certificate(c: relay_domain::models::ClientCertificateShown) -> pb::ClientCertificate {
    pb::ClientCertificate {
        subject: c.subject,
        issuer: c.issuer,
        not_after: c.not_after,
        fingerprint_sha256: c.fingerprint_sha256,
        presented_until: c.presented_until.map(super::ts),
    }
}

pub(crate) fn endpoint(e: Endpoint) -> pb::WebhookEndpoint {
    pb::WebhookEndpoint {
        id: e.id.to_string(),
        url: e.url,
        event_types: e.event_types,
        enabled: e.enabled,
        created_at: Some(ts(e.created_at)),
        secret_rotated_at: e.secret_rotated_at.map(ts),
        disabled_reason: e.disabled_reason.map(|r| r.as_str().to_owned()),
        health: Some(pb::EndpointHealth {
            state: e.health.circuit.as_str().to_owned(),
            consecutive_failures: e.health.consecutive_failures.max(0) as u32,
            last_success_at: e.health.last_success_at.map(ts),
            last_failure_at: e.health.last_failure_at.map(ts),
            next_probe_at: e.health.next_probe_at.map(ts),
            recent_attempts: e.recent.0,
            recent_failures: e.recent.1,
        }),
        held_deliveries: e.held.max(0) as u64,
        signature_scheme: e.signature_scheme.as_str().to_owned(),
        public_key: e.public_key,
        previous_public_key: e.previous_public_key,
        signature_scheme_changed_at: e.signature_scheme_changed_at.map(ts),
        headers: e.headers.into_iter().collect(),
        max_in_flight: e.max_in_flight,
        filter: e.filter.unwrap_or_default(),
        rate_limit: e.rate_limit.map(|r| pb::RateLimit { per_second: r.per_second(), burst: r.burst() }),
        client_certificate: e.client_certificate.map(client_certificate),
        previous_client_certificate: e.previous_client_certificate.map(client_certificate),
        ca_bundle: e.ca_bundle.unwrap_or_default(),
        ordering: e.ordering.as_str().to_owned(),
        oauth2: e.oauth2.map(|o| pb::OAuth2ClientCredentials {
            token_url: o.token_url,
            client_id: o.client_id,
            client_secret: String::new(),
            scope: o.scope,
            audience: o.audience,
        }),
    }
}

fn oauth2_asked(o: pb::OAuth2ClientCredentials) -> relay_domain::models::OAuth2Credentials {
    relay_domain::models::OAuth2Credentials {
        token_url: o.token_url,
        client_id: o.client_id,
        client_secret: o.client_secret,
        scope: o.scope,
        audience: o.audience,
    }
}

/// Custom headers as the app takes them, in name order (a proto map has none).
fn header_pairs(headers: std::collections::HashMap<String, String>) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = headers.into_iter().collect();
    pairs.sort_unstable();
    pairs
}

/// The one response field that shows a secret: empty when none was minted
/// (or the scheme has none to show).
fn shown(secret: Option<relay_signing::SigningSecret>) -> String {
    secret.map(|s| s.expose().to_owned()).unwrap_or_default()
}

fn held_delivery(endpoint_id: EndpointId, h: HeldDelivery) -> pb::Delivery {
    pb::Delivery {
        id: h.id.to_string(),
        event_id: h.event_id.to_string(),
        endpoint_id: endpoint_id.to_string(),
        state: pb::DeliveryState::Held as i32,
        attempt: h.attempt as u32,
        next_attempt_at: Some(ts(h.next_attempt_at)),
        created_at: Some(ts(h.created_at)),
        last_status: h.last_status.map(|s| s as u32),
        last_error: h.last_error.unwrap_or_default(),
        generation: 0,
        attempts: Vec::new(),
        ordering_key: String::new(),
        ordering_position: 0,
    }
}

/// A page cursor for held deliveries: the last one's due time (µs) and id.
fn held_cursor(h: &HeldDelivery) -> String {
    format!("{}_{}", h.next_attempt_at.timestamp_micros(), h.id)
}

fn parse_held_cursor(cursor: &str) -> Result<Option<(crate::app::Timestamp, DeliveryId)>, Status> {
    if cursor.is_empty() {
        return Ok(None);
    }
    let parsed = cursor
        .split_once('_')
        .and_then(|(micros, id)| Some((chrono::DateTime::from_timestamp_micros(micros.parse().ok()?)?, DeliveryId::parse(id).ok()?)))
        .filter(|(at, _)| crate::app::check_time("cursor", *at).is_ok());
    match parsed {
        Some(c) => Ok(Some(c)),
        None => Err(status(AppError::invalid(Reason::InvalidCursor, "cursor must be the next_cursor of a previous page"))),
    }
}

pub(crate) fn delivery(d: Delivery) -> pb::Delivery {
    let state = match d.state {
        DeliveryState::Pending => pb::DeliveryState::Pending,
        DeliveryState::Held => pb::DeliveryState::Held,
        DeliveryState::Queued => pb::DeliveryState::Queued,
        DeliveryState::Delivered => pb::DeliveryState::Delivered,
        DeliveryState::Dead => pb::DeliveryState::Dead,
    };
    pb::Delivery {
        id: d.id.to_string(),
        event_id: d.event_id.to_string(),
        endpoint_id: d.endpoint_id.to_string(),
        state: state as i32,
        attempt: d.attempt as u32,
        next_attempt_at: matches!(state, pb::DeliveryState::Pending | pb::DeliveryState::Held).then(|| ts(d.next_attempt_at)),
        created_at: Some(ts(d.created_at)),
        last_status: d.last_status.map(|s| s as u32),
        last_error: d.last_error.unwrap_or_default(),
        generation: d.generation as u32,
        attempts: d.attempts.into_iter().map(attempt).collect(),
        ordering_key: d.ordering_key.unwrap_or_default(),
        ordering_position: d.ordering_position.unwrap_or_default().max(0) as u64,
    }
}

fn attempt(a: Attempt) -> pb::DeliveryAttempt {
    pb::DeliveryAttempt {
        attempt: a.attempt as u32,
        generation: a.generation as u32,
        attempted_at: Some(ts(a.attempted_at)),
        http_status: a.http_status.map(|s| s as u32),
        error: a.error.unwrap_or_default(),
        latency_ms: a.latency_ms.clamp(0, i64::from(u32::MAX)) as u32,
        response_body: a.response_body.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default(),
        next_attempt_at: a.next_attempt_at.map(ts),
        signature_scheme: a.signature_scheme.unwrap_or_default(),
    }
}

pub(crate) fn dead_letter(d: DeadLetter) -> pb::DeadLetter {
    pb::DeadLetter {
        id: d.id.to_string(),
        delivery_id: d.delivery_id.to_string(),
        endpoint_id: d.endpoint_id.to_string(),
        event_id: d.event_id.to_string(),
        attempts: d.attempts as u32,
        last_status: d.last_status.map(|s| s as u32),
        last_error: d.last_error.unwrap_or_default(),
        reason: d.reason.as_str().to_owned(),
        dead_lettered_at: Some(ts(d.dead_lettered_at)),
        ordering_key: d.ordering_key.unwrap_or_default(),
        later_in_key: d.later_in_key.unwrap_or_default().max(0) as u64,
    }
}

#[tonic::async_trait]
impl WebhookEndpointService for TenantApi {
    async fn create_webhook_endpoint(
        &self,
        req: Request<pb::CreateWebhookEndpointRequest>,
    ) -> Result<Response<pb::CreateWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let r = req.into_inner();
        let new = NewEndpoint {
            url: r.url,
            event_types: r.event_types,
            signature_scheme: r.signature_scheme,
            headers: header_pairs(r.headers),
            max_in_flight: r.max_in_flight.filter(|&n| n != 0),
            filter: r.filter,
            rate_limit: r.rate_limit.map(|l| (l.per_second, l.burst)),
            client_certificate: r.client_certificate,
            client_key: r.client_key,
            ca_bundle: r.ca_bundle,
            oauth2: r.oauth2.map(oauth2_asked),
            ordering: r.ordering,
        };
        let (e, secret) = self.app.create_endpoint(tenant, new).await.map_err(status)?;
        Ok(Response::new(pb::CreateWebhookEndpointResponse { endpoint: Some(endpoint(e)), secret: shown(secret) }))
    }

    async fn update_webhook_endpoint(
        &self,
        req: Request<pb::UpdateWebhookEndpointRequest>,
    ) -> Result<Response<pb::UpdateWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let endpoint_id = id("id", &req.get_ref().id)?;
        let r = req.into_inner();
        let change = EndpointChange {
            url: r.url,
            event_types: r.event_types,
            signature_scheme: r.signature_scheme,
            headers: header_pairs(r.headers),
            clear_headers: r.clear_headers,
            max_in_flight: r.max_in_flight.map(|n| (n != 0).then_some(n)),
            filter: r.filter,
            clear_filter: r.clear_filter,
            rate_limit: r.rate_limit.map(|l| (l.per_second, l.burst)),
            clear_rate_limit: r.clear_rate_limit,
            client_certificate: r.client_certificate,
            client_key: r.client_key,
            clear_client_certificate: r.clear_client_certificate,
            end_client_certificate_overlap: r.end_client_certificate_overlap,
            ca_bundle: r.ca_bundle,
            clear_ca_bundle: r.clear_ca_bundle,
            oauth2: r.oauth2.map(oauth2_asked),
            clear_oauth2: r.clear_oauth2,
            ordering: r.ordering,
        };
        let (e, secret) = self.app.update_endpoint(tenant, endpoint_id, change).await.map_err(status)?;
        Ok(Response::new(pb::UpdateWebhookEndpointResponse { endpoint: Some(endpoint(e)), secret: shown(secret) }))
    }

    async fn list_webhook_endpoints(
        &self,
        req: Request<pb::ListWebhookEndpointsRequest>,
    ) -> Result<Response<pb::ListWebhookEndpointsResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let list = self.app.list_endpoints(tenant).await.map_err(status)?;
        Ok(Response::new(pb::ListWebhookEndpointsResponse { endpoints: list.into_iter().map(endpoint).collect() }))
    }

    async fn get_webhook_endpoint(
        &self,
        req: Request<pb::GetWebhookEndpointRequest>,
    ) -> Result<Response<pb::GetWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let e = self.app.get_endpoint(tenant, id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::GetWebhookEndpointResponse { endpoint: Some(endpoint(e)) }))
    }

    async fn rotate_webhook_endpoint_secret(
        &self,
        req: Request<pb::RotateWebhookEndpointSecretRequest>,
    ) -> Result<Response<pb::RotateWebhookEndpointSecretResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let (e, secret) = self.app.rotate_endpoint_secret(tenant, id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::RotateWebhookEndpointSecretResponse { endpoint: Some(endpoint(e)), secret: shown(secret) }))
    }

    async fn list_held_deliveries(
        &self,
        req: Request<pb::ListHeldDeliveriesRequest>,
    ) -> Result<Response<pb::ListHeldDeliveriesResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let r = req.get_ref();
        let endpoint_id = id("id", &r.id)?;
        let after = parse_held_cursor(&r.cursor)?;
        let limit = if r.limit == 0 { 100 } else { i64::from(r.limit) };
        let page = self.app.list_held(tenant, endpoint_id, after, limit).await.map_err(status)?;
        let next_cursor = if page.len() as i64 == limit { page.last().map(held_cursor).unwrap_or_default() } else { String::new() };
        Ok(Response::new(pb::ListHeldDeliveriesResponse {
            deliveries: page.into_iter().map(|h| held_delivery(endpoint_id, h)).collect(),
            next_cursor,
        }))
    }

    async fn recover_webhook_endpoint(
        &self,
        req: Request<pb::RecoverWebhookEndpointRequest>,
    ) -> Result<Response<pb::RecoverWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let r = req.get_ref();
        let (would_recover, operation_id, meta) =
            super::recover(&self.app, Some(tenant), &r.id, r.since.as_ref(), r.until.as_ref(), r.dry_run).await?;
        let mut resp = Response::new(pb::RecoverWebhookEndpointResponse { would_recover, operation_id });
        *resp.metadata_mut() = meta;
        Ok(resp)
    }

    async fn get_operation(&self, req: Request<pb::GetOperationRequest>) -> Result<Response<pb::GetOperationResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let op = self.app.operation(Some(tenant), id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::GetOperationResponse { operation: Some(super::operation(op)) }))
    }

    async fn set_operations_endpoint(
        &self,
        req: Request<pb::SetOperationsEndpointRequest>,
    ) -> Result<Response<pb::SetOperationsEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let endpoint = super::optional_id("endpoint_id", &req.get_ref().endpoint_id)?;
        let now = self.app.set_operations_endpoint(tenant, endpoint).await.map_err(status)?;
        Ok(Response::new(pb::SetOperationsEndpointResponse { endpoint_id: now.map(|e| e.to_string()).unwrap_or_default() }))
    }

    async fn get_operations_endpoint(
        &self,
        req: Request<pb::GetOperationsEndpointRequest>,
    ) -> Result<Response<pb::GetOperationsEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let now = self.app.operations_endpoint(tenant).await.map_err(status)?;
        Ok(Response::new(pb::GetOperationsEndpointResponse { endpoint_id: now.map(|e| e.to_string()).unwrap_or_default() }))
    }

    async fn enable_webhook_endpoint(
        &self,
        req: Request<pb::EnableWebhookEndpointRequest>,
    ) -> Result<Response<pb::EnableWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let e = self.app.set_endpoint_enabled(tenant, id("id", &req.get_ref().id)?, true).await.map_err(status)?;
        Ok(Response::new(pb::EnableWebhookEndpointResponse { endpoint: Some(endpoint(e)) }))
    }

    async fn disable_webhook_endpoint(
        &self,
        req: Request<pb::DisableWebhookEndpointRequest>,
    ) -> Result<Response<pb::DisableWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let e = self.app.set_endpoint_enabled(tenant, id("id", &req.get_ref().id)?, false).await.map_err(status)?;
        Ok(Response::new(pb::DisableWebhookEndpointResponse { endpoint: Some(endpoint(e)) }))
    }

    async fn delete_webhook_endpoint(
        &self,
        req: Request<pb::DeleteWebhookEndpointRequest>,
    ) -> Result<Response<pb::DeleteWebhookEndpointResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        self.app.delete_endpoint(tenant, id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::DeleteWebhookEndpointResponse {}))
    }
}

#[tonic::async_trait]
impl EventService for TenantApi {
    async fn publish_event(&self, req: Request<pb::PublishEventRequest>) -> Result<Response<pb::PublishEventResponse>, Status> {
        // The root of the event's trace (or a child of the caller's).
        let span = tracing::info_span!("publish_event", environment_id = Empty, event_id = Empty, duplicate = Empty);
        relay_telemetry::set_parent(&span, &relay_telemetry::GrpcMetadataRef(req.metadata()));
        async move {
            let tenant = auth::tenant(&self.app, &req).await?;
            let r = req.into_inner();
            let event_id = if r.id.trim().is_empty() { None } else { Some(id("id", &r.id)?) };
            // Refusing it is the one use of the deprecated field.
            #[allow(deprecated)]
            let legacy = r.legacy_payload.is_some();
            if legacy {
                return Err(status(AppError::invalid(
                    Reason::LegacyPayloadRefused,
                    "legacy_payload (field 3, a google.protobuf.Value) is refused: it cannot carry JSON without altering it \
                     (numbers become doubles, key order is lost); send the payload as JSON text in payload (field 4)",
                )));
            }
            let p = self.app.publish_event(tenant, event_id, &r.r#type, &r.payload, &r.ordering_key).await.map_err(status)?;
            let span = tracing::Span::current();
            span.record("environment_id", tracing::field::display(tenant.environment_id));
            span.record("event_id", tracing::field::display(p.event_id));
            span.record("duplicate", p.duplicate);
            Ok(Response::new(pb::PublishEventResponse {
                event_id: p.event_id.to_string(),
                duplicate: p.duplicate,
                ordering_sequence: p.ordering_sequence.map_or(0, |n| n as u64),
            }))
        }
        .instrument(span)
        .await
    }

    async fn list_event_deliveries(
        &self,
        req: Request<pb::ListEventDeliveriesRequest>,
    ) -> Result<Response<pb::ListEventDeliveriesResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let list = self.app.list_event_deliveries(tenant, id("event_id", &req.get_ref().event_id)?).await.map_err(status)?;
        Ok(Response::new(pb::ListEventDeliveriesResponse { deliveries: list.into_iter().map(delivery).collect() }))
    }
}

#[tonic::async_trait]
impl DeadLetterService for TenantApi {
    async fn list_dead_letters(&self, req: Request<pb::ListDeadLettersRequest>) -> Result<Response<pb::ListDeadLettersResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let list = self.app.list_dead_letters(tenant).await.map_err(status)?;
        Ok(Response::new(pb::ListDeadLettersResponse { dead_letters: list.into_iter().map(dead_letter).collect() }))
    }

    async fn replay_dead_letter(
        &self,
        req: Request<pb::ReplayDeadLetterRequest>,
    ) -> Result<Response<pb::ReplayDeadLetterResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let delivery_id = self.app.replay_dead_letter(Some(tenant), id("id", &req.get_ref().id)?).await.map_err(status)?;
        Ok(Response::new(pb::ReplayDeadLetterResponse { delivery_id: delivery_id.to_string() }))
    }
}

#[tonic::async_trait]
impl PortalService for TenantApi {
    async fn create_portal_session(
        &self,
        req: Request<pb::CreatePortalSessionRequest>,
    ) -> Result<Response<pb::CreatePortalSessionResponse>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let link = self.app.create_portal_link(tenant).await.map_err(status)?;
        Ok(Response::new(pb::CreatePortalSessionResponse { url: link.url, expires_at: Some(ts(link.expires_at)) }))
    }
}
