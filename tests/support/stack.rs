//! The whole system for one test: a fresh database, its own stream names,
//! the api and dispatcher in-process on port 0 (or as processes), and the
//! state machine's invariants checked when it stops.

use super::*;

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

/// `RELAY_TEST_LOG=debug` (any tracing filter) shows the services' logs.
pub(crate) fn init_logs() {
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

pub(crate) async fn listeners(addrs: &relay_api::config::ListenAddrs) -> Result<Listeners> {
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
            storage: relay_api::config::StorageSettings {
                database_url: match opts.standby_pg_port {
                    Some(standby) => {
                        db.url.replace(&format!("127.0.0.1:{}/", db.port), &format!("127.0.0.1:{},127.0.0.1:{standby}/", db.port))
                    }
                    None => db.url.clone(),
                },
                pool_size: opts.db_pool_size,
                acquire_timeout: opts.db_acquire_timeout,
                run_migrations: true,
            },
            broker: relay_api::config::BrokerSettings {
                nats_url: opts.nats_url.clone(),
                stream_replicas: opts.stream_replicas,
                allow_fewer_stream_replicas: false,
                stream_prefix: prefix.clone(),
                events_backlog: opts.events_backlog,
            },
            internal_tls: relay_api::config::InternalTls {
                client_ca: certs.join("ca.pem"),
                cert: certs.join("api.pem"),
                key: certs.join("api-key.pem"),
            },
            keyring: match &opts.secret_keys {
                Some(spec) => Keyring::parse(spec)?,
                None => Keyring::development(),
            },
            delivery: relay_api::config::DeliverySettings {
                schedule: opts.retry_tiers.clone(),
                lease: Duration::from_secs(60),
                run_relays: true,
                relay_idle: opts.relay_idle,
                relay_batch: 200,
                endpoint_in_flight_cap: opts.endpoint_cap,
                expand_at_publish: opts.expand_at_publish,
                url_policy: opts.url_policy(),
                resolver: opts.api_resolver.clone().unwrap_or_else(|| std::sync::Arc::new(relay_netguard::SystemResolver)),
            },
            health: relay_api::app::HealthSettings {
                circuit: CircuitPolicy { probe_guard: (opts.attempt_timeout + opts.seam_timeout) * 2, ..opts.circuit },
                recover_per_second: opts.recover_per_second,
                shortest_disable_window: Duration::from_secs(1),
            },
            retention: relay_api::config::RetentionSettings {
                dead_letters: Duration::from_secs(7 * 24 * 3600),
                prune_every: Duration::from_millis(200),
                events: Duration::from_secs(30 * 24 * 3600),
                // Short, so a test sees a listener's endpoint go.
                listener_grace: Duration::from_secs(2),
            },
            tenant_work_deadline: opts.tenant_work_deadline,
            public_url: format!("http://{}", addrs.rest),
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

    /// A series on the api's metrics port (a labelled one by its full
    /// name, `name{label="value"}`); `None` until it exists.
    pub async fn metric(&self, series: &str) -> Result<Option<f64>> {
        let text = reqwest::get(&self.metrics_url).await?.text().await?;
        let prefix = format!("{series} ");
        Ok(text.lines().find_map(|l| l.strip_prefix(prefix.as_str())).and_then(|v| v.trim().parse().ok()))
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
            expanding_per_environment: 16,
            seam_timeout: self.opts.seam_timeout,
            url_policy: self.opts.url_policy(),
            resolver: self.opts.dispatcher_resolver.clone().unwrap_or_else(|| std::sync::Arc::new(relay_netguard::SystemResolver)),
            egress_proxy: self.opts.egress_proxy.clone(),
            source_address: None,
            // Every test dispatcher trusts the shared test CA, so any
            // receiver may answer over HTTPS (`Receiver::start_https`).
            receiver_ca: Some(crate::shared_ca_file().clone()),
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
            ("RELAY_RECEIVER_CA_FILE", crate::shared_ca_file().display().to_string()),
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
        let tiers: Vec<String> = (1..=c.delivery.schedule.max_attempts())
            .map(|a| c.delivery.schedule.delay_before(a).expect("in range").as_millis().to_string())
            .collect();
        vec![
            ("DATABASE_URL", c.storage.database_url.clone()),
            ("RELAY_NATS_URL", c.broker.nats_url.clone()),
            ("RELAY_STREAM_REPLICAS", c.broker.stream_replicas.to_string()),
            ("RELAY_STREAM_PREFIX", c.broker.stream_prefix.clone()),
            ("RELAY_TLS_CLIENT_CA", c.internal_tls.client_ca.display().to_string()),
            ("RELAY_TLS_CERT", c.internal_tls.cert.display().to_string()),
            ("RELAY_TLS_KEY", c.internal_tls.key.display().to_string()),
            ("RELAY_GRPC_ADDR", self.addrs.grpc.to_string()),
            ("RELAY_REST_ADDR", self.addrs.rest.to_string()),
            ("RELAY_INTERNAL_ADDR", self.addrs.internal.to_string()),
            ("RELAY_METRICS_ADDR", "off".into()),
            ("RELAY_RETRY_TIERS", tiers.join(",")),
            ("RELAY_ENDPOINT_IN_FLIGHT_CAP", c.delivery.endpoint_in_flight_cap.to_string()),
            ("RELAY_EXPAND_AT_PUBLISH", c.delivery.expand_at_publish.to_string()),
            ("RELAY_CIRCUIT_MIN_ATTEMPTS", c.health.circuit.min_attempts.to_string()),
            ("RELAY_CIRCUIT_FAILURE_PERCENT", (c.health.circuit.failure_permille / 10).to_string()),
            ("RELAY_CIRCUIT_WINDOW_MS", c.health.circuit.window.as_millis().to_string()),
            ("RELAY_CIRCUIT_QUIET_MS", c.health.circuit.quiet.as_millis().to_string()),
            ("RELAY_CIRCUIT_MIN_FAILED_RETRIES", c.health.circuit.min_failed_retries.to_string()),
            ("RELAY_DEV_CIRCUIT_OFF", (!c.health.circuit.enabled).to_string()),
            ("RELAY_PROBE_BACKOFF_MS", format!("{},{}", c.health.circuit.first_probe.as_millis(), c.health.circuit.max_probe.as_millis())),
            ("RELAY_RECOVER_PER_SECOND", c.health.recover_per_second.to_string()),
            ("RELAY_DELIVERY_LEASE_SECS", c.delivery.lease.as_secs().to_string()),
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
    (
        "a lane of an ordered endpoint with two heads (two deliveries of one key pending or held at once)",
        "SELECT min(id::text)::uuid FROM webhook_deliveries WHERE ordering_key IS NOT NULL AND state IN ('pending', 'held')
         GROUP BY endpoint_id, ordering_key HAVING count(*) > 1",
    ),
    (
        "a lane marked idle that has a head (an expansion could give it a second)",
        "SELECT d.id FROM ordering_lanes g JOIN webhook_deliveries d ON d.endpoint_id = g.endpoint_id AND d.ordering_key = g.ordering_key
         WHERE g.idle AND d.state IN ('pending', 'held')",
    ),
    (
        "a lane's position given twice",
        "SELECT min(id::text)::uuid FROM webhook_deliveries WHERE ordering_position IS NOT NULL
         GROUP BY endpoint_id, ordering_key, ordering_position HAVING count(*) > 1",
    ),
];

pub(crate) async fn delete_streams(nats_url: &str, prefix: &str) -> Result<()> {
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
