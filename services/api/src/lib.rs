//! The Relay api: the only process that touches Postgres.
//!
//! `run` starts everything on listeners the caller binds (port 0 in tests):
//! the storage and the broker, the use-cases' state ([`app::App`]), the
//! relays and the upkeep passes (`relay`), and the servers (`serve`: the
//! tenant gRPC port, the REST facade, the internal mTLS port with the
//! dispatch seam and the operator's AdminService, the metrics port).

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
mod serve;
pub mod switch_offs;

use anyhow::{Context, Result};
use futures::FutureExt;
use relay_contracts::StreamNames;
use tokio::{net::TcpListener, sync::watch, task::JoinSet};

use crate::{
    app::App,
    config::ApiConfig,
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

pub async fn run(cfg: ApiConfig, listeners: Listeners) -> Result<RunningApi> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (db, primary_follower) = db::connect(&cfg.storage.database_url, cfg.storage.pool_size, cfg.storage.acquire_timeout).await?;
    if cfg.storage.run_migrations {
        MIGRATOR.run(&db).await.context("running migrations")?;
    } else {
        schema_is_current(&db).await?;
    }
    let names = StreamNames::new(&cfg.broker.stream_prefix).map_err(anyhow::Error::msg)?;
    let (js, broker_link) = broker::connect(&cfg.broker.nats_url).await?;
    let app = build_app(&cfg, db, &js, &names);
    if !cfg.delivery.url_policy.is_strict() {
        tracing::warn!(policy = ?cfg.delivery.url_policy, "development endpoint allowances are ON: plain http and/or blocked address ranges are accepted");
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    app.start_batchers(cfg.storage.acquire_timeout, stop_rx.clone());
    if let Some(follower) = primary_follower {
        tasks.spawn(follower.run(stop_rx.clone()));
    }
    if cfg.delivery.run_relays {
        tasks.spawn(relays(app.clone(), js.clone(), names, cfg.clone(), stop_rx.clone(), broker_link));
        let announcer = relay::upkeep::Announcer::new(app.clone());
        let stop = stop_rx.clone();
        tasks.spawn(async move {
            relay::drive(&announcer, stop).await;
            Ok(())
        });
        let sweep = relay::upkeep::LaneSweep { app: app.clone(), never: Default::default() };
        let stop = stop_rx.clone();
        tasks.spawn(async move {
            relay::drive(&sweep, stop).await;
            Ok(())
        });
    }
    // Every api (one analyses at a time); the first pass runs at start.
    let statistics = relay::upkeep::Statistics { app: app.clone(), never: Default::default() };
    let stop = stop_rx.clone();
    tasks.spawn(async move {
        relay::drive(&statistics, stop).await;
        Ok(())
    });
    let listener_sweep = relay::upkeep::ListenerSweep { app: app.clone(), grace: cfg.retention.listener_grace, never: Default::default() };
    let stop = stop_rx.clone();
    tasks.spawn(async move {
        relay::drive(&listener_sweep, stop).await;
        Ok(())
    });
    let retention = relay::upkeep::Retention {
        app: app.clone(),
        every: cfg.retention.prune_every,
        dead_letter_retention: cfg.retention.dead_letters,
        event_retention: cfg.retention.events,
        cursor: Default::default(),
        never: Default::default(),
    };
    let stop = stop_rx.clone();
    tasks.spawn(async move {
        relay::drive(&retention, stop).await;
        Ok(())
    });
    let flush = relay::upkeep::StatsFlush { app: app.clone(), never: Default::default() };
    tasks.spawn(flush.run(stop_rx.clone()).map(Ok));
    serve::all(&mut tasks, &app, &js, &cfg, listeners, &stop_rx).await?;
    Ok(RunningApi { shutdown: stop_tx, tasks })
}

/// The use-cases' state, from the configuration and the connections.
fn build_app(cfg: &ApiConfig, db: sqlx::PgPool, js: &async_nats::jetstream::Context, names: &StreamNames) -> App {
    App::new(app::AppParts {
        db,
        keyring: cfg.keyring.clone(),
        url_policy: cfg.delivery.url_policy.clone(),
        resolver: cfg.delivery.resolver.clone(),
        schedule: cfg.delivery.schedule.clone(),
        health: cfg.health,
        portal: app::portal::PortalSettings { public_url: cfg.public_url.clone(), secure_cookie: cfg.public_url.starts_with("https://") },
        direct: cfg.delivery.run_relays.then(|| app::DirectDispatch {
            jobs: std::sync::Arc::new(queue::NatsJobs { js: js.clone(), names: names.clone() }),
            endpoint_cap: cfg.delivery.endpoint_in_flight_cap,
            expand_at_publish: cfg.delivery.expand_at_publish,
        }),
        switch_offs: std::sync::Arc::new(switch_offs::NatsSwitchOffs { client: js.client(), names: names.clone() }),
        clock: std::sync::Arc::new(app::SystemClock),
    })
}

/// The relays (outbox, deliveries and their NOTIFY listener, the prober,
/// bulk recoveries), once the broker's streams are there.
async fn relays(
    app: App,
    js: async_nats::jetstream::Context,
    names: StreamNames,
    cfg: ApiConfig,
    rx: watch::Receiver<bool>,
    broker_link: watch::Receiver<broker::Link>,
) -> Result<()> {
    let (batch, idle, lease, endpoint_cap) =
        (cfg.delivery.relay_batch, cfg.delivery.relay_idle, cfg.delivery.lease, cfg.delivery.endpoint_in_flight_cap);
    let (events_backlog, replicas) = (cfg.broker.events_backlog, cfg.broker.stream_replicas);
    let mut waiting = rx.clone();
    if !ensure_streams_until_ready(&js, &names, replicas, &mut waiting).await {
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
        conn: tokio::sync::Mutex::new(db::batcher::KeptConnection::new(app.db())),
        unmarked: Default::default(),
        last_published: Default::default(),
        last_look: Default::default(),
    };
    app.outbox_offers().open();
    let listen = DeliveryRelay::listen(app.clone(), rx.clone());
    let prober = relay::prober::Prober { app: app.clone(), idle: std::time::Duration::from_secs(5) };
    let recoverer = relay::bulk_recovery::Recoverer {
        app: app.clone(),
        per_pass: i64::from(app.health_settings().recover_per_second),
        every: std::time::Duration::from_secs(1),
        backstop: std::time::Duration::from_secs(5),
        busy: Default::default(),
        last: Default::default(),
    };
    let lost = relay::lost_events::LostEvents { app: app.clone(), js: js.clone(), names: names.clone(), replicas, link: broker_link };
    let conn = tokio::sync::Mutex::new(db::batcher::KeptConnection::new(app.db()));
    let deliveries = DeliveryRelay { app, js, names, batch, lease, idle, endpoint_cap, conn };
    tokio::join!(
        outbox.run(rx.clone()),
        deliveries.run(rx.clone()),
        listen,
        prober.run(rx.clone()),
        recoverer.run(rx.clone()),
        lost.run(rx)
    );
    Ok(())
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
