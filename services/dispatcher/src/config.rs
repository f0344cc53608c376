//! The dispatcher's configuration, validated at start-up.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use relay_config::{Deployment, Env, timing};
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
    /// Expansions in flight of any one environment (see `turns`).
    pub expanding_per_environment: usize,
    /// Deadline of one call to the api's seam.
    pub seam_timeout: Duration,
    pub url_policy: Policy,
    /// How endpoint host names are resolved; every answer is checked.
    pub resolver: std::sync::Arc<dyn relay_netguard::Resolve>,
    /// An outbound HTTP proxy for webhooks (`RELAY_EGRESS_PROXY`). The URL
    /// rules still apply: the target is resolved and checked here first.
    pub egress_proxy: Option<String>,
    /// Development only (`RELAY_DEV_SOURCE_ADDRESS`): the local address
    /// webhooks leave from, so a test's receiver can tell which dispatcher
    /// sent a request.
    pub source_address: Option<std::net::IpAddr>,
    /// CAs trusted for receivers besides the platform's roots
    /// (`RELAY_RECEIVER_CA_FILE`, PEM); an endpoint's `ca_bundle` pins instead.
    pub receiver_ca: Option<PathBuf>,
}

impl DispatcherConfig {
    pub fn from_env() -> Result<Self> {
        let env = Env;
        env.check_files()?;
        let cfg = Self {
            production: Deployment::from_env()?.is_production(),
            nats_url: env.string_or_default("RELAY_NATS_URL"),
            stream_prefix: env.string_or_default("RELAY_STREAM_PREFIX"),
            api_url: env.string_or_default("RELAY_API_INTERNAL_URL"),
            api_tls_name: env.string_or_default("RELAY_API_TLS_NAME"),
            tls_ca: env.path("RELAY_TLS_CA")?,
            tls_cert: env.path("RELAY_TLS_CERT")?,
            tls_key: env.path("RELAY_TLS_KEY")?,
            attempt_timeout: env.millis("RELAY_ATTEMPT_TIMEOUT_MS", 100..=120_000)?,
            max_in_flight: env.number("RELAY_MAX_IN_FLIGHT", 1..=100_000)?,
            max_expanding: env.number("RELAY_MAX_EXPANDING", 1..=10_000)?,
            expanding_per_environment: env.number("RELAY_EXPANDING_PER_ENVIRONMENT", 1..=10_000)?,
            seam_timeout: env.millis("RELAY_SEAM_TIMEOUT_MS", 100..=60_000)?,
            url_policy: Policy::from_dev_settings(
                env.string("RELAY_DEV_ALLOW_HTTP_ENDPOINTS").as_deref(),
                env.string("RELAY_DEV_ALLOWED_ENDPOINT_RANGES").as_deref(),
            )
            .map_err(anyhow::Error::msg)?,
            resolver: std::sync::Arc::new(relay_netguard::SystemResolver),
            egress_proxy: env.string("RELAY_EGRESS_PROXY"),
            source_address: env
                .string("RELAY_DEV_SOURCE_ADDRESS")
                .map(|a| a.parse().with_context(|| format!("RELAY_DEV_SOURCE_ADDRESS is not an IP address: {a:?}")))
                .transpose()?,
            receiver_ca: env.string("RELAY_RECEIVER_CA_FILE").map(PathBuf::from),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        if self.attempt_timeout < Duration::from_millis(100) || self.attempt_timeout > Duration::from_secs(120) {
            bail!("RELAY_ATTEMPT_TIMEOUT_MS must be between 100 and 120000, got {}", self.attempt_timeout.as_millis());
        }
        if self.seam_timeout < Duration::from_millis(100) {
            bail!("RELAY_SEAM_TIMEOUT_MS must be at least 100, got {}", self.seam_timeout.as_millis());
        }
        if self.deliveries_ack_wait() <= self.attempt_timeout {
            bail!("the deliveries ack wait must be longer than the attempt timeout");
        }
        if self.max_in_flight == 0 {
            bail!("RELAY_MAX_IN_FLIGHT must be at least 1");
        }
        if self.production && self.source_address.is_some() {
            bail!("RELAY_DEV_SOURCE_ADDRESS is for telling test dispatchers apart; production sends from the host's own address");
        }
        if self.production && !self.url_policy.is_strict() {
            bail!(relay_netguard::DEV_ALLOWANCES_IN_PRODUCTION);
        }
        Ok(())
    }

    /// How long the broker waits for an ack before handing a delivery job to
    /// another dispatcher: derived, always longer than an attempt plus a seam
    /// call, so a slow customer never makes the broker think we died. (Jobs
    /// queued behind a slow endpoint send in-progress acks meanwhile.)
    pub fn deliveries_ack_wait(&self) -> Duration {
        timing::deliveries_ack_wait(self.attempt_timeout, self.seam_timeout)
    }

    pub fn events_ack_wait(&self) -> Duration {
        timing::events_ack_wait(self.seam_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(attempt_ms: u64, seam_ms: u64) -> DispatcherConfig {
        DispatcherConfig {
            production: false,
            nats_url: String::new(),
            stream_prefix: String::new(),
            api_url: String::new(),
            api_tls_name: String::new(),
            tls_ca: PathBuf::new(),
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
            attempt_timeout: Duration::from_millis(attempt_ms),
            max_in_flight: 1,
            max_expanding: 1,
            expanding_per_environment: 1,
            seam_timeout: Duration::from_millis(seam_ms),
            url_policy: Policy::strict(),
            resolver: std::sync::Arc::new(relay_netguard::SystemResolver),
            egress_proxy: None,
            source_address: None,
            receiver_ca: None,
        }
    }

    #[test]
    fn the_ack_wait_is_always_longer_than_an_attempt() {
        for attempt in [100, 1_000, 15_000, 120_000] {
            let c = cfg(attempt, 100);
            c.validate().unwrap();
            assert!(c.deliveries_ack_wait() > c.attempt_timeout, "attempt {attempt} ms");
        }
        assert!(cfg(15_000, 50).validate().is_err(), "a seam timeout under 100 ms is refused");
        assert!(cfg(50, 1000).validate().is_err(), "an attempt timeout under 100 ms is refused");
    }

    #[test]
    fn production_refuses_a_chosen_source_address() {
        let mut c = cfg(1000, 1000);
        c.production = true;
        c.source_address = Some("127.0.0.2".parse().unwrap());
        assert!(c.validate().unwrap_err().to_string().contains("RELAY_DEV_SOURCE_ADDRESS"));
        c.production = false;
        c.validate().unwrap();
    }

    #[test]
    fn production_refuses_dev_allowances() {
        let mut c = cfg(1000, 1000);
        c.production = true;
        c.url_policy.allow_http = true;
        assert!(c.validate().unwrap_err().to_string().contains("RELAY_DEV_ALLOW_HTTP_ENDPOINTS"));
        let mut c = cfg(1000, 1000);
        c.production = true;
        c.url_policy.allowed_ranges = vec!["10.0.0.0/8".parse().unwrap()];
        assert!(c.validate().unwrap_err().to_string().contains("RELAY_DEV_ALLOWED_ENDPOINT_RANGES"));
    }
}
