//! The api's configuration: read from `RELAY_*` variables, validated once at
//! start-up, so a bad value stops the process with a message naming it.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use relay_netguard::Policy;

use relay_domain::{health::CircuitPolicy, schedule::RetrySchedule};

use crate::{app::HealthSettings, secrets::Keyring};

pub use relay_config::Deployment;
use relay_config::{Env, timing};

/// PEM files for the internal mTLS port.
#[derive(Debug, Clone)]
pub struct InternalTls {
    /// The CA whose client certificates are accepted (dispatcher, operators).
    pub client_ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub deployment: Deployment,
    pub storage: StorageSettings,
    pub broker: BrokerSettings,
    pub internal_tls: InternalTls,
    pub keyring: Keyring,
    pub delivery: DeliverySettings,
    pub health: HealthSettings,
    pub retention: RetentionSettings,
    /// The REST port as customers reach it: portal links are built on it
    /// (`RELAY_PUBLIC_URL`; https in production).
    pub public_url: String,
    /// How long a tenant's call may take before it is answered 503 /
    /// UNAVAILABLE (see `detach::TENANT_WORK_DEADLINE`).
    pub tenant_work_deadline: Duration,
}

/// Postgres: where, how many connections, and whether this api migrates.
#[derive(Debug, Clone)]
pub struct StorageSettings {
    pub database_url: String,
    /// Postgres connections this api may hold (`RELAY_DB_POOL_SIZE`).
    pub pool_size: u32,
    /// How long a call waits for a free connection before it is answered
    /// UNAVAILABLE (503 with `Retry-After`).
    pub acquire_timeout: Duration,
    pub run_migrations: bool,
}

/// NATS JetStream: where, how many copies of each stream, the names' prefix.
#[derive(Debug, Clone)]
pub struct BrokerSettings {
    pub nats_url: String,
    /// Copies of each stream on the NATS cluster (`RELAY_STREAM_REPLICAS`).
    pub stream_replicas: usize,
    /// Production may run fewer than 3 (`RELAY_ALLOW_FEWER_STREAM_REPLICAS`).
    pub allow_fewer_stream_replicas: bool,
    /// Prepended to stream, subject and durable names, so tests and stacks that
    /// share one NATS never see each other's messages. Empty in production.
    pub stream_prefix: String,
    /// Events in the EVENTS stream not yet taken for expansion, at most.
    pub events_backlog: u64,
}

/// How deliveries are scheduled and handed out, and which endpoint URLs
/// are accepted.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    pub schedule: RetrySchedule,
    /// How long an attempt handed to the broker is leased before the relay may
    /// hand it out again. Must exceed the dispatcher's whole redelivery window.
    pub lease: Duration,
    /// Run the outbox and delivery relays in this process (`RELAY_RUN_RELAYS`,
    /// default true); an api can also serve requests only.
    pub run_relays: bool,
    /// How long a relay sleeps when nothing wakes it.
    pub relay_idle: Duration,
    pub relay_batch: i64,
    /// Attempts one endpoint may have handed out and unreported at once.
    pub endpoint_in_flight_cap: i64,
    /// Events expanded at publish at once, at most; 0: every event takes
    /// the outbox relay (`RELAY_EXPAND_AT_PUBLISH`, see `app::at_publish`).
    pub expand_at_publish: usize,
    pub url_policy: Policy,
    /// How endpoint host names are resolved for the URL rules.
    pub resolver: std::sync::Arc<dyn relay_netguard::Resolve>,
}

/// How long what is kept is kept, and how often the rest is deleted.
#[derive(Debug, Clone)]
pub struct RetentionSettings {
    pub dead_letters: Duration,
    /// How often dead letters and events past their retention are deleted.
    pub prune_every: Duration,
    /// How long an event, its deliveries and its attempt log are kept once
    /// every delivery has ended (`RELAY_RETENTION_DAYS`).
    pub events: Duration,
    /// How long a listener's endpoint (relay-dev listen) outlives its call
    /// (`RELAY_LISTEN_GRACE_SECS`): a listener back within it is refused
    /// until then only if the old call is still alive.
    pub listener_grace: Duration,
}

/// Addresses for `main`; tests pass their own listeners to `run`.
#[derive(Debug, Clone)]
pub struct ListenAddrs {
    pub grpc: SocketAddr,
    pub rest: SocketAddr,
    pub internal: SocketAddr,
}

/// The operator's metrics port: `RELAY_METRICS_ADDR` (`off` disables it).
pub fn metrics_addr_from_env() -> Result<Option<SocketAddr>> {
    Env.addr_or_off("RELAY_METRICS_ADDR")
}

impl ApiConfig {
    pub fn from_env() -> Result<Self> {
        let env = Env;
        env.check_files()?;
        let deployment = Deployment::from_env()?;
        let url_policy = Policy::from_dev_settings(
            env.string("RELAY_DEV_ALLOW_HTTP_ENDPOINTS").as_deref(),
            env.string("RELAY_DEV_ALLOWED_ENDPOINT_RANGES").as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        let keyring = match env.string("RELAY_SECRET_KEYS") {
            Some(spec) => Keyring::parse(&spec).context("RELAY_SECRET_KEYS")?,
            None if deployment.is_production() => {
                bail!("RELAY_SECRET_KEYS is required in production: webhook signing secrets cannot be stored without it")
            }
            None => Keyring::development(),
        };
        let schedule = match env.string("RELAY_RETRY_TIERS") {
            Some(spec) => RetrySchedule::parse(&spec).context("RELAY_RETRY_TIERS")?,
            None => RetrySchedule::production(),
        };
        let attempt_timeout = env.millis("RELAY_ATTEMPT_TIMEOUT_MS", 100..=120_000)?;
        let seam_timeout = env.millis("RELAY_SEAM_TIMEOUT_MS", 100..=60_000)?;
        let (first_probe, max_probe) = probe_backoff(&env.string_or_default("RELAY_PROBE_BACKOFF_MS"))?;
        let window = env.millis("RELAY_CIRCUIT_WINDOW_MS", 100..=3_600_000)?;
        let quiet = env.millis("RELAY_CIRCUIT_QUIET_MS", 100..=3_600_000)?;
        if quiet > window {
            bail!(
                "RELAY_CIRCUIT_QUIET_MS ({} ms) must not be longer than RELAY_CIRCUIT_WINDOW_MS ({} ms)",
                quiet.as_millis(),
                window.as_millis()
            );
        }
        let health = HealthSettings {
            circuit: CircuitPolicy {
                enabled: !env.flag("RELAY_DEV_CIRCUIT_OFF")?,
                window,
                min_attempts: env.number("RELAY_CIRCUIT_MIN_ATTEMPTS", 1..=100_000)?,
                failure_permille: env.number::<u32>("RELAY_CIRCUIT_FAILURE_PERCENT", 50..=100)? * 10,
                quiet,
                min_failed_retries: env.number("RELAY_CIRCUIT_MIN_FAILED_RETRIES", 0..=1000)?,
                first_probe,
                max_probe,
                // A probe's result comes within an attempt and a report; twice
                // that, and the probe is taken to be lost.
                probe_guard: (attempt_timeout + seam_timeout) * 2,
            },
            recover_per_second: env.number("RELAY_RECOVER_PER_SECOND", 1..=10_000)?,
            shortest_disable_window: if deployment.is_production() { Duration::from_secs(3600) } else { Duration::from_secs(1) },
        };
        let cfg = Self {
            health,
            deployment,
            storage: StorageSettings {
                database_url: env.string_or_default("DATABASE_URL"),
                pool_size: env.number("RELAY_DB_POOL_SIZE", 2..=1000)?,
                acquire_timeout: Duration::from_secs(5),
                run_migrations: !env.flag("RELAY_SKIP_MIGRATIONS")?,
            },
            broker: BrokerSettings {
                nats_url: env.string_or_default("RELAY_NATS_URL"),
                stream_replicas: env.number("RELAY_STREAM_REPLICAS", 1..=5)?,
                allow_fewer_stream_replicas: env.flag("RELAY_ALLOW_FEWER_STREAM_REPLICAS")?,
                stream_prefix: env.string_or_default("RELAY_STREAM_PREFIX"),
                events_backlog: env.number("RELAY_EVENTS_BACKLOG", 1..=1_000_000)?,
            },
            internal_tls: InternalTls {
                client_ca: env.path("RELAY_TLS_CLIENT_CA")?,
                cert: env.path("RELAY_TLS_CERT")?,
                key: env.path("RELAY_TLS_KEY")?,
            },
            keyring,
            delivery: DeliverySettings {
                schedule,
                lease: env.secs("RELAY_DELIVERY_LEASE_SECS", 5..=3600)?,
                run_relays: env.flag("RELAY_RUN_RELAYS")?,
                // A backstop only: commits in this process wake its relays, other
                // processes' due deliveries arrive by NOTIFY; this bounds how late
                // the work of a process that died between commit and publish is seen.
                relay_idle: Duration::from_secs(2),
                relay_batch: env.number("RELAY_RELAY_BATCH", 1..=10_000)?,
                // Little's law: an endpoint's throughput is at most its cap over
                // the claim-to-outcome round trip (tens of ms under load); 20
                // held W1 to ~300 deliveries/s per endpoint, hence 64.
                endpoint_in_flight_cap: env.number("RELAY_ENDPOINT_IN_FLIGHT_CAP", 1..=10_000)?,
                expand_at_publish: env.number("RELAY_EXPAND_AT_PUBLISH", 0..=4096)?,
                url_policy,
                resolver: std::sync::Arc::new(relay_netguard::SystemResolver),
            },
            retention: RetentionSettings {
                dead_letters: Duration::from_secs(7 * 24 * 3600),
                prune_every: Duration::from_secs(600),
                events: Duration::from_secs(env.number::<u64>("RELAY_RETENTION_DAYS", 8..=3650)? * 24 * 3600),
                listener_grace: Duration::from_secs(env.number::<u64>("RELAY_LISTEN_GRACE_SECS", 1..=3600)?),
            },
            tenant_work_deadline: crate::detach::TENANT_WORK_DEADLINE,
            public_url: match env.string("RELAY_PUBLIC_URL") {
                Some(url) => url,
                None => format!("http://{}", env.addr("RELAY_REST_ADDR")?),
            },
        };
        cfg.validate()?;
        // The dispatcher's timeouts, read here too, so the lease rule that
        // ties the two services together is checked where the lease is set.
        timing::check_lease(cfg.delivery.lease, attempt_timeout, seam_timeout)?;
        Ok(cfg)
    }

    /// The rules no deployment may break, and the dev allowances production
    /// may not carry.
    pub fn validate(&self) -> Result<()> {
        if self.deployment == Deployment::Production {
            if !self.delivery.url_policy.is_strict() {
                bail!(relay_netguard::DEV_ALLOWANCES_IN_PRODUCTION);
            }
            if self.keyring.is_development() {
                bail!("RELAY_SECRET_KEYS is required in production; the development key is public");
            }
            let c = &self.health.circuit;
            if self.health.shortest_disable_window < Duration::from_secs(3600) {
                bail!("a disable window under an hour is for tests; production refuses it");
            }
            if (c.first_probe, c.max_probe) != CircuitPolicy::PRODUCTION_PROBES {
                bail!("RELAY_PROBE_BACKOFF_MS shortens probing for tests; production probes from 10 seconds, backing off to 10 minutes");
            }
            if !c.enabled {
                bail!("RELAY_DEV_CIRCUIT_OFF is for comparing runs in development; production keeps the circuit");
            }
            if c.window < Duration::from_secs(10) || c.quiet < Duration::from_secs(5) {
                bail!("a circuit window under 10 s or a quiet period under 5 s is for tests; production refuses it");
            }
            if self.delivery.schedule != RetrySchedule::production() {
                bail!("RELAY_RETRY_TIERS shortens the retry schedule for tests; production runs the published schedule");
            }
            if !self.public_url.starts_with("https://") {
                bail!(
                    "RELAY_PUBLIC_URL must be the https:// address customers reach the REST port at (portal links are built on it), got {:?}",
                    self.public_url
                );
            }
            if self.broker.stream_replicas < 3 && !self.broker.allow_fewer_stream_replicas {
                bail!(
                    "RELAY_STREAM_REPLICAS is {}; production keeps each stream on 3 NATS nodes, so one node's loss loses \
                     nothing (RELAY_ALLOW_FEWER_STREAM_REPLICAS=true runs fewer, knowingly)",
                    self.broker.stream_replicas
                );
            }
        }
        relay_config::nats_servers(&self.broker.nats_url)?;
        url::Url::parse(&self.public_url)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some() && u.query().is_none())
            .with_context(|| format!("RELAY_PUBLIC_URL must be an http(s) URL with a host and no query, got {:?}", self.public_url))?;
        if self.retention.events <= self.retention.dead_letters {
            bail!(
                "the retention ({} days) must outlast a dead letter's {} days: an event stays while its dead letter can be replayed",
                self.retention.events.as_secs() / 86_400,
                self.retention.dead_letters.as_secs() / 86_400
            );
        }
        if self.delivery.endpoint_in_flight_cap < 1 {
            bail!("RELAY_ENDPOINT_IN_FLIGHT_CAP must be at least 1, got {}", self.delivery.endpoint_in_flight_cap);
        }
        if !(2..=1000).contains(&self.storage.pool_size) {
            bail!("RELAY_DB_POOL_SIZE must be between 2 and 1000, got {}", self.storage.pool_size);
        }
        if self.delivery.lease < Duration::from_secs(5) {
            bail!("RELAY_DELIVERY_LEASE_SECS must be at least 5, got {}", self.delivery.lease.as_secs());
        }
        Ok(())
    }

    pub fn listen_addrs_from_env() -> Result<ListenAddrs> {
        Ok(ListenAddrs {
            grpc: Env.addr("RELAY_GRPC_ADDR")?,
            rest: Env.addr("RELAY_REST_ADDR")?,
            internal: Env.addr("RELAY_INTERNAL_ADDR")?,
        })
    }
}

/// `first,max` in milliseconds, the first no longer than the max.
fn probe_backoff(spec: &str) -> Result<(Duration, Duration)> {
    let parsed: Option<(u64, u64)> = spec.split_once(',').and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)));
    match parsed {
        Some((first, max)) if (1..=86_400_000).contains(&first) && (first..=86_400_000).contains(&max) => {
            Ok((Duration::from_millis(first), Duration::from_millis(max)))
        }
        _ => bail!("RELAY_PROBE_BACKOFF_MS must be `first,max` in ms (1 ≤ first ≤ max ≤ 86400000), got {spec:?}"),
    }
}
