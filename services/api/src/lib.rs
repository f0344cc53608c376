//! The Relay api: the only process that touches Postgres.
//!
//! `run` starts everything on listeners the caller binds (port 0 in tests):
//! the tenant gRPC port, the tenant REST facade, the internal mTLS port (the
//! dispatch seam and the operator's AdminService), and the two relays.

pub mod apikeys;
pub mod app;
pub mod auth;
pub mod body;
pub mod broker;
pub mod config;
pub mod db;
pub mod detach;
pub mod error;
pub mod grpc;
pub mod metrics;
pub mod openapi;
pub mod portal;
pub mod queue;
pub mod relay;
pub mod rest;
pub mod secrets;
pub mod switch_offs;

use anyhow::{Context, Result};
use relay_contracts::{
    FILE_DESCRIPTOR_SET, StreamNames,
    relay::{
        admin::v1::admin_service_server::AdminServiceServer,
        dispatch::v1::dispatch_service_server::DispatchServiceServer,
        tenant::v1::{
            dead_letter_service_server::DeadLetterServiceServer, event_service_server::EventServiceServer,
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
    app::App,
    auth::Requires,
    config::ApiConfig,
    detach::DetachLayer,
    grpc::{admin::AdminApi, dispatch::DispatchApi, tenant::TenantApi},
    relay::{deliveries::DeliveryRelay, outbox::OutboxRelay},
};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// The sockets the api serves; bound by the caller.
pub struct Listeners {
    pub grpc: TcpListener,
    pub rest: TcpListener,
    pub internal: TcpListener,
    /// The operator's Prometheus port (`GET /metrics`), if any.
    pub metrics: Option<TcpListener>,
}

/// A running api. Dropping it does not stop it; call `shutdown`.
pub struct RunningApi {
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<Result<()>>,
}

impl RunningApi {
    /// Stops accepting, lets the relays finish their pass, and waits.
    pub async fn shutdown(mut self) -> Result<()> {
        let _ = self.shutdown.send(true);
        while let Some(done) = self.tasks.join_next().await {
            done.context("an api task panicked")??;
        }
        Ok(())
    }

    /// Waits until any task ends (which is an error while running).
    pub async fn wait(&mut self) -> Result<()> {
        match self.tasks.join_next().await {
            Some(done) => done.context("an api task panicked")?,
            None => Ok(()),
        }
    }
}

/// With the migrations run elsewhere (`relay-api migrate`, a deployment's
/// Job), the api refuses to start on a database that lacks any this build
/// needs, rather than fail on its first statement. A database ahead of it
/// (a rollback of the binaries) is accepted: migrations only add.
async fn schema_is_current(db: &sqlx::PgPool) -> Result<()> {
    use sqlx::migrate::Migrate;
    let mut conn = db.acquire().await.context("checking the database's migrations")?;
    let applied: std::collections::HashSet<i64> = conn
        .list_applied_migrations(&MIGRATOR.table_name)
        .await
        .context("reading the database's applied migrations (none at all: run `relay-api migrate` first)")?
        .into_iter()
        .map(|m| m.version)
        .collect();
    let missing: Vec<String> = MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration() && !applied.contains(&m.version))
        .map(|m| format!("{} {}", m.version, m.description))
        .collect();
    anyhow::ensure!(
        missing.is_empty(),
        "the database lacks {} migration(s) this build needs ({}): run `relay-api migrate` (the relay-migrate Job) first, or unset RELAY_SKIP_MIGRATIONS",
        missing.len(),
        missing.join(", ")
    );
    Ok(())
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

pub async fn run(cfg: ApiConfig, listeners: Listeners) -> Result<RunningApi> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (db, primary_follower) = db::connect(&cfg.database_url, cfg.pool_size, cfg.db_acquire_timeout).await?;
    if cfg.run_migrations {
        MIGRATOR.run(&db).await.context("running migrations")?;
    } else {
        schema_is_current(&db).await?;
    }
    let names = StreamNames::new(&cfg.stream_prefix).map_err(anyhow::Error::msg)?;
    let js = broker::connect(&cfg.nats_url).await?;
    let app = App {
        db,
        keyring: cfg.keyring.clone(),
        url_policy: cfg.url_policy.clone(),
        resolver: cfg.resolver.clone(),
        schedule: cfg.schedule.clone(),
        outbox_wake: Default::default(),
        deliveries_wake: Default::default(),
        slots_awaited: Default::default(),
        outbox_offers: Default::default(),
        verified_keys: Default::default(),
        probes_wake: Default::default(),
        recover_wake: Default::default(),
        dead_letters_counted: Default::default(),
        metrics: Default::default(),
        lease_guard: Default::default(),
        direct: cfg.run_relays.then(|| app::DirectDispatch {
            jobs: std::sync::Arc::new(queue::NatsJobs { js: js.clone(), names: names.clone() }),
            endpoint_cap: cfg.endpoint_in_flight_cap,
        }),
        clock: std::sync::Arc::new(app::SystemClock),
        health: cfg.health,
        lanes: Default::default(),
        portal: app::portal::PortalSettings { public_url: cfg.public_url.clone(), secure_cookie: cfg.public_url.starts_with("https://") },
        attempt_stats: Default::default(),
        switch_offs: std::sync::Arc::new(switch_offs::NatsSwitchOffs { client: js.client(), names: names.clone() }),
    };
    if !cfg.url_policy.is_strict() {
        tracing::warn!(policy = ?cfg.url_policy, "development endpoint allowances are ON: plain http and/or blocked address ranges are accepted");
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    app.start_lanes(cfg.db_acquire_timeout, stop_rx.clone());
    if let Some(follower) = primary_follower {
        tasks.spawn(follower.run(stop_rx.clone()));
    }

    if cfg.run_relays {
        let (js, names, app, rx) = (js.clone(), names.clone(), app.clone(), stop_rx.clone());
        let (batch, idle, lease, endpoint_cap) = (cfg.relay_batch, cfg.relay_idle, cfg.delivery_lease, cfg.endpoint_in_flight_cap);
        let (events_backlog, replicas) = (cfg.events_backlog, cfg.stream_replicas);
        tasks.spawn(async move {
            let mut rx2 = rx.clone();
            if !ensure_streams_until_ready(&js, &names, replicas, &mut rx2).await {
                return Ok(());
            }
            let outbox = OutboxRelay {
                app: app.clone(),
                js: js.clone(),
                names: names.clone(),
                batch,
                idle,
                stream_backlog: events_backlog,
                held_back: Default::default(),
                backlog_bound: std::sync::atomic::AtomicU64::new(u64::MAX),
                // Whatever waits from before this process started is found by a look first.
                backlogged: std::sync::atomic::AtomicBool::new(true),
                conn: tokio::sync::Mutex::new(db::lane::Held::new(&app.db)),
                unmarked: Default::default(),
            };
            app.outbox_offers.open();
            let listen = DeliveryRelay::listen(app.clone(), rx.clone());
            let prober = relay::prober::Prober { app: app.clone(), idle: std::time::Duration::from_secs(5) };
            let recoverer = relay::recover::Recoverer {
                app: app.clone(),
                per_pass: i64::from(app.health.recover_per_second),
                every: std::time::Duration::from_secs(1),
                backstop: std::time::Duration::from_secs(5),
                busy: Default::default(),
                last: Default::default(),
            };
            let conn = tokio::sync::Mutex::new(db::lane::Held::new(&app.db));
            let deliveries = DeliveryRelay { app, js, names, batch, lease, idle, endpoint_cap, conn };
            tokio::join!(outbox.run(rx.clone()), deliveries.run(rx.clone()), listen, prober.run(rx.clone()), recoverer.run(rx.clone()));
            Ok(())
        });
    }

    if cfg.run_relays {
        // Dead letters are announced to operations endpoints in batches:
        // looked for each second while this process has counted one that
        // may still wait (gathering, the per-minute limit), otherwise every
        // ten seconds for those other api processes counted.
        let (app, mut stop) = (app.clone(), stop_rx.clone());
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            let mut looked: Option<tokio::time::Instant> = None;
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        if !app.dead_letters_counted.may_wait() && looked.is_some_and(|at| at.elapsed() < app::operational::ANNOUNCE_BACKSTOP) {
                            continue;
                        }
                        looked = Some(tokio::time::Instant::now());
                        if let Err(e) = app.announce_dead_letters().await {
                            tracing::warn!(error = ?e, "announcing dead letters failed; they stay counted");
                        }
                    }
                    _ = stop.changed() => return Ok(()),
                }
            }
        });
    }

    {
        let (app, mut stop) = (app.clone(), stop_rx.clone());
        let (every, retention, event_retention) = (cfg.dead_letter_prune_every, cfg.dead_letter_retention, cfg.retention);
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(every);
            // Where the walk over old events stands between ticks.
            let mut cursor = 0i64;
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        match app.prune_dead_letters(retention).await {
                            Ok(0) => {}
                            Ok(n) => tracing::info!(pruned = n, "dead letters past retention deleted"),
                            Err(e) => tracing::warn!(error = ?e, "pruning dead letters failed"),
                        }
                        match app.expire_held(100_000).await {
                            Ok(0) => {}
                            Ok(n) => tracing::warn!(expired = n, "deliveries held past their environment's bound became dead letters"),
                            Err(e) => tracing::warn!(error = ?e, "expiring held deliveries failed"),
                        }
                        // Bounded per tick, so a large backlog of old events
                        // is worked off over several ticks, never in one long pass.
                        match app.prune_retained(event_retention, cursor, 20_000).await {
                            Ok((next, pruned)) => {
                                cursor = next;
                                if pruned.events > 0 || pruned.deliveries > 0 {
                                    tracing::info!(events = pruned.events, deliveries = pruned.deliveries, attempts = pruned.attempts, "events past retention deleted");
                                }
                            }
                            Err(e) => tracing::warn!(error = ?e, "pruning events past retention failed"),
                        }
                        if let Err(e) = app.prune_attempt_claims().await {
                            tracing::warn!(error = ?e, "pruning expired attempt claims failed");
                        }
                        if let Err(e) = app.prune_attempt_stats().await {
                            tracing::warn!(error = ?e, "pruning old attempt statistics failed");
                        }
                        if let Err(e) = app.prune_portal().await {
                            tracing::warn!(error = ?e, "pruning expired portal links and sessions failed");
                        }
                    }
                    _ = stop.changed() => return Ok(()),
                }
            }
        });
    }

    {
        // The portal's chart sums, written every few seconds and once more
        // on the way out.
        let (app, mut stop) = (app.clone(), stop_rx.clone());
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(app::attempt_stats::FLUSH_EVERY);
            loop {
                let stopping = tokio::select! {
                    _ = tick.tick() => false,
                    _ = stop.changed() => true,
                };
                if let Err(e) = app.flush_attempt_stats().await {
                    tracing::warn!(error = ?e, "writing attempt statistics failed; they are kept for the next write");
                }
                if stopping {
                    return Ok(());
                }
            }
        });
    }

    let tenant = TenantApi { app: app.clone() };
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<WebhookEndpointServiceServer<TenantApi>>().await;
    health.set_serving::<EventServiceServer<TenantApi>>().await;
    health.set_serving::<DeadLetterServiceServer<TenantApi>>().await;
    health.set_serving::<PortalServiceServer<TenantApi>>().await;
    health.set_serving::<DispatchServiceServer<DispatchApi>>().await;
    health.set_serving::<AdminServiceServer<AdminApi>>().await;
    // Tenant messages are bounded before they are buffered: the largest that
    // can succeed is a publish at the envelope's limit.
    let limit = grpc::MAX_TENANT_MESSAGE_BYTES;
    let endpoints = || WebhookEndpointServiceServer::new(tenant.clone()).max_decoding_message_size(limit);
    let events = || EventServiceServer::new(tenant.clone()).max_decoding_message_size(limit);
    let dead_letters = || DeadLetterServiceServer::new(tenant.clone()).max_decoding_message_size(limit);
    let portal = || PortalServiceServer::new(tenant.clone()).max_decoding_message_size(limit);

    // Public gRPC: the tenant services, reflection and health. Callers are
    // authenticated (and admitted within the message budget) before their
    // message is read.
    {
        let reflection = || {
            reflection_builder(&[
                "relay.tenant.v1.WebhookEndpointService",
                "relay.tenant.v1.EventService",
                "relay.tenant.v1.DeadLetterService",
                "relay.tenant.v1.PortalService",
            ])
        };
        let admission = std::sync::Arc::new(tokio::sync::Semaphore::new(grpc::TENANT_CALLS_IN_MEMORY));
        // Outside the detaching: a caller given up on never cancels the work.
        let router = Server::builder()
            .layer(detach::DeadlineLayer(cfg.tenant_work_deadline))
            .layer(DetachLayer)
            .layer(auth::TenantAuthLayer { app: app.clone(), admission })
            .add_service(health_svc.clone())
            .add_service(reflection().build_v1().context("building reflection")?)
            .add_service(reflection().build_v1alpha().context("building reflection")?)
            .add_service(endpoints())
            .add_service(events())
            .add_service(dead_letters())
            .add_service(portal());
        // Small gRPC frames must not wait for Nagle's algorithm.
        let incoming = TcpIncoming::from(listeners.grpc).with_nodelay(Some(true));
        let stop = stopped(stop_rx.clone());
        tasks.spawn(async move { router.serve_with_incoming_shutdown(incoming, stop).await.context("tenant gRPC server") });
    }

    // Internal mTLS: the dispatch seam and the operator's admin service, each
    // behind the identity it requires.
    {
        let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(read(&cfg.internal_tls.cert)?, read(&cfg.internal_tls.key)?))
            .client_ca_root(Certificate::from_pem(read(&cfg.internal_tls.client_ca)?));
        let reflection = || reflection_builder(&["relay.dispatch.v1.DispatchService", "relay.admin.v1.AdminService"]);
        // Seam batches are bounded by count and, for material, by bytes
        // (see `app::deliveries`); the message limits sit above both, and the
        // dispatcher sets the same ones.
        let seam = DispatchServiceServer::new(DispatchApi { app: app.clone() })
            .max_decoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES)
            .max_encoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES);
        let router = Server::builder()
            .tls_config(tls)
            .context("configuring the internal port's TLS")?
            .layer(DetachLayer)
            .add_service(health_svc)
            .add_service(reflection().build_v1().context("building reflection")?)
            .add_service(reflection().build_v1alpha().context("building reflection")?)
            .add_service(tonic::service::interceptor::InterceptedService::new(seam, Requires::Dispatcher.interceptor()))
            .add_service(AdminServiceServer::with_interceptor(AdminApi { app: app.clone() }, Requires::Operator.interceptor()))
            // Tenant routes answer here only to refuse platform identities
            // explicitly (403 wrong_credential_type) rather than as unknown.
            .add_service(WebhookEndpointServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
            .add_service(EventServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
            .add_service(DeadLetterServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity))
            .add_service(PortalServiceServer::with_interceptor(tenant.clone(), auth::refuse_platform_identity));
        let incoming = TcpIncoming::from(listeners.internal).with_nodelay(Some(true));
        let stop = stopped(stop_rx.clone());
        tasks.spawn(async move { router.serve_with_incoming_shutdown(incoming, stop).await.context("internal gRPC server") });
    }

    // REST facade: the same tenant services, called in-process.
    {
        let grpc = Routes::new(endpoints()).add_service(events()).add_service(dead_letters()).add_service(portal());
        let spec = openapi::rendered()?;
        let ready = {
            let (db, js) = (app.db.clone(), js.clone());
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
        let stop = stopped(stop_rx.clone());
        tasks.spawn(async move { rest::server::serve(listeners.rest, router, stop).await.context("REST server") });
    }

    if let Some(listener) = listeners.metrics {
        let (app, js) = (app.clone(), js.clone());
        let router =
            axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let (app, js) = (app.clone(), js.clone());
                    async move {
                        ([(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.render_metrics(broker::connected(&js)).await)
                    }
                }),
            );
        let stop = stopped(stop_rx.clone());
        tasks.spawn(async move { axum::serve(listener, router).with_graceful_shutdown(stop).await.context("metrics server") });
    }

    Ok(RunningApi { shutdown: stop_tx, tasks })
}

/// Ready means able to take writes and move them on: Postgres answers and
/// the broker connection is up. (Alive, `/healthz`, only means the process runs.)
async fn readiness(db: &sqlx::PgPool, js: &async_nats::jetstream::Context) -> (http::StatusCode, String) {
    let pg = db::answers(db).await;
    let nats = broker::connected(js);
    let body = format!("{{\"postgres\":{pg},\"nats\":{nats}}}");
    if pg && nats { (http::StatusCode::OK, body) } else { (http::StatusCode::SERVICE_UNAVAILABLE, body) }
}

fn reflection_builder(services: &[&str]) -> tonic_reflection::server::Builder<'static> {
    let mut b = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("grpc.health.v1.Health");
    for s in services {
        b = b.with_service_name(*s);
    }
    b
}

/// Streams are created by the api, which publishes to them. The broker may be
/// away at start-up; keep trying without holding anything else up.
async fn ensure_streams_until_ready(
    js: &async_nats::jetstream::Context,
    names: &StreamNames,
    replicas: usize,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let mut failures = 0;
    loop {
        match broker::ensure_streams(js, names, replicas).await {
            Ok(()) => return true,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = format!("{e:#}"), "NATS streams not ready; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(relay::backoff(failures)) => {}
                    _ = stop.changed() => return false,
                }
            }
        }
    }
}
