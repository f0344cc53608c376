//! The Relay dispatcher: consumes EVENTS (→ Expand) and DELIVERIES
//! (→ Material → sign → POST → Outcome). It owns no database; every read and
//! write goes through the api's internal seam.

pub mod attempt;
pub mod batch;
pub mod config;
pub mod consume;
pub mod http_client;
mod lanes;
mod listen;
mod oauth2;
pub mod seam;
mod settle;
mod switched_off;
mod take;
mod turns;
mod unreported;
mod verdict;

use std::{sync::Arc, time::Duration};

use anyhow::{Context, Result};
use relay_contracts::StreamNames;
use tokio::{sync::watch, task::JoinSet};

pub use crate::config::DispatcherConfig;

pub struct RunningDispatcher {
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<Result<()>>,
    nats: async_nats::Client,
}

/// What the health port answers from.
#[derive(Clone)]
pub struct Readiness {
    nats: async_nats::Client,
}

impl Readiness {
    /// Ready while connected to a NATS server: that is all the dispatcher
    /// needs to take work (the api's seam is called per job, and a job
    /// whose call fails comes back).
    pub fn ready(&self) -> bool {
        self.nats.connection_state() == async_nats::connection::State::Connected
    }
}

/// `GET /healthz` (the process answers) and `GET /readyz` (200 when
/// connected to NATS, 503 otherwise), until `stop` resolves.
pub async fn serve_health(
    listener: tokio::net::TcpListener,
    readiness: Readiness,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" })).route(
        "/readyz",
        axum::routing::get(move || {
            let ready = readiness.ready();
            async move {
                if ready {
                    (http::StatusCode::OK, r#"{"nats":true}"#)
                } else {
                    (http::StatusCode::SERVICE_UNAVAILABLE, r#"{"nats":false}"#)
                }
            }
        }),
    );
    axum::serve(listener, router).with_graceful_shutdown(stop).await.context("health server")
}

impl RunningDispatcher {
    pub fn readiness(&self) -> Readiness {
        Readiness { nats: self.nats.clone() }
    }

    pub async fn shutdown(mut self) -> Result<()> {
        let _ = self.shutdown.send(true);
        while let Some(done) = self.tasks.join_next().await {
            done.context("a dispatcher task panicked")??;
        }
        Ok(())
    }

    pub async fn wait(&mut self) -> Result<()> {
        match self.tasks.join_next().await {
            Some(done) => done.context("a dispatcher task panicked")?,
            None => Ok(()),
        }
    }
}

pub async fn run(cfg: DispatcherConfig) -> Result<RunningDispatcher> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cfg = Arc::new(cfg);
    let names = StreamNames::new(&cfg.stream_prefix).map_err(anyhow::Error::msg)?;
    let seam = seam::connect(&cfg)?;
    // With several servers the client connects to any and fails over between
    // them (and those the cluster announces) on its own.
    let servers = relay_config::nats_servers(&cfg.nats_url)?
        .iter()
        .map(|s| s.parse::<async_nats::ServerAddr>().with_context(|| format!("RELAY_NATS_URL: {s:?} is not a NATS server address")))
        .collect::<Result<Vec<_>>>()?;
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .name("relay-dispatcher")
        .connect(servers)
        .await
        .with_context(|| format!("connecting to NATS at {}", cfg.nats_url))?;
    let js = async_nats::jetstream::new(client.clone());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    // One set of lanes: jobs from DELIVERIES and first attempts handed over
    // by expansions queue on the same lane of their endpoint.
    let listen = listen::Route { client: client.clone(), names: names.clone(), timeout: cfg.attempt_timeout };
    let lanes = Arc::new(lanes::LaneSet::new(seam.clone(), &cfg, stop_rx.clone(), listen)?);
    for which in [Consumer::Expand, Consumer::Deliver] {
        let (js, names, seam, cfg, lanes, stop) = (js.clone(), names.clone(), seam.clone(), cfg.clone(), lanes.clone(), stop_rx.clone());
        tasks.spawn(supervise(which, js, names, seam, cfg, lanes, stop));
    }
    // Every api sends the first attempts it expands at publish to the
    // dispatchers that keep this stream open to it.
    for (api, seam) in seam::each_api(&cfg)? {
        tasks.spawn({
            let taken = take::take_loop(api, seam, lanes.clone(), stop_rx.clone());
            async move {
                taken.await;
                Ok(())
            }
        });
    }
    tasks.spawn(hear_switch_offs(client.clone(), names, &cfg, &lanes, stop_rx));
    Ok(RunningDispatcher { shutdown: stop_tx, tasks, nats: client })
}

/// Listens for the api's switch-off notices (see `switched_off`), starting
/// again when the subscription fails, until `stop`.
fn hear_switch_offs(
    client: async_nats::Client,
    names: StreamNames,
    cfg: &DispatcherConfig,
    lanes: &lanes::LaneSet,
    mut stop: watch::Receiver<bool>,
) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
    let (claimant, claim_hold) = lanes.claim();
    let switches = lanes.switches();
    // A refusal outlives every claim the api could have seen, and with it
    // any material this process got for the attempt; an attempt on the wire
    // ends by its timeout, and its response's body by 2 s after.
    let keep = claim_hold + relay_config::timing::MATERIAL_FRESH;
    let on_wire_bound = cfg.attempt_timeout + Duration::from_secs(3);
    async move {
        loop {
            let heard = switched_off::listen(
                client.clone(),
                names.clone(),
                claimant.clone(),
                switches.clone(),
                (keep, on_wire_bound),
                stop.clone(),
            )
            .await;
            if *stop.borrow() {
                return Ok(());
            }
            if let Err(e) = heard {
                tracing::warn!(error = format!("{e:#}"), "listening for switch-off notices stopped; starting again");
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return Ok(()),
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Consumer {
    Expand,
    Deliver,
}

/// Runs a consumer, restarting it when it fails (the stream may not exist
/// until the api has been up once, or the broker may be away).
async fn supervise(
    which: Consumer,
    js: async_nats::jetstream::Context,
    names: StreamNames,
    seam: seam::Seam,
    cfg: Arc<DispatcherConfig>,
    lanes: Arc<lanes::LaneSet>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    loop {
        let result = match which {
            Consumer::Expand => {
                consume::expand_loop(js.clone(), names.clone(), seam.clone(), cfg.clone(), lanes.clone(), stop.clone()).await
            }
            Consumer::Deliver => consume::deliver_loop(js.clone(), names.clone(), cfg.clone(), lanes.clone(), stop.clone()).await,
        };
        if *stop.borrow() {
            return Ok(());
        }
        if let Err(e) = result {
            tracing::warn!(consumer = ?which, error = format!("{e:#}"), "consumer stopped; restarting");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => return Ok(()),
        }
    }
}
