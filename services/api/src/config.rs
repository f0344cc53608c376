//! The api's configuration: read from `RELAY_*` variables, validated once at
//! start-up, so a bad value stops the process with a message naming it.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use relay_netguard::Policy;

use crate::{schedule::RetrySchedule, secrets::Keyring};

/// Where this process runs. Production turns every dev allowance into a
/// start-up error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deployment {
    Development,
    Production,
}

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
    pub database_url: String,
    pub nats_url: String,
    /// Prepended to stream, subject and durable names, so tests and stacks that
    /// share one NATS never see each other's messages. Empty in production.
    pub stream_prefix: String,
    pub internal_tls: InternalTls,
    pub keyring: Keyring,
    pub url_policy: Policy,
    /// How endpoint host names are resolved for the URL rules.
    pub resolver: std::sync::Arc<dyn relay_netguard::Resolve>,
    pub schedule: RetrySchedule,
    /// How long an attempt handed to the broker is leased before the relay may
    /// hand it out again. Must exceed the dispatcher's whole redelivery window.
    pub delivery_lease: Duration,
    /// How long a relay sleeps when nothing wakes it.
    pub relay_idle: Duration,
    pub relay_batch: i64,
    /// Postgres connections this api may hold (`RELAY_DB_POOL_SIZE`).
    pub pool_size: u32,
    /// How long a call waits for a free connection before it is answered
    /// UNAVAILABLE (503 with `Retry-After`).
    pub db_acquire_timeout: Duration,
    /// Attempts one endpoint may have handed out and unreported at once.
    pub endpoint_in_flight_cap: i64,
    pub run_migrations: bool,
    /// Run the outbox and delivery relays in this process (`RELAY_RUN_RELAYS`,
    /// default true); an api can also serve requests only.
    pub run_relays: bool,
    pub dead_letter_retention: Duration,
    /// How often dead letters past their retention are deleted.
    pub dead_letter_prune_every: Duration,
}

/// Addresses for `main`; tests pass their own listeners to `run`.
#[derive(Debug, Clone)]
pub struct ListenAddrs {
    pub grpc: SocketAddr,
    pub rest: SocketAddr,
    pub internal: SocketAddr,
}

/// The operator's metrics port: `RELAY_METRICS_ADDR` (default
/// 127.0.0.1:9464; `off` disables it).
pub fn metrics_addr_from_env() -> Result<Option<SocketAddr>> {
    match var("RELAY_METRICS_ADDR").as_deref() {
        Some("off") => Ok(None),
        Some(v) => Ok(Some(v.parse().with_context(|| format!("RELAY_METRICS_ADDR must be host:port or off, got {v:?}"))?)),
        None => Ok(Some("127.0.0.1:9464".parse().expect("valid"))),
    }
}

pub const DEFAULT_ENDPOINT_QUOTA: i32 = 5;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A true/false setting, `default` when unset.
fn flag(name: &str, default: bool) -> Result<bool> {
    match var(name).as_deref() {
        None => Ok(default),
        Some("0" | "false" | "off" | "no") => Ok(false),
        Some("1" | "true" | "on" | "yes") => Ok(true),
        Some(other) => bail!("{name} must be true or false, got {other:?}"),
    }
}

fn required_path(name: &str) -> Result<PathBuf> {
    var(name).map(PathBuf::from).with_context(|| format!("{name} is required: the path of a PEM file for the internal mTLS port"))
}

impl ApiConfig {
    pub fn from_env() -> Result<Self> {
        let deployment = match var("RELAY_ENV").as_deref() {
            None | Some("development" | "dev" | "test") => Deployment::Development,
            Some("production" | "prod") => Deployment::Production,
            Some(other) => bail!("RELAY_ENV must be development or production, got {other:?}"),
        };
        let url_policy = Policy::from_dev_settings(
            var("RELAY_DEV_ALLOW_HTTP_ENDPOINTS").as_deref(),
            var("RELAY_DEV_ALLOWED_ENDPOINT_RANGES").as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        let keyring = match var("RELAY_SECRET_KEYS") {
            Some(spec) => Keyring::parse(&spec).context("RELAY_SECRET_KEYS")?,
            None if deployment == Deployment::Production => {
                bail!("RELAY_SECRET_KEYS is required in production: webhook signing secrets cannot be stored without it")
            }
            None => Keyring::development(),
        };
        let schedule = match var("RELAY_RETRY_TIERS") {
            Some(spec) => RetrySchedule::parse(&spec).context("RELAY_RETRY_TIERS")?,
            None => RetrySchedule::production(),
        };
        let cfg = Self {
            deployment,
            database_url: var("DATABASE_URL").unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/relay".into()),
            nats_url: var("RELAY_NATS_URL").unwrap_or_else(|| "nats://127.0.0.1:4222".into()),
            stream_prefix: var("RELAY_STREAM_PREFIX").unwrap_or_default(),
            internal_tls: InternalTls {
                client_ca: required_path("RELAY_TLS_CLIENT_CA")?,
                cert: required_path("RELAY_TLS_CERT")?,
                key: required_path("RELAY_TLS_KEY")?,
            },
            keyring,
            url_policy,
            resolver: std::sync::Arc::new(relay_netguard::SystemResolver),
            schedule,
            delivery_lease: Duration::from_secs(var("RELAY_DELIVERY_LEASE_SECS").map(|v| v.parse()).transpose()?.unwrap_or(300)),
            relay_idle: Duration::from_millis(500),
            relay_batch: 500,
            db_acquire_timeout: Duration::from_secs(5),
            pool_size: var("RELAY_DB_POOL_SIZE").map(|v| v.parse()).transpose().context("RELAY_DB_POOL_SIZE")?.unwrap_or(20),
            endpoint_in_flight_cap: var("RELAY_ENDPOINT_IN_FLIGHT_CAP")
                .map(|v| v.parse())
                .transpose()
                .context("RELAY_ENDPOINT_IN_FLIGHT_CAP")?
                // Little's law: an endpoint's throughput is at most its cap
                // over the claim-to-outcome round trip (tens of ms under
                // load); 20 held W1 to ~300 deliveries/s per endpoint.
                .unwrap_or(64),
            run_migrations: !flag("RELAY_SKIP_MIGRATIONS", false)?,
            run_relays: flag("RELAY_RUN_RELAYS", true)?,
            dead_letter_retention: Duration::from_secs(7 * 24 * 3600),
            dead_letter_prune_every: Duration::from_secs(600),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The rules no deployment may break, and the dev allowances production
    /// may not carry.
    pub fn validate(&self) -> Result<()> {
        if self.deployment == Deployment::Production {
            if !self.url_policy.is_strict() {
                bail!(relay_netguard::DEV_ALLOWANCES_IN_PRODUCTION);
            }
            if self.keyring.is_development() {
                bail!("RELAY_SECRET_KEYS is required in production; the development key is public");
            }
            if self.schedule != RetrySchedule::production() {
                bail!("RELAY_RETRY_TIERS shortens the retry schedule for tests; production runs the published schedule");
            }
        }
        if self.endpoint_in_flight_cap < 1 {
            bail!("RELAY_ENDPOINT_IN_FLIGHT_CAP must be at least 1, got {}", self.endpoint_in_flight_cap);
        }
        if !(2..=1000).contains(&self.pool_size) {
            bail!("RELAY_DB_POOL_SIZE must be between 2 and 1000, got {}", self.pool_size);
        }
        if self.delivery_lease < Duration::from_secs(5) {
            bail!("RELAY_DELIVERY_LEASE_SECS must be at least 5, got {}", self.delivery_lease.as_secs());
        }
        Ok(())
    }

    pub fn listen_addrs_from_env() -> Result<ListenAddrs> {
        let addr = |name: &str, default: &str| -> Result<SocketAddr> {
            let v = var(name).unwrap_or_else(|| default.into());
            v.parse().with_context(|| format!("{name} must be host:port, got {v:?}"))
        };
        Ok(ListenAddrs {
            grpc: addr("RELAY_GRPC_ADDR", "127.0.0.1:50051")?,
            rest: addr("RELAY_REST_ADDR", "127.0.0.1:8080")?,
            internal: addr("RELAY_INTERNAL_ADDR", "127.0.0.1:50052")?,
        })
    }
}
