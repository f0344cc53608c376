//! Test harness: a fresh database per test, stream names per test, the real
//! api and dispatcher started in-process on port 0, and HTTP receivers on
//! loopback. Everything talks to the real Postgres and NATS on 127.0.0.1.

pub mod flaky;
pub mod load;
pub mod otlp;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use axum::{Router, body::Bytes, http::HeaderMap};
use relay_api::{Listeners, RunningApi, config::ApiConfig, secrets::Keyring};
use relay_contracts::relay::admin::v1::admin_service_client::AdminServiceClient;
use relay_dispatcher::{DispatcherConfig, RunningDispatcher};
use relay_domain::{health::CircuitPolicy, schedule::RetrySchedule};
use relay_netguard::Policy;
use sqlx::{Connection, Executor, PgConnection};
use tokio::net::TcpListener;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use uuid::Uuid;

pub const PG_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A small deterministic generator (splitmix64) for tests that choose at
/// random: a printed seed replays a run.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// From 0 to `n` - 1 (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next_u64() % n as u64) as usize }
    }

    /// From `lo` to `hi`, both included.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    pub fn choose<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// A database created for one test and dropped by `cleanup`.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub port: u16,
}

impl TestDb {
    pub async fn create() -> Result<Self> {
        Self::create_on(5432).await
    }

    /// A fresh database on the Postgres at this loopback port.
    pub async fn create_on(port: u16) -> Result<Self> {
        let name = format!("relay_test_{}", Uuid::new_v4().simple());
        let admin = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let mut conn = PgConnection::connect(&admin).await.with_context(|| format!("connecting to Postgres on 127.0.0.1:{port}"))?;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).await?;
        Ok(Self { url: format!("postgres://postgres@127.0.0.1:{port}/{name}"), name, port })
    }

    /// The same database on another server (a promoted standby's port).
    pub fn moved_to(&mut self, port: u16) {
        self.url = format!("postgres://postgres@127.0.0.1:{port}/{}", self.name);
        self.port = port;
    }

    pub async fn cleanup(self) -> Result<()> {
        let admin = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
        let Ok(mut conn) = PgConnection::connect(&admin).await else {
            // A private server already stopped takes its databases with it.
            return Ok(());
        };
        conn.execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))).await?;
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub retry_tiers: RetrySchedule,
    pub attempt_timeout: Duration,
    pub seam_timeout: Duration,
    /// Start a dispatcher with the api (tests of "no dispatcher" set false).
    pub dispatcher: bool,
    pub max_in_flight: usize,
    /// Start the api in-process (tests that run it as a process set false).
    pub api: bool,
    /// One URL, or a cluster's as a comma-separated list.
    pub nats_url: String,
    /// Copies of each stream (`RELAY_STREAM_REPLICAS`): 3 on a `NatsCluster`.
    pub stream_replicas: usize,
    /// The Postgres the stack's database is made on (a `PrivatePostgres`'s port).
    pub pg_port: u16,
    /// A standby of that Postgres: the api is given both servers, libpq-style
    /// (`127.0.0.1:primary,127.0.0.1:standby`), and follows the primary.
    pub standby_pg_port: Option<u16>,
    /// The relay's per-endpoint cap on attempts handed out and unreported.
    pub endpoint_cap: i64,
    /// Production URL rules (https only, nothing blocked allowed) instead of
    /// the dev allowances for loopback receivers.
    pub strict_urls: bool,
    /// Resolvers for the api's registration check and the dispatcher's send.
    pub api_resolver: Option<std::sync::Arc<dyn relay_netguard::Resolve>>,
    pub dispatcher_resolver: Option<std::sync::Arc<dyn relay_netguard::Resolve>>,
    pub egress_proxy: Option<String>,
    /// `RELAY_SECRET_KEYS` for the api; the development key when `None`.
    pub secret_keys: Option<String>,
    /// How long an idle relay sleeps when nothing wakes it.
    pub relay_idle: Duration,
    /// The api's Postgres pool: its size and how long a call waits for a connection.
    pub db_pool_size: u32,
    pub db_acquire_timeout: Duration,
    /// The circuit: what opens it and the probes' back-off, short (see
    /// `test_circuit`) so tests see opening, probing and recovery within
    /// seconds. Its probe guard is derived from the timeouts at start.
    pub circuit: CircuitPolicy,
    /// How long a tenant call may take before it is answered 503.
    pub tenant_work_deadline: Duration,
    /// Deliveries a bulk recovery sends again per second per endpoint.
    pub recover_per_second: u32,
}

/// The production circuit rule at the tests' scale: a 2 s window, at least
/// 5 attempts 90 % failed, 300 ms without a success, 2 failed retries;
/// probes from 100 ms backing off to 300 ms.
pub fn test_circuit() -> CircuitPolicy {
    CircuitPolicy {
        enabled: true,
        window: Duration::from_secs(2),
        min_attempts: 5,
        failure_permille: 900,
        quiet: Duration::from_millis(300),
        min_failed_retries: 2,
        first_probe: Duration::from_millis(100),
        max_probe: Duration::from_millis(300),
        probe_guard: Duration::ZERO,
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            retry_tiers: RetrySchedule::parse("0,50,50,50,50,50,50").expect("valid"),
            attempt_timeout: Duration::from_secs(2),
            seam_timeout: Duration::from_secs(5),
            dispatcher: true,
            max_in_flight: 256,
            api: true,
            nats_url: NATS_URL.into(),
            stream_replicas: 1,
            pg_port: 5432,
            standby_pg_port: None,
            endpoint_cap: 4,
            strict_urls: false,
            api_resolver: None,
            dispatcher_resolver: None,
            egress_proxy: None,
            secret_keys: None,
            relay_idle: Duration::from_millis(500),
            db_pool_size: 20,
            db_acquire_timeout: Duration::from_secs(5),
            circuit: test_circuit(),
            tenant_work_deadline: relay_api::detach::TENANT_WORK_DEADLINE,
            recover_per_second: 1000,
        }
    }
}

impl Options {
    pub fn url_policy(&self) -> Policy {
        if self.strict_urls { Policy::strict() } else { dev_policy() }
    }

    pub fn tiers(mut self, spec: &str) -> Self {
        self.retry_tiers = RetrySchedule::parse(spec).expect("valid tiers");
        self
    }

    /// The circuit never opens (`RELAY_DEV_CIRCUIT_OFF`): each delivery
    /// follows the plain retry schedule.
    pub fn circuit_off(mut self) -> Self {
        self.circuit.enabled = false;
        self
    }

    /// Probes backing off from `first` to `max`.
    pub fn probes(mut self, first: Duration, max: Duration) -> Self {
        (self.circuit.first_probe, self.circuit.max_probe) = (first, max);
        self
    }
}

/// The whole system for one test.
pub struct Stack {
    pub db: TestDb,
    pub prefix: String,
    pub certs: PathBuf,
    pub rest_url: String,
    pub grpc_url: String,
    pub internal_url: String,
    pub opts: Options,
    pub addrs: relay_api::config::ListenAddrs,
    /// The in-process api's Prometheus endpoint.
    pub metrics_url: String,
    api_cfg: ApiConfig,
    api: Option<RunningApi>,
    replicas: Vec<RunningApi>,
    dispatchers: Vec<RunningDispatcher>,
}

fn dev_policy() -> Policy {
    Policy { allow_http: true, allowed_ranges: vec!["127.0.0.0/8".parse().expect("valid")] }
}

/// `RELAY_TEST_LOG=debug` (any tracing filter) shows the services' logs.
fn init_logs() {
    if let Ok(filter) = std::env::var("RELAY_TEST_LOG") {
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
    }
}

pub async fn free_addr() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0").await?.local_addr()?)
}

/// Three distinct free ports for an api. Each probe's listener is dropped
/// before the next, so the kernel may hand the same port out twice (seen:
/// gRPC and internal on one port); ask again until they differ.
pub async fn api_addrs() -> Result<relay_api::config::ListenAddrs> {
    for _ in 0..20 {
        let (grpc, rest, internal) = (free_addr().await?, free_addr().await?, free_addr().await?);
        if grpc != rest && rest != internal && grpc != internal {
            return Ok(relay_api::config::ListenAddrs { grpc, rest, internal });
        }
    }
    anyhow::bail!("could not find three distinct free ports on 127.0.0.1")
}

async fn listeners(addrs: &relay_api::config::ListenAddrs) -> Result<Listeners> {
    // The port may linger for a moment after an api on it stopped.
    for _ in 0..50 {
        let bound = async {
            Ok::<_, std::io::Error>((
                TcpListener::bind(addrs.grpc).await?,
                TcpListener::bind(addrs.rest).await?,
                TcpListener::bind(addrs.internal).await?,
            ))
        }
        .await;
        if let Ok((grpc, rest, internal)) = bound {
            return Ok(Listeners { grpc, rest, internal, metrics: None });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("could not bind the api's ports {addrs:?}")
}

impl Stack {
    pub async fn start(opts: Options) -> Result<Self> {
        // The services install it when they start in-process; a stack whose
        // services all run as processes still makes HTTPS-capable clients.
        let _ = rustls::crypto::ring::default_provider().install_default();
        init_logs();
        let db = TestDb::create_on(opts.pg_port).await?;
        let prefix = format!("t{}_", &Uuid::new_v4().simple().to_string()[..12]);
        let certs = std::env::temp_dir().join(format!("relay-test-{prefix}"));
        relay_devkit::generate_pki()?.write(&certs)?;
        let addrs = api_addrs().await?;
        let api_cfg = ApiConfig {
            deployment: relay_api::config::Deployment::Development,
            database_url: match opts.standby_pg_port {
                Some(standby) => db.url.replace(&format!("127.0.0.1:{}/", db.port), &format!("127.0.0.1:{},127.0.0.1:{standby}/", db.port)),
                None => db.url.clone(),
            },
            nats_url: opts.nats_url.clone(),
            stream_replicas: opts.stream_replicas,
            allow_fewer_stream_replicas: false,
            stream_prefix: prefix.clone(),
            internal_tls: relay_api::config::InternalTls {
                client_ca: certs.join("ca.pem"),
                cert: certs.join("api.pem"),
                key: certs.join("api-key.pem"),
            },
            keyring: match &opts.secret_keys {
                Some(spec) => Keyring::parse(spec)?,
                None => Keyring::development(),
            },
            url_policy: opts.url_policy(),
            resolver: opts.api_resolver.clone().unwrap_or_else(|| std::sync::Arc::new(relay_netguard::SystemResolver)),
            schedule: opts.retry_tiers.clone(),
            delivery_lease: Duration::from_secs(60),
            relay_idle: opts.relay_idle,
            relay_batch: 200,
            events_backlog: 256,
            pool_size: opts.db_pool_size,
            db_acquire_timeout: opts.db_acquire_timeout,
            endpoint_in_flight_cap: opts.endpoint_cap,
            run_migrations: true,
            run_relays: true,
            dead_letter_retention: Duration::from_secs(7 * 24 * 3600),
            dead_letter_prune_every: Duration::from_millis(200),
            retention: Duration::from_secs(30 * 24 * 3600),
            tenant_work_deadline: opts.tenant_work_deadline,
            public_url: format!("http://{}", addrs.rest),
            health: relay_api::app::HealthSettings {
                circuit: CircuitPolicy { probe_guard: (opts.attempt_timeout + opts.seam_timeout) * 2, ..opts.circuit },
                recover_per_second: opts.recover_per_second,
                shortest_disable_window: Duration::from_secs(1),
            },
        };
        api_cfg.validate()?;
        let mut stack = Self {
            db,
            prefix,
            certs,
            rest_url: format!("http://{}", addrs.rest),
            grpc_url: format!("http://{}", addrs.grpc),
            internal_url: format!("https://127.0.0.1:{}", addrs.internal.port()),
            opts: opts.clone(),
            addrs,
            metrics_url: String::new(),
            api_cfg,
            api: None,
            replicas: Vec::new(),
            dispatchers: Vec::new(),
        };
        if opts.api {
            stack.start_api().await?;
        }
        if opts.dispatcher {
            stack.start_dispatcher().await?;
        }
        Ok(stack)
    }

    /// Changes `RELAY_SECRET_KEYS` for the next `start_api`.
    pub fn set_secret_keys(&mut self, spec: &str) -> Result<()> {
        self.api_cfg.keyring = Keyring::parse(spec)?;
        Ok(())
    }

    /// Starts the api in-process on this stack's ports (again, after `stop_api`).
    pub async fn start_api(&mut self) -> Result<()> {
        anyhow::ensure!(self.api.is_none(), "the api is already running");
        let mut l = listeners(&self.addrs).await?;
        let metrics = TcpListener::bind("127.0.0.1:0").await?;
        self.metrics_url = format!("http://{}/metrics", metrics.local_addr()?);
        l.metrics = Some(metrics);
        self.api = Some(relay_api::run(self.api_cfg.clone(), l).await?);
        Ok(())
    }

    /// Stops the in-process api, closing its ports.
    pub async fn stop_api(&mut self) -> Result<()> {
        if let Some(a) = self.api.take() {
            a.shutdown().await?;
        }
        Ok(())
    }

    /// Starts another api on the same database and streams, on its own
    /// ports; returns its REST and internal URLs.
    pub async fn start_api_replica(&mut self) -> Result<(String, String)> {
        let cfg = self.api_cfg.clone();
        self.start_api_replica_with(cfg).await
    }

    /// The api's configuration for this stack, to vary for a replica.
    pub fn api_config(&self) -> ApiConfig {
        self.api_cfg.clone()
    }

    pub async fn start_api_replica_with(&mut self, cfg: ApiConfig) -> Result<(String, String)> {
        let addrs = api_addrs().await?;
        let l = listeners(&addrs).await?;
        self.replicas.push(relay_api::run(cfg, l).await?);
        Ok((format!("http://{}", addrs.rest), format!("https://127.0.0.1:{}", addrs.internal.port())))
    }

    /// A durable consumer's state, as the broker reports it.
    pub async fn consumer_info(&self, deliveries: bool) -> Result<async_nats::jetstream::consumer::Info> {
        let js = async_nats::jetstream::new(async_nats::connect(&self.opts.nats_url).await?);
        let names = relay_contracts::StreamNames::new(&self.prefix).map_err(anyhow::Error::msg)?;
        let (stream, durable) =
            if deliveries { (names.deliveries_stream(), names.deliver_durable()) } else { (names.events_stream(), names.expand_durable()) };
        let mut consumer: async_nats::jetstream::consumer::PullConsumer =
            js.get_stream(stream).await?.get_consumer(&durable).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(consumer.info().await?.clone())
    }

    /// The dispatcher's configuration for this stack.
    pub fn dispatcher_config(&self) -> DispatcherConfig {
        DispatcherConfig {
            production: false,
            nats_url: self.opts.nats_url.clone(),
            stream_prefix: self.prefix.clone(),
            api_url: self.internal_url.clone(),
            api_tls_name: relay_devkit::API_TLS_NAME.into(),
            tls_ca: self.certs.join("ca.pem"),
            tls_cert: self.certs.join("dispatcher.pem"),
            tls_key: self.certs.join("dispatcher-key.pem"),
            attempt_timeout: self.opts.attempt_timeout,
            max_in_flight: self.opts.max_in_flight,
            max_expanding: 256,
            seam_timeout: self.opts.seam_timeout,
            url_policy: self.opts.url_policy(),
            resolver: self.opts.dispatcher_resolver.clone().unwrap_or_else(|| std::sync::Arc::new(relay_netguard::SystemResolver)),
            egress_proxy: self.opts.egress_proxy.clone(),
            source_address: None,
        }
    }

    /// Starts one more dispatcher (in-process) on this stack.
    pub async fn start_dispatcher(&mut self) -> Result<()> {
        let cfg = self.dispatcher_config();
        self.start_dispatcher_with(cfg).await
    }

    /// Stops every in-process dispatcher of this stack.
    pub async fn stop_dispatchers(&mut self) -> Result<()> {
        for d in self.dispatchers.drain(..) {
            d.shutdown().await?;
        }
        Ok(())
    }

    pub async fn start_dispatcher_with(&mut self, cfg: DispatcherConfig) -> Result<()> {
        cfg.validate()?;
        self.dispatchers.push(relay_dispatcher::run(cfg).await?);
        Ok(())
    }

    /// The environment a `relay-dispatcher` process needs for this stack.
    pub fn dispatcher_env(&self) -> Vec<(&'static str, String)> {
        let c = self.dispatcher_config();
        vec![
            ("RELAY_NATS_URL", c.nats_url),
            ("RELAY_STREAM_PREFIX", c.stream_prefix),
            ("RELAY_API_INTERNAL_URL", c.api_url),
            ("RELAY_API_TLS_NAME", c.api_tls_name),
            ("RELAY_TLS_CA", c.tls_ca.display().to_string()),
            ("RELAY_TLS_CERT", c.tls_cert.display().to_string()),
            ("RELAY_TLS_KEY", c.tls_key.display().to_string()),
            ("RELAY_ATTEMPT_TIMEOUT_MS", c.attempt_timeout.as_millis().to_string()),
            ("RELAY_SEAM_TIMEOUT_MS", c.seam_timeout.as_millis().to_string()),
            ("RELAY_DEV_ALLOW_HTTP_ENDPOINTS", "true".into()),
            ("RELAY_DEV_ALLOWED_ENDPOINT_RANGES", "127.0.0.0/8".into()),
            // Many dispatchers share this machine; a test that reads the port sets one.
            ("RELAY_HEALTH_ADDR", "off".into()),
        ]
    }

    /// The environment a `relay-api` process needs for this stack, on its ports.
    pub fn api_env(&self) -> Vec<(&'static str, String)> {
        let c = &self.api_cfg;
        let tiers: Vec<String> =
            (1..=c.schedule.max_attempts()).map(|a| c.schedule.delay_before(a).expect("in range").as_millis().to_string()).collect();
        vec![
            ("DATABASE_URL", c.database_url.clone()),
            ("RELAY_NATS_URL", c.nats_url.clone()),
            ("RELAY_STREAM_REPLICAS", c.stream_replicas.to_string()),
            ("RELAY_STREAM_PREFIX", c.stream_prefix.clone()),
            ("RELAY_TLS_CLIENT_CA", c.internal_tls.client_ca.display().to_string()),
            ("RELAY_TLS_CERT", c.internal_tls.cert.display().to_string()),
            ("RELAY_TLS_KEY", c.internal_tls.key.display().to_string()),
            ("RELAY_GRPC_ADDR", self.addrs.grpc.to_string()),
            ("RELAY_REST_ADDR", self.addrs.rest.to_string()),
            ("RELAY_INTERNAL_ADDR", self.addrs.internal.to_string()),
            ("RELAY_METRICS_ADDR", "off".into()),
            ("RELAY_RETRY_TIERS", tiers.join(",")),
            ("RELAY_ENDPOINT_IN_FLIGHT_CAP", c.endpoint_in_flight_cap.to_string()),
            ("RELAY_CIRCUIT_MIN_ATTEMPTS", c.health.circuit.min_attempts.to_string()),
            ("RELAY_CIRCUIT_FAILURE_PERCENT", (c.health.circuit.failure_permille / 10).to_string()),
            ("RELAY_CIRCUIT_WINDOW_MS", c.health.circuit.window.as_millis().to_string()),
            ("RELAY_CIRCUIT_QUIET_MS", c.health.circuit.quiet.as_millis().to_string()),
            ("RELAY_CIRCUIT_MIN_FAILED_RETRIES", c.health.circuit.min_failed_retries.to_string()),
            ("RELAY_DEV_CIRCUIT_OFF", (!c.health.circuit.enabled).to_string()),
            ("RELAY_PROBE_BACKOFF_MS", format!("{},{}", c.health.circuit.first_probe.as_millis(), c.health.circuit.max_probe.as_millis())),
            ("RELAY_RECOVER_PER_SECOND", c.health.recover_per_second.to_string()),
            ("RELAY_DELIVERY_LEASE_SECS", c.delivery_lease.as_secs().to_string()),
            // The dispatcher's timeouts: the api checks its lease against them.
            ("RELAY_ATTEMPT_TIMEOUT_MS", self.opts.attempt_timeout.as_millis().to_string()),
            ("RELAY_SEAM_TIMEOUT_MS", self.opts.seam_timeout.as_millis().to_string()),
            ("RELAY_DEV_ALLOW_HTTP_ENDPOINTS", "true".into()),
            ("RELAY_DEV_ALLOWED_ENDPOINT_RANGES", "127.0.0.0/8".into()),
        ]
    }

    /// Waits (bounded) until the REST port answers.
    pub async fn wait_for_api(&self) -> Result<()> {
        let http = reqwest::Client::new();
        for _ in 0..200 {
            if http.get(format!("{}/healthz", self.rest_url)).send().await.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("the api did not answer on {}", self.rest_url)
    }

    /// A connection pool on this test's database, for arranging and
    /// inspecting rows the API does not expose (backdating, counting).
    pub async fn pg(&self) -> Result<sqlx::PgPool> {
        Ok(sqlx::PgPool::connect(&self.db.url).await?)
    }

    /// A client of the internal seam with the dispatcher's identity.
    pub async fn seam(&self) -> Result<relay_contracts::relay::dispatch::v1::dispatch_service_client::DispatchServiceClient<Channel>> {
        Ok(relay_contracts::relay::dispatch::v1::dispatch_service_client::DispatchServiceClient::new(
            self.internal_channel(Some("dispatcher")).await?,
        ))
    }

    /// A client of the internal port presenting the named certificate
    /// (`operator`, `dispatcher`), or none.
    pub async fn internal_channel(&self, identity: Option<&str>) -> Result<Channel> {
        let read = |f: &str| std::fs::read(self.certs.join(f)).with_context(|| format!("reading {f}"));
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("ca.pem")?)).domain_name(relay_devkit::API_TLS_NAME);
        if let Some(name) = identity {
            tls = tls.identity(Identity::from_pem(read(&format!("{name}.pem"))?, read(&format!("{name}-key.pem"))?));
        }
        Ok(Channel::from_shared(self.internal_url.clone())?.tls_config(tls)?.connect().await?)
    }

    pub async fn admin(&self) -> Result<AdminServiceClient<Channel>> {
        Ok(AdminServiceClient::new(self.internal_channel(Some("operator")).await?))
    }

    /// An environment with an API key, made through the admin service.
    pub async fn tenant(&self, name: &str) -> Result<TenantCreds> {
        self.tenant_with_quota(name, 0).await
    }

    /// A tenant that may register `endpoint_quota` endpoints (0: the default).
    pub async fn tenant_with_quota(&self, name: &str, endpoint_quota: u32) -> Result<TenantCreds> {
        use relay_contracts::relay::admin::v1::{CreateApiKeyRequest, CreateEnvironmentRequest};
        let mut admin = self.admin().await?;
        let env = admin
            .create_environment(CreateEnvironmentRequest { name: name.into(), endpoint_quota })
            .await?
            .into_inner()
            .environment
            .context("no environment returned")?;
        let key = admin.create_api_key(CreateApiKeyRequest { environment_id: env.id.clone(), name: "test".into() }).await?.into_inner();
        Ok(TenantCreds { environment_id: env.id, api_key: key.key })
    }

    /// What must hold in the database after anything at all, checked at the
    /// end of every test (by `stop`). Returns each violation with examples.
    pub async fn invariant_violations(&self) -> Result<Vec<String>> {
        let pg = self.pg().await?;
        let mut found = Vec::new();
        for (what, sql) in INVARIANTS {
            let ids: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("{sql} LIMIT 5"))).fetch_all(&pg).await?;
            if !ids.is_empty() {
                found.push(format!("{what}: {ids:?}"));
            }
        }
        pg.close().await;
        Ok(found)
    }

    pub async fn stop(mut self) -> Result<()> {
        for d in self.dispatchers.drain(..) {
            d.shutdown().await?;
        }
        for a in self.replicas.drain(..) {
            a.shutdown().await?;
        }
        if let Some(a) = self.api.take() {
            a.shutdown().await?;
        }
        let violations = self.invariant_violations().await?;
        anyhow::ensure!(violations.is_empty(), "invariants broken at the end of the test:\n{}", violations.join("\n"));
        let _ = std::fs::remove_dir_all(&self.certs);
        delete_streams(&self.opts.nats_url, &self.prefix).await?;
        self.db.cleanup().await
    }
}

/// Queries that find rows breaking an invariant of the delivery state
/// machine; each must find none.
pub const INVARIANTS: &[(&str, &str)] = &[
    (
        "a pending delivery of an endpoint nothing is sent to (it would wait forever)",
        "SELECT d.id FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
         WHERE d.state = 'pending' AND (e.deleted_at IS NOT NULL OR (NOT e.enabled AND e.disabled_reason <> 'failing'))",
    ),
    (
        "a held delivery of an endpoint that is up (nothing would release it)",
        "SELECT d.id FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
           JOIN endpoint_health h ON h.endpoint_id = e.id
         WHERE d.state = 'held' AND h.circuit = 'closed' AND e.enabled AND e.deleted_at IS NULL",
    ),
    (
        "a held delivery of an endpoint the tenant switched off (it should be a dead letter)",
        "SELECT d.id FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
         WHERE d.state = 'held' AND (e.deleted_at IS NOT NULL OR e.disabled_reason = 'manual')",
    ),
    (
        "an endpoint without its health row",
        "SELECT e.id FROM webhook_endpoints e WHERE NOT EXISTS (SELECT 1 FROM endpoint_health h WHERE h.endpoint_id = e.id)",
    ),
    (
        "a pending delivery whose lease has no expiry after it began",
        "SELECT id FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at <= dispatched_at",
    ),
    (
        "a delivered delivery without a 2xx attempt on record",
        "SELECT d.id FROM webhook_deliveries d WHERE d.state = 'delivered' AND NOT EXISTS (
           SELECT 1 FROM delivery_attempts a WHERE a.delivery_id = d.id AND a.http_status BETWEEN 200 AND 299)",
    ),
    ("an attempt outside the schedule's seven", "SELECT id FROM webhook_deliveries WHERE attempt NOT BETWEEN 1 AND 7"),
];

async fn delete_streams(nats_url: &str, prefix: &str) -> Result<()> {
    // A private NATS may already be stopped; its streams go with its store.
    let Ok(client) = async_nats::connect(nats_url).await else { return Ok(()) };
    let js = async_nats::jetstream::new(client);
    for s in ["EVENTS", "DELIVERIES"] {
        let _ = js.delete_stream(format!("{prefix}{s}")).await;
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct TenantCreds {
    pub environment_id: String,
    pub api_key: String,
}

/// One request a receiver got.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
    /// The sender's address: the torture tells its dispatchers apart by it.
    pub peer: SocketAddr,
}

impl Received {
    pub fn header(&self, name: &str) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// One `v1=<hex>` signature entry, computed from `docs/webhooks.md` alone
/// and deliberately not by calling the project's signer: HMAC-SHA256 keyed
/// with the secret's UTF-8 bytes over `v1:<timestamp>:<raw body>`, lowercase hex.
pub fn contract_signature(secret: &str, timestamp: &str, body: &[u8]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(format!("v1:{timestamp}:").as_bytes());
    mac.update(body);
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `within`.
pub async fn eventually<T, F, Fut>(within: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How a receiver answers requests to one path.
#[derive(Debug, Clone)]
pub enum Reply {
    Status(u16),
    /// A status with one header (`Retry-After`, say).
    StatusWith(u16, &'static str, String),
    /// 302 with this `Location`.
    Redirect(String),
    /// Holds the request this long before answering 200 (past any attempt timeout).
    Hang(Duration),
    /// Fails sometimes, as `flaky` describes.
    Flaky(Arc<flaky::Flaky>),
}

/// An HTTP server on loopback that records every request and answers as
/// told per path (200 unless set otherwise).
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    pub got: Arc<Mutex<Vec<Received>>>,
    replies: Arc<Mutex<std::collections::HashMap<String, Reply>>>,
}

impl Receiver {
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let got: Arc<Mutex<Vec<Received>>> = Default::default();
        let replies: Arc<Mutex<std::collections::HashMap<String, Reply>>> = Default::default();
        let (sink, table) = (got.clone(), replies.clone());
        let app = Router::new().fallback(
            move |peer: axum::extract::ConnectInfo<SocketAddr>, uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
                let (sink, table) = (sink.clone(), table.clone());
                async move {
                    let path = uri.path().to_owned();
                    let (headers_seen, body_seen) = (headers.clone(), body.clone());
                    sink.lock().expect("not poisoned").push(Received {
                        path: path.clone(),
                        headers,
                        body,
                        at: Instant::now(),
                        peer: peer.0,
                    });
                    let reply = table.lock().expect("not poisoned").get(&path).cloned().unwrap_or(Reply::Status(200));
                    use axum::response::IntoResponse;
                    match reply {
                        Reply::Status(code) => (axum::http::StatusCode::from_u16(code).expect("valid status"), "answer").into_response(),
                        Reply::StatusWith(code, name, value) => {
                            (axum::http::StatusCode::from_u16(code).expect("valid status"), [(name, value)], "answer").into_response()
                        }
                        Reply::Redirect(to) => {
                            (axum::http::StatusCode::FOUND, [(axum::http::header::LOCATION, to)], "moved").into_response()
                        }
                        Reply::Hang(d) => {
                            tokio::time::sleep(d).await;
                            (axum::http::StatusCode::OK, "late").into_response()
                        }
                        Reply::Flaky(f) => {
                            let answer = f.answer(&headers_seen, &body_seen, Instant::now());
                            tokio::time::sleep(answer.after).await;
                            let status = axum::http::StatusCode::from_u16(answer.status).expect("valid status");
                            match answer.retry_after {
                                Some(after) => (status, [("retry-after", after)], "answer").into_response(),
                                None => (status, "answer").into_response(),
                            }
                        }
                    }
                }
            },
        );
        tokio::spawn(async move { axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await });
        Ok(Self { addr, got, replies })
    }

    /// Sets how requests to `path` are answered from now on.
    pub fn reply(&self, path: &str, reply: Reply) {
        self.replies.lock().expect("not poisoned").insert(path.to_owned(), reply);
    }

    /// The requests that arrived at `path`.
    pub fn at(&self, path: &str) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.path == path).collect()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn received(&self) -> Vec<Received> {
        self.got.lock().expect("not poisoned").clone()
    }

    /// Waits (bounded) until at least `n` requests arrived; returns them all.
    pub async fn wait_for(&self, n: usize, within: Duration) -> Vec<Received> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && self.received().len() < n {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.received()
    }

    /// Waits (bounded) until at least `n` requests arrived at `path`.
    pub async fn wait_at(&self, path: &str, n: usize, within: Duration) -> Vec<Received> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && self.at(path).len() < n {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.at(path)
    }
}

/// A REST client for one tenant.
pub struct Rest {
    pub base: String,
    pub key: Option<String>,
    pub http: reqwest::Client,
}

impl Rest {
    pub async fn get(&self, path: &str) -> Result<serde_json::Value> {
        let (status, body) = self.call(reqwest::Method::GET, path, None).await?;
        anyhow::ensure!(status == 200, "GET {path} answered {status}: {body}");
        Ok(body)
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> Result<(u16, serde_json::Value)> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// Registers an endpoint; returns (id, secret).
    pub async fn endpoint(&self, url: &str, types: &[&str]) -> Result<(String, String)> {
        let (status, body) = self.post("/v1/webhooks", serde_json::json!({"url": url, "event_types": types})).await?;
        anyhow::ensure!(status == 201, "creating an endpoint answered {status}: {body}");
        Ok((body["endpoint"]["id"].as_str().context("id")?.to_owned(), body["secret"].as_str().context("secret")?.to_owned()))
    }

    /// Publishes an event; returns its id.
    pub async fn publish(&self, event_type: &str, payload: serde_json::Value) -> Result<String> {
        let (status, body) = self.post("/v1/events", serde_json::json!({"type": event_type, "payload": payload})).await?;
        anyhow::ensure!(status == 202, "publishing answered {status}: {body}");
        Ok(body["event_id"].as_str().context("event_id")?.to_owned())
    }

    /// The deliveries of one event.
    pub async fn deliveries(&self, event_id: &str) -> Result<Vec<serde_json::Value>> {
        Ok(self.get(&format!("/v1/events/{event_id}/deliveries")).await?["deliveries"].as_array().cloned().unwrap_or_default())
    }

    pub fn new(base: &str, key: Option<&str>) -> Self {
        Self { base: base.to_owned(), key: key.map(str::to_owned), http: reqwest::Client::new() }
    }

    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<serde_json::Value>) -> Result<(u16, serde_json::Value)> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        self.send(req).await
    }

    /// A call with a body sent exactly as given (serde_json would re-print
    /// numbers and keys).
    pub async fn raw(&self, method: reqwest::Method, path: &str, body: String) -> Result<(u16, serde_json::Value)> {
        let req = self.http.request(method, format!("{}{path}", self.base)).header("content-type", "application/json").body(body);
        self.send(req).await
    }

    async fn send(&self, mut req: reqwest::RequestBuilder) -> Result<(u16, serde_json::Value)> {
        if let Some(k) = &self.key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let json = if text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?
        };
        Ok((status, json))
    }
}

/// A reflection client, as grpcurl uses it.
pub mod reflection {
    use anyhow::{Context, Result, bail};
    use tonic::transport::Channel;

    /// Lists services through server reflection (v1, or v1alpha as grpcurl 1.8 speaks).
    pub async fn list_services(channel: Channel, v1alpha: bool) -> Result<Vec<String>> {
        if v1alpha {
            use tonic_reflection::pb::v1alpha::{
                ServerReflectionRequest, server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
                server_reflection_response::MessageResponse,
            };
            let mut c = ServerReflectionClient::new(channel);
            let req = ServerReflectionRequest { host: String::new(), message_request: Some(MessageRequest::ListServices(String::new())) };
            let mut stream = c.server_reflection_info(tokio_stream::iter([req])).await?.into_inner();
            let resp = stream.message().await?.context("no reflection response")?;
            match resp.message_response {
                Some(MessageResponse::ListServicesResponse(l)) => Ok(l.service.into_iter().map(|s| s.name).collect()),
                other => bail!("unexpected reflection response {other:?}"),
            }
        } else {
            use tonic_reflection::pb::v1::{
                ServerReflectionRequest, server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
                server_reflection_response::MessageResponse,
            };
            let mut c = ServerReflectionClient::new(channel);
            let req = ServerReflectionRequest { host: String::new(), message_request: Some(MessageRequest::ListServices(String::new())) };
            let mut stream = c.server_reflection_info(tokio_stream::iter([req])).await?.into_inner();
            let resp = stream.message().await?.context("no reflection response")?;
            match resp.message_response {
                Some(MessageResponse::ListServicesResponse(l)) => Ok(l.service.into_iter().map(|s| s.name).collect()),
                other => bail!("unexpected reflection response {other:?}"),
            }
        }
    }
}

/// A service binary built next to the tests (`cargo build --bins`, which
/// `deploy/local/test` runs first).
pub fn binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().and_then(|deps| deps.parent()).context("test binary has no target dir")?;
    let path = dir.join(name);
    anyhow::ensure!(path.exists(), "{} is missing: run `cargo build --bins` first (deploy/local/test does)", path.display());
    Ok(path)
}

/// A service running as a real process, so a test can kill -9 it.
pub struct Process {
    child: tokio::process::Child,
}

impl Process {
    pub fn spawn(name: &str, env: &[(&'static str, String)]) -> Result<Self> {
        let mut cmd = tokio::process::Command::new(binary(name)?);
        cmd.env("RELAY_LOG", std::env::var("RELAY_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            // The caller's settings win, RELAY_LOG included.
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null());
        Ok(Self { child: cmd.spawn().with_context(|| format!("starting {name}"))? })
    }

    /// Like [`Process::spawn`], but with `RELAY_LOG` as given (`None`: unset,
    /// the service's own default) and the logs discarded: for checks of what
    /// the services do at a log level other than the quiet one tests use.
    pub fn spawn_logging(name: &str, env: &[(&'static str, String)], log: Option<&str>) -> Result<Self> {
        let mut cmd = tokio::process::Command::new(binary(name)?);
        cmd.envs(env.iter().filter(|(k, _)| *k != "RELAY_LOG").map(|(k, v)| (*k, v.as_str())))
            .env_remove("RELAY_LOG")
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some(log) = log {
            cmd.env("RELAY_LOG", log);
        }
        Ok(Self { child: cmd.spawn().with_context(|| format!("starting {name}"))? })
    }

    /// Like [`Process::spawn`], with the process's output appended to `log`
    /// (a file that outlives it, for a test to point at when it fails).
    pub fn spawn_logging_to(name: &str, env: &[(&'static str, String)], log: &std::path::Path) -> Result<Self> {
        let file = || std::fs::OpenOptions::new().create(true).append(true).open(log).with_context(|| format!("opening {}", log.display()));
        let mut cmd = tokio::process::Command::new(binary(name)?);
        cmd.env("RELAY_LOG", std::env::var("RELAY_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null())
            .stdout(file()?)
            .stderr(file()?);
        Ok(Self { child: cmd.spawn().with_context(|| format!("starting {name}"))? })
    }

    /// SIGKILL: no shutdown path runs.
    pub async fn kill9(mut self) -> Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }
}

/// A NATS server of the test's own, on its own port and store, so a test
/// can stop the broker without disturbing anything else on the machine.
pub struct PrivateNats {
    pub port: u16,
    dir: PathBuf,
    child: Option<tokio::process::Child>,
    /// As a node of a cluster: its name, its route port and its peers' routes.
    cluster: Option<(String, u16, Vec<String>)>,
}

impl PrivateNats {
    pub async fn start() -> Result<Self> {
        let port = free_addr().await?.port();
        let dir = std::env::temp_dir().join(format!("relay-test-nats-{}", Uuid::new_v4().simple()));
        let mut n = Self { port, dir, child: None, cluster: None };
        n.resume().await?;
        Ok(n)
    }

    /// The node's server name in its cluster (what stream info calls the leader).
    pub fn server_name(&self) -> Option<&str> {
        self.cluster.as_ref().map(|c| c.0.as_str())
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and store.
    pub async fn resume(&mut self) -> Result<()> {
        let bin = ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .context("nats-server is not installed")?;
        let mut command = tokio::process::Command::new(bin);
        command.args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"]).arg(&self.dir);
        if let Some((name, route_port, routes)) = &self.cluster {
            command.args(["--server_name", name, "--cluster_name", "relay-test"]).args([
                "--cluster",
                &format!("nats://127.0.0.1:{route_port}"),
                "--routes",
                &routes.join(","),
            ]);
        }
        let child = command.kill_on_drop(true).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn()?;
        self.child = Some(child);
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("the private NATS did not start on port {}", self.port)
    }

    /// Kills the server with SIGKILL (no shutdown path runs), and waits.
    pub async fn kill9(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.start_kill()?;
            c.wait().await?;
        }
        Ok(())
    }

    /// Stops the server the way an operator would (SIGTERM), and waits.
    pub async fn stop(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
            }
            c.wait().await?;
        }
        Ok(())
    }
}

/// The Python of the verifiers' venv (`RELAY_VERIFIERS_PYTHON`, else where
/// `deploy/local/services.sh ensure_verifiers` puts it); an error saying how
/// to install it when it is not there.
pub fn verifiers_python() -> Result<PathBuf> {
    let python = std::env::var("RELAY_VERIFIERS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.relay/verifiers/bin/python"));
    anyhow::ensure!(
        python.exists(),
        "the verifiers' Python is not installed ({}): deploy/local/test installs it (deploy/local/services.sh ensure_verifiers)",
        python.display()
    );
    Ok(python)
}

/// A Postgres server of the test's own (Debian's binaries, a fresh cluster
/// in a temporary directory, trust auth, loopback only), so a test can stop
/// and restart the database without disturbing anything else.
pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
    /// `-c` settings given at every start.
    settings: Vec<String>,
}

impl PrivatePostgres {
    fn bin(name: &str) -> Result<PathBuf> {
        let dirs = std::fs::read_dir("/usr/lib/postgresql").context("Postgres's binaries are not installed")?;
        let mut found: Vec<PathBuf> = dirs.filter_map(|d| Some(d.ok()?.path().join("bin").join(name))).filter(|p| p.exists()).collect();
        found.sort();
        found.pop().with_context(|| format!("no {name} under /usr/lib/postgresql"))
    }

    /// As the `postgres` user when this runs as root (initdb refuses root).
    fn command(name: &str) -> Result<std::process::Command> {
        let bin = Self::bin(name)?;
        Ok(if running_as_root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin);
            c
        } else {
            std::process::Command::new(bin)
        })
    }

    fn run(mut command: std::process::Command, what: &str) -> Result<()> {
        let out = command.output().with_context(|| format!("running {what}"))?;
        anyhow::ensure!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    async fn empty_dir() -> Result<(u16, PathBuf)> {
        let port = free_addr().await?.port();
        let dir = std::env::temp_dir().join(format!("relay-test-pg-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        if running_as_root() {
            std::process::Command::new("chown").arg("postgres").arg(&dir).status()?;
        }
        Ok((port, dir))
    }

    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// A fresh server started with these `-c name=value` settings (kept for
    /// every restart).
    pub async fn start_with(settings: &[&str]) -> Result<Self> {
        let (port, dir) = Self::empty_dir().await?;
        let mut initdb = Self::command("initdb")?;
        initdb.arg("-D").arg(&dir).args(["-U", "postgres", "--auth=trust", "-N"]);
        Self::run(initdb, "initdb")?;
        let pg = Self { port, dir, settings: settings.iter().map(|s| s.to_string()).collect() };
        pg.resume()?;
        Ok(pg)
    }

    /// A primary whose commits return only once a standby has flushed them
    /// (`synchronous_standby_names = '*'`): with no standby attached, a
    /// commit waits, so start [`PrivatePostgres::standby_of`] before writing.
    pub async fn synchronous_primary() -> Result<Self> {
        Self::start_with(&["synchronous_standby_names=*", "synchronous_commit=on"]).await
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started on its
    /// own port and data. It has no synchronous standby of its own, so once
    /// promoted its commits do not wait for one.
    pub async fn standby_of(primary: &PrivatePostgres) -> Result<Self> {
        let (port, dir) = Self::empty_dir().await?;
        let mut backup = Self::command("pg_basebackup")?;
        backup.args(["-h", "127.0.0.1", "-p", &primary.port.to_string(), "-U", "postgres", "-X", "stream", "-R", "-D"]).arg(&dir);
        Self::run(backup, "pg_basebackup")?;
        // The copy holds the primary's log; the server wants its directory private.
        let _ = std::fs::remove_file(dir.join("log"));
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let pg = Self { port, dir, settings: vec!["synchronous_standby_names=".into()] };
        pg.resume()?;
        Ok(pg)
    }

    /// Waits (bounded) until a standby streams from this server as its
    /// synchronous one.
    pub async fn wait_for_synchronous_standby(&self) -> Result<()> {
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
        let found = eventually(Duration::from_secs(30), || async {
            let mut conn = PgConnection::connect(&url).await.ok()?;
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'").fetch_one(&mut conn).await.ok()?;
            (n > 0).then_some(())
        })
        .await;
        found.context("no synchronous standby streams from the primary within 30 s")
    }

    /// Promotes this standby to a primary (`pg_ctl promote`), and waits.
    pub fn promote(&self) -> Result<()> {
        let mut c = Self::command("pg_ctl")?;
        c.arg("-D").arg(&self.dir).args(["-w", "promote"]);
        Self::run(c, "pg_ctl promote")
    }

    /// (Re)starts the server on the same port and data, and waits for it.
    pub fn resume(&self) -> Result<()> {
        let mut options = format!("-p {} -c listen_addresses=127.0.0.1 -k {}", self.port, self.dir.display());
        for s in &self.settings {
            options.push_str(&format!(" -c {s:?}"));
        }
        let mut c = Self::command("pg_ctl")?;
        c.arg("-D").arg(&self.dir).args(["-w", "-l"]).arg(self.dir.join("log")).args(["-o", &options]).arg("start");
        Self::run(c, "pg_ctl start").with_context(|| {
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            format!("the server's log ends: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "))
        })
    }

    /// Stops the server at once, as a crash would (`-m immediate`: no
    /// checkpoint, clients cut off), and waits.
    pub fn crash(&self) -> Result<()> {
        let mut c = Self::command("pg_ctl")?;
        c.arg("-D").arg(&self.dir).args(["-w", "-m", "immediate", "stop"]);
        Self::run(c, "pg_ctl stop")
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn running_as_root() -> bool {
    std::process::Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false)
}

/// Three NATS servers of the test's own, routed to each other as one
/// JetStream cluster (streams replicated ×3 survive the loss of any one).
pub struct NatsCluster {
    pub nodes: Vec<PrivateNats>,
}

impl NatsCluster {
    pub async fn start() -> Result<Self> {
        let mut ports = Vec::new();
        for _ in 0..3 {
            ports.push((free_addr().await?.port(), free_addr().await?.port()));
        }
        let mut nodes = Vec::new();
        for (i, &(port, route_port)) in ports.iter().enumerate() {
            let routes = ports.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, (_, r))| format!("nats://127.0.0.1:{r}")).collect();
            let dir = std::env::temp_dir().join(format!("relay-test-nats-{}", Uuid::new_v4().simple()));
            nodes.push(PrivateNats { port, dir, child: None, cluster: Some((format!("n{}", i + 1), route_port, routes)) });
        }
        for n in &mut nodes {
            n.resume().await?;
        }
        let cluster = Self { nodes };
        // JetStream answers once the cluster has elected its meta leader.
        let js = async_nats::jetstream::new(async_nats::connect(cluster.nodes[0].url()).await?);
        // Ready when it can place a stream on all three nodes.
        let probe = format!("probe_{}", Uuid::new_v4().simple());
        let mut last = None;
        for _ in 0..200 {
            let config = async_nats::jetstream::stream::Config {
                name: probe.clone(),
                subjects: vec![format!("{probe}.>")],
                num_replicas: 3,
                ..Default::default()
            };
            match js.create_stream(config).await {
                Ok(_) => {
                    js.delete_stream(&probe).await?;
                    return Ok(cluster);
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("the NATS cluster elected no JetStream leader within 20 s: {last:?}")
    }

    /// Every node, comma-separated, as `RELAY_NATS_URL` takes them.
    pub fn url(&self) -> String {
        self.nodes.iter().map(PrivateNats::url).collect::<Vec<_>>().join(",")
    }

    /// The node that leads a stream now, by index.
    pub async fn leader_of(&self, stream: &str) -> Result<usize> {
        for n in &self.nodes {
            let Ok(client) = async_nats::connect(n.url()).await else { continue };
            let js = async_nats::jetstream::new(client);
            let Ok(mut s) = js.get_stream(stream).await else { continue };
            let info = s.info().await?;
            let leader = info.cluster.as_ref().and_then(|c| c.leader.clone()).context("a clustered stream names its leader")?;
            return self.nodes.iter().position(|n| n.server_name() == Some(leader.as_str())).context("the leader is one of the nodes");
        }
        anyhow::bail!("no node answered for stream {stream}")
    }
}

impl NatsCluster {
    /// For each node (by index), which of these streams and consumers it
    /// leads now: `(stream, None)` names a stream, `(stream, Some(durable))`
    /// a consumer. Asked of the first node that answers.
    pub async fn leadership(&self, assets: &[(String, Option<String>)]) -> Result<Vec<Vec<String>>> {
        let mut led = vec![Vec::new(); self.nodes.len()];
        for n in &self.nodes {
            let Ok(client) = async_nats::connect(n.url()).await else { continue };
            let js = async_nats::jetstream::new(client);
            for (stream, durable) in assets {
                let Ok(mut s) = js.get_stream(stream).await else { continue };
                let leader = match durable {
                    None => s.info().await?.cluster.as_ref().and_then(|c| c.leader.clone()),
                    Some(d) => {
                        let mut c: async_nats::jetstream::consumer::PullConsumer =
                            s.get_consumer(d).await.map_err(|e| anyhow::anyhow!("{e}"))?;
                        c.info().await?.cluster.as_ref().and_then(|c| c.leader.clone())
                    }
                };
                if let Some(i) = leader.and_then(|l| self.nodes.iter().position(|n| n.server_name() == Some(l.as_str()))) {
                    led[i].push(durable.clone().unwrap_or_else(|| stream.clone()));
                }
            }
            return Ok(led);
        }
        anyhow::bail!("no node of the cluster answered")
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Headless Chromium (Debian's `chromium`) driven over WebDriver by its
/// `chromedriver`, started on a free loopback port for one test.
pub struct Browser {
    pub client: fantoccini::Client,
    driver: tokio::process::Child,
    shots: PathBuf,
}

impl Browser {
    pub async fn start() -> Result<Self> {
        let driver_bin = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .context("chromedriver is not installed: deploy/local/test installs Debian's chromium and chromium-driver")?;
        let port = free_addr().await?.port();
        let driver = tokio::process::Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting chromedriver")?;
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                         "--window-size=1280,1000", "--no-first-run", "--disable-extensions"],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match fantoccini::ClientBuilder::new(connector).capabilities(caps.clone()).connect(&url).await {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "chromedriver not ready yet");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(anyhow::anyhow!("starting a Chromium session through chromedriver: {e}")),
            }
        };
        let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/portal-screenshots");
        std::fs::create_dir_all(&shots)?;
        Ok(Self { client, driver, shots })
    }

    /// Saves the page as `target/portal-screenshots/<name>.png` (a test
    /// artifact), and as `docs/portal/<name>.png` too when
    /// `RELAY_PORTAL_SCREENSHOTS=docs` (refreshing the README's pictures).
    pub async fn screenshot(&self, name: &str) -> Result<()> {
        let png = self.client.screenshot().await.map_err(|e| anyhow::anyhow!("screenshot {name}: {e}"))?;
        std::fs::write(self.shots.join(format!("{name}.png")), &png)?;
        if std::env::var("RELAY_PORTAL_SCREENSHOTS").as_deref() == Ok("docs") {
            let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/portal");
            std::fs::create_dir_all(&docs)?;
            std::fs::write(docs.join(format!("{name}.png")), &png)?;
        }
        Ok(())
    }

    pub async fn close(mut self) -> Result<()> {
        let closed = self.client.close().await.map_err(|e| anyhow::anyhow!("closing the browser: {e}"));
        let _ = self.driver.kill().await;
        closed
    }
}

/// A portal session over plain HTTP: a link minted with the tenant's key,
/// opened, its cookie and CSRF token kept and sent by hand.
pub struct PortalVisitor {
    pub base: String,
    pub http: reqwest::Client,
    pub cookie: String,
    pub csrf: String,
}

impl PortalVisitor {
    pub async fn enter(base: &str, api_key: &str) -> Result<Self> {
        let (status, body) = Rest::new(base, Some(api_key)).post("/v1/portal-sessions", serde_json::json!({})).await?;
        anyhow::ensure!(status == 201, "minting a portal link answered {status}: {body}");
        let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
        let resp = http.get(body["url"].as_str().context("a url")?).send().await?;
        anyhow::ensure!(resp.status() == 200, "opening the link answered {}", resp.status());
        let set = resp.headers().get(reqwest::header::SET_COOKIE).and_then(|v| v.to_str().ok()).unwrap_or_default();
        let cookie = set.split(';').next().and_then(|kv| kv.strip_prefix("relay_portal=")).context("a session cookie")?.to_owned();
        let mut me = Self { base: base.to_owned(), http, cookie, csrf: String::new() };
        let (status, page) = me.get("/portal/").await?;
        anyhow::ensure!(status == 200, "the portal answered {status}");
        me.csrf = page.split("name=\"csrf\" value=\"").nth(1).and_then(|r| r.split('"').next()).context("a CSRF field")?.to_owned();
        Ok(me)
    }

    pub async fn get(&self, path: &str) -> Result<(u16, String)> {
        let (status, _, body) = self.open(path).await?;
        Ok((status, body))
    }

    /// A GET without following a redirect: the status, its target and the body.
    pub async fn open(&self, path: &str) -> Result<(u16, Option<String>, String)> {
        self.send(self.http.get(format!("{}{path}", self.base))).await
    }

    /// Posts a form as given (add `("csrf", &visitor.csrf)` for a real one);
    /// the status, the redirect's target and the body.
    pub async fn post(&self, path: &str, form: &[(&str, &str)]) -> Result<(u16, Option<String>, String)> {
        self.send(self.http.post(format!("{}{path}", self.base)).form(form)).await
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(u16, Option<String>, String)> {
        let resp = req.header(reqwest::header::COOKIE, format!("relay_portal={}", self.cookie)).send().await?;
        let location = resp.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Ok((resp.status().as_u16(), location, resp.text().await?))
    }
}
