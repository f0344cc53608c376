//! What a test's stack is started with: schedule, timeouts, circuit, caps,
//! which services run in-process.

use super::*;

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
    /// Events in `EVENTS` not yet taken for expansion, at most
    /// (`RELAY_EVENTS_BACKLOG`); the rest wait in the outbox.
    pub events_backlog: u64,
    /// `RELAY_EXPAND_AT_PUBLISH`: events the api expands as they are published, at once (0: none).
    pub expand_at_publish: usize,
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
            events_backlog: 256,
            expand_at_publish: 64,
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

pub(crate) fn dev_policy() -> Policy {
    Policy { allow_http: true, allowed_ranges: vec!["127.0.0.0/8".parse().expect("valid")] }
}
