//! The dispatcher's configuration, validated at start-up.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use relay_netguard::Policy;

#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    pub production: bool,
    pub nats_url: String,
    pub stream_prefix: String,
    /// The api's internal mTLS port, e.g. `https://127.0.0.1:50052`.
    pub api_url: String,
    /// The name the api's server certificate is checked against.
    pub api_tls_name: String,
    pub tls_ca: PathBuf,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    /// A customer's attempt: connect, send, and receive the status, all within this.
    pub attempt_timeout: Duration,
    /// Attempts in flight across all endpoints. Each endpoint has at most one.
    pub max_in_flight: usize,
    /// Expansions in flight.
    pub max_expanding: usize,
    pub url_policy: Policy,
}

/// Budget for the seam calls around one attempt (material before, outcome
/// after), added to the attempt timeout to size the broker's ack wait.
pub const SEAM_BUDGET: Duration = Duration::from_secs(15);

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn path(name: &str) -> Result<PathBuf> {
    var(name).map(PathBuf::from).with_context(|| format!("{name} is required: a PEM file for the dispatcher's mTLS identity"))
}

impl DispatcherConfig {
    pub fn from_env() -> Result<Self> {
        let flag = |n: &str| matches!(var(n).as_deref(), Some("1" | "true" | "on" | "yes"));
        let cfg = Self {
            production: matches!(var("RELAY_ENV").as_deref(), Some("production" | "prod")),
            nats_url: var("RELAY_NATS_URL").unwrap_or_else(|| "nats://127.0.0.1:4222".into()),
            stream_prefix: var("RELAY_STREAM_PREFIX").unwrap_or_default(),
            api_url: var("RELAY_API_INTERNAL_URL").unwrap_or_else(|| "https://127.0.0.1:50052".into()),
            api_tls_name: var("RELAY_API_TLS_NAME").unwrap_or_else(|| "relay-api".into()),
            tls_ca: path("RELAY_TLS_CA")?,
            tls_cert: path("RELAY_TLS_CERT")?,
            tls_key: path("RELAY_TLS_KEY")?,
            attempt_timeout: Duration::from_millis(
                var("RELAY_ATTEMPT_TIMEOUT_MS").map(|v| v.parse()).transpose().context("RELAY_ATTEMPT_TIMEOUT_MS")?.unwrap_or(15_000),
            ),
            max_in_flight: var("RELAY_MAX_IN_FLIGHT").map(|v| v.parse()).transpose().context("RELAY_MAX_IN_FLIGHT")?.unwrap_or(512),
            max_expanding: 32,
            url_policy: Policy {
                allow_http: flag("RELAY_DEV_ALLOW_HTTP_ENDPOINTS"),
                allowed_ranges: var("RELAY_DEV_ALLOWED_ENDPOINT_RANGES")
                    .map(|v| {
                        v.split(',')
                            .map(|r| r.trim().parse().with_context(|| format!("{r:?} is not a CIDR range")))
                            .collect::<Result<Vec<_>>>()
                    })
                    .transpose()?
                    .unwrap_or_default(),
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        if self.attempt_timeout < Duration::from_millis(100) || self.attempt_timeout > Duration::from_secs(120) {
            bail!("RELAY_ATTEMPT_TIMEOUT_MS must be between 100 and 120000, got {}", self.attempt_timeout.as_millis());
        }
        if self.max_in_flight == 0 {
            bail!("RELAY_MAX_IN_FLIGHT must be at least 1");
        }
        if self.production && !self.url_policy.is_strict() {
            bail!(
                "RELAY_DEV_ALLOW_HTTP_ENDPOINTS / RELAY_DEV_ALLOWED_ENDPOINT_RANGES are development allowances; refusing to start with them in production"
            );
        }
        Ok(())
    }

    /// How long the broker waits for an ack before handing a delivery job to
    /// another dispatcher: always longer than an attempt plus its seam calls,
    /// so a slow customer never makes the broker think we died.
    pub fn deliveries_ack_wait(&self) -> Duration {
        self.attempt_timeout + SEAM_BUDGET
    }
}
