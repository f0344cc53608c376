//! The api's servers, one function each, on listeners the caller bound:
//! the tenants' gRPC port (their services, reflection, health), the
//! internal mTLS port (the dispatch seam and the operator's AdminService),
//! the REST facade with the portal, and the operator's metrics port.

use anyhow::{Context, Result};
use async_nats::jetstream::Context as JetStream;
use relay_contracts::{
    FILE_DESCRIPTOR_SET,
    relay::{
        admin::v1::admin_service_server::AdminServiceServer,
        dispatch::v1::dispatch_service_server::DispatchServiceServer,
        tenant::v1::{
            dead_letter_service_server::DeadLetterServiceServer, event_service_server::EventServiceServer,
            event_type_service_server::EventTypeServiceServer, listen_service_server::ListenServiceServer,
            portal_service_server::PortalServiceServer, webhook_endpoint_service_server::WebhookEndpointServiceServer,
        },
    },
};
use tokio::{net::TcpListener, sync::watch, task::JoinSet};
use tonic::{
    service::Routes,
    transport::{Certificate, Identity, Server, ServerTlsConfig, server::TcpIncoming},
};

use crate::{
    Listeners,
    app::App,
    auth::{self, Requires},
    broker,
    config::ApiConfig,
    db, detach,
    detach::DetachLayer,
    grpc::{self, admin::AdminApi, dispatch::DispatchApi, tenant::TenantApi},
    openapi, portal, rest,
};

type Tasks = JoinSet<Result<()>>;

/// Starts every server on its listener; each stops accepting once `stop`
/// turns true.
pub async fn all(
    tasks: &mut Tasks,
    app: &App,
    js: &JetStream,
    cfg: &ApiConfig,
    listeners: Listeners,
    stop: &watch::Receiver<bool>,
) -> Result<()> {
    let tenant = TenantApi { app: app.clone() };
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<WebhookEndpointServiceServer<TenantApi>>().await;
    health.set_serving::<EventServiceServer<TenantApi>>().await;
    health.set_serving::<DeadLetterServiceServer<TenantApi>>().await;
    health.set_serving::<PortalServiceServer<TenantApi>>().await;
    health.set_serving::<EventTypeServiceServer<TenantApi>>().await;
    health.set_serving::<DispatchServiceServer<DispatchApi>>().await;
    health.set_serving::<AdminServiceServer<AdminApi>>().await;
    let names = relay_contracts::StreamNames::new(&cfg.broker.stream_prefix).map_err(anyhow::Error::msg)?;
    let listen = grpc::listen::ListenApi { app: app.clone(), nats: js.client(), names };
    tenant_grpc(tasks, &tenant, listen, health_svc.clone(), cfg, listeners.grpc, stop)?;
    internal_grpc(tasks, app, &tenant, health_svc, cfg, listeners.internal, stop)?;
    rest_facade(tasks, app, js, &tenant, cfg, listeners.rest, stop)?;
    if let Some(listener) = listeners.metrics {
        metrics(tasks, app, js, listener, stop);
    }
    Ok(())
}

/// The tenant services, each bounded in what it decodes: the largest
/// message that can succeed is a publish at the envelope's limit.
struct TenantServices {
    endpoints: WebhookEndpointServiceServer<TenantApi>,
    events: EventServiceServer<TenantApi>,
    dead_letters: DeadLetterServiceServer<TenantApi>,
    portal: PortalServiceServer<TenantApi>,
    catalogue: EventTypeServiceServer<TenantApi>,
}

impl TenantServices {
    fn new(tenant: &TenantApi) -> Self {
        let limit = grpc::MAX_TENANT_MESSAGE_BYTES;
        Self {
            endpoints: WebhookEndpointServiceServer::new(tenant.clone()).max_decoding_message_size(limit),
            events: EventServiceServer::new(tenant.clone()).max_decoding_message_size(limit),
            dead_letters: DeadLetterServiceServer::new(tenant.clone()).max_decoding_message_size(limit),
            portal: PortalServiceServer::new(tenant.clone()).max_decoding_message_size(limit),
            catalogue: EventTypeServiceServer::new(tenant.clone()).max_decoding_message_size(limit),
        }
    }
}

fn stopped(stop: &watch::Receiver<bool>) -> impl Future<Output = ()> + use<> {
    let mut rx = stop.clone();
    async move {
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

fn reflection(services: &[&str]) -> tonic_reflection::server::Builder<'static> {
    let mut b = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("grpc.health.v1.Health");
    for s in services {
        b = b.with_service_name(*s);
    }
    b
}

/// Public gRPC: the tenant services, reflection and health. Callers are
/// authenticated (and admitted within the message budget) before their
/// message is read.
fn tenant_grpc<H>(
    tasks: &mut Tasks,
    tenant: &TenantApi,
    listen: grpc::listen::ListenApi,
    health: H,
    cfg: &ApiConfig,
    listener: TcpListener,
    stop: &watch::Receiver<bool>,
) -> Result<()>
where
    H: tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    H::Response: axum::response::IntoResponse,
    H::Future: Send + 'static,
{
    let names = [
        "relay.tenant.v1.WebhookEndpointService",
        "relay.tenant.v1.EventService",
        "relay.tenant.v1.DeadLetterService",
        "relay.tenant.v1.PortalService",
        "relay.tenant.v1.EventTypeService",
        "relay.tenant.v1.ListenService",
    ];
    let admission = std::sync::Arc::new(tokio::sync::Semaphore::new(grpc::TENANT_CALLS_IN_MEMORY));
    let services = TenantServices::new(tenant);
    // Outside the detaching: a caller given up on never cancels the work.
    let router = Server::builder()
        .layer(detach::DeadlineLayer(cfg.tenant_work_deadline))
        .layer(DetachLayer)
        .layer(auth::TenantAuthLayer { app: tenant.app.clone(), admission })
        .add_service(health)
        .add_service(reflection(&names).build_v1().context("building reflection")?)
        .add_service(reflection(&names).build_v1alpha().context("building reflection")?)
        .add_service(services.endpoints)
        .add_service(services.events)
        .add_service(services.dead_letters)
        .add_service(services.portal)
        .add_service(services.catalogue)
        .add_service(ListenServiceServer::new(listen));
    // Small gRPC frames must not wait for Nagle's algorithm.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let stop = stopped(stop);
    tasks.spawn(async move { router.serve_with_incoming_shutdown(incoming, stop).await.context("tenant gRPC server") });
    Ok(())
}

/// Internal mTLS: the dispatch seam and the operator's admin service, each
/// behind the identity it requires.
fn internal_grpc<H>(
    tasks: &mut Tasks,
    app: &App,
    tenant: &TenantApi,
    health: H,
    cfg: &ApiConfig,
    listener: TcpListener,
    stop: &watch::Receiver<bool>,
) -> Result<()>
where
    H: tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    H::Response: axum::response::IntoResponse,
    H::Future: Send + 'static,
{
    let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(&cfg.internal_tls.cert)?, read(&cfg.internal_tls.key)?))
        .client_ca_root(Certificate::from_pem(read(&cfg.internal_tls.client_ca)?));
    let names = ["relay.dispatch.v1.DispatchService", "relay.admin.v1.AdminService"];
    // Seam batches are bounded by count and, for material, by bytes (see
    // `app::deliveries`); the message limits sit above both, and the
    // dispatcher sets the same ones.
    let seam = DispatchServiceServer::new(DispatchApi { app: app.clone() })
        .max_decoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES)
        .max_encoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES);
    let router = Server::builder()
        .tls_config(tls)
        .context("configuring the internal port's TLS")?
        .layer(DetachLayer)
        .add_service(health)
        .add_service(reflection(&names).build_v1().context("building reflection")?)
        .add_service(reflection(&names).build_v1alpha().context("building reflection")?)
        .add_service(tonic::service::interceptor::InterceptedService::new(seam, Requires::Dispatcher.interceptor()))
        .add_service(AdminServiceServer::with_interceptor(AdminApi { app: app.clone() }, Requires::Operator.interceptor()))
        // Tenant routes answer here only to refuse platform identities
        // explicitly (403 wrong_credential_type) rather than as unknown.
        .add_service(WebhookEndpointServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
        .add_service(EventServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
        .add_service(DeadLetterServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
        .add_service(PortalServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
        .add_service(EventTypeServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity));
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    // A graceful stop waits for every call to end, and `TakeAttempts`
    // streams end only when the takers are let go.
    let at_publish = app.at_publish().clone();
    let stop = stopped(stop);
    let stop = async move {
        stop.await;
        at_publish.close();
    };
    tasks.spawn(async move { router.serve_with_incoming_shutdown(incoming, stop).await.context("internal gRPC server") });
    Ok(())
}

/// The REST facade (the same tenant services, called in-process), the
/// portal, health, readiness and the OpenAPI document.
fn rest_facade(
    tasks: &mut Tasks,
    app: &App,
    js: &JetStream,
    tenant: &TenantApi,
    cfg: &ApiConfig,
    listener: TcpListener,
    stop: &watch::Receiver<bool>,
) -> Result<()> {
    let s = TenantServices::new(tenant);
    let grpc = Routes::new(s.endpoints).add_service(s.events).add_service(s.dead_letters).add_service(s.portal).add_service(s.catalogue);
    let spec = openapi::rendered()?;
    let ready = {
        let (db, js) = (app.db().clone(), js.clone());
        move || {
            let (db, js) = (db.clone(), js.clone());
            async move { readiness(&db, &js).await }
        }
    };
    let router = rest::router(app.clone(), grpc, cfg.tenant_work_deadline)?
        .merge(portal::routes(app.clone()))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/readyz", axum::routing::get(ready))
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let spec = spec.clone();
                async move { ([(http::header::CONTENT_TYPE, "application/json")], spec) }
            }),
        );
    let stop = stopped(stop);
    tasks.spawn(async move { rest::server::serve(listener, router, stop).await.context("REST server") });
    Ok(())
}

/// The operator's Prometheus port (`GET /metrics`).
fn metrics(tasks: &mut Tasks, app: &App, js: &JetStream, listener: TcpListener, stop: &watch::Receiver<bool>) {
    let (app, js) = (app.clone(), js.clone());
    let router = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let (app, js) = (app.clone(), js.clone());
            async move { ([(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.render_metrics(broker::connected(&js)).await) }
        }),
    );
    let stop = stopped(stop);
    tasks.spawn(async move { axum::serve(listener, router).with_graceful_shutdown(stop).await.context("metrics server") });
}

/// Ready means able to take writes and move them on: Postgres answers and
/// the broker connection is up. (Alive, `/healthz`, only means the process runs.)
async fn readiness(db: &sqlx::PgPool, js: &JetStream) -> (http::StatusCode, String) {
    let pg = db::answers(db).await;
    let nats = broker::connected(js);
    let body = format!("{{\"postgres\":{pg},\"nats\":{nats}}}");
    if pg && nats { (http::StatusCode::OK, body) } else { (http::StatusCode::SERVICE_UNAVAILABLE, body) }
}
