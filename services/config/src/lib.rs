//! Every `RELAY_*` setting, read one way by every service.
//!
//! - [`KNOBS`] is the catalogue: each variable a service reads, which
//!   service reads it, its default and what it means. The table in
//!   `docs/configuration.md` is generated from it (`cargo run -q -p
//!   relay-config -- --write docs/configuration.md`), and a test fails when
//!   the two differ.
//! - [`Env`] reads a variable only if the catalogue has it, and parses it
//!   into a typed value within stated bounds; a bad value stops the process
//!   with a message naming the variable and the value.
//! - [`Deployment`] is the one parse of `RELAY_ENV`.
//! - [`timing`] holds the rules that tie one service's settings to
//!   another's, checked at start-up by each service that can see them.

use std::{fmt::Display, net::SocketAddr, ops::RangeInclusive, path::PathBuf, str::FromStr, time::Duration};

use anyhow::{Context, Result, bail};

/// Which services read a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readers {
    Api,
    Dispatcher,
    Both,
}

impl Readers {
    fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Dispatcher => "dispatcher",
            Self::Both => "both",
        }
    }
}

/// One setting.
#[derive(Debug, Clone, Copy)]
pub struct Knob {
    pub name: &'static str,
    pub readers: Readers,
    /// As the operator would write it; empty when there is none.
    pub default: &'static str,
    pub meaning: &'static str,
}

const fn knob(name: &'static str, readers: Readers, default: &'static str, meaning: &'static str) -> Knob {
    Knob { name, readers, default, meaning }
}

use Readers::{Api, Both, Dispatcher};

/// Every variable a Relay service reads.
pub const KNOBS: &[Knob] = &[
    knob(
        "RELAY_ENV",
        Both,
        "development",
        "`development` or `production`; production refuses dev allowances, the dev secret key and shortened retry tiers",
    ),
    knob(
        "DATABASE_URL",
        Api,
        "postgres://postgres@127.0.0.1:5432/relay",
        "Postgres: one server, or a replicated one's servers libpq-style (`postgres://u@pg1:5432,pg2:5432/db`): the api writes to whichever is primary and follows a promotion",
    ),
    knob(
        "RELAY_NATS_URL",
        Both,
        "nats://127.0.0.1:4222",
        "NATS with JetStream: one URL, or a cluster's servers as a comma-separated list (the client fails over between them)",
    ),
    knob(
        "RELAY_STREAM_REPLICAS",
        Api,
        "1",
        "copies of each stream (and its consumers) on a NATS cluster (1–5; 3 in production, where fewer is refused unless `RELAY_ALLOW_FEWER_STREAM_REPLICAS`); changed on a running system, the streams are updated at the next start",
    ),
    knob(
        "RELAY_ALLOW_FEWER_STREAM_REPLICAS",
        Api,
        "false",
        "let production run streams on fewer than 3 NATS nodes (a node's loss then loses what it held)",
    ),
    knob("RELAY_STREAM_PREFIX", Both, "", "prefix for stream, subject and consumer names (tests and stacks sharing a NATS)"),
    knob("RELAY_REST_ADDR", Api, "127.0.0.1:8080", "the tenants' REST/JSON listen address"),
    knob(
        "RELAY_PUBLIC_URL",
        Api,
        "",
        "the REST port's address as customers reach it, e.g. https://webhooks.example.com (portal links are built on it; https in production); unset: http://<RELAY_REST_ADDR>",
    ),
    knob("RELAY_GRPC_ADDR", Api, "127.0.0.1:50051", "the tenants' gRPC listen address"),
    knob("RELAY_INTERNAL_ADDR", Api, "127.0.0.1:50052", "the internal mTLS listen address (DispatchService, AdminService)"),
    knob(
        "RELAY_METRICS_ADDR",
        Api,
        "127.0.0.1:9464",
        "the operator's Prometheus port, `GET /metrics` (`off` disables it): attempts by decision, attempt latency, queue depths, attempts in flight per endpoint",
    ),
    knob(
        "RELAY_HEALTH_ADDR",
        Dispatcher,
        "127.0.0.1:9465",
        "the dispatcher's health port (`off` disables it): `GET /healthz` (alive), `GET /readyz` (connected to NATS)",
    ),
    knob("RELAY_TLS_CLIENT_CA", Api, "", "the CA whose client certificates the internal port accepts (required)"),
    knob("RELAY_TLS_CERT", Both, "", "this service's mTLS certificate, PEM (required)"),
    knob("RELAY_TLS_KEY", Both, "", "this service's mTLS key, PEM (required)"),
    knob("RELAY_SECRET_KEYS", Api, "", "`id:base64(32 bytes)[,id:...]`, the first is active; required in production"),
    knob(
        "RELAY_RETRY_TIERS",
        Api,
        "0,1000,5000,30000,300000,1800000,7200000",
        "retry delays in ms (tests only; production refuses a change)",
    ),
    knob(
        "RELAY_DELIVERY_LEASE_SECS",
        Api,
        "300",
        "how long an attempt handed to the broker is leased before the relay may hand it out again (5–3600; longer than the dispatcher's ack wait)",
    ),
    knob(
        "RELAY_DB_POOL_SIZE",
        Api,
        "20",
        "Postgres connections for requests (2–1000), besides the seven the publish, expansion and outcome lanes and the relays hold; a call that waits 5 s for one (or for its lane) is answered 503 with `Retry-After`",
    ),
    knob(
        "RELAY_ENDPOINT_IN_FLIGHT_CAP",
        Api,
        "64",
        "attempts one endpoint may have handed out and unreported (1–10000; an endpoint's throughput is at most this over the claim-to-outcome round trip)",
    ),
    knob("RELAY_RELAY_BATCH", Api, "500", "rows one relay pass claims (1–10000)"),
    knob(
        "RELAY_EVENTS_BACKLOG",
        Api,
        "256",
        "events published to EVENTS and not yet taken for expansion, at most (1–1000000); the rest wait in the outbox, where every environment gets its turn",
    ),
    knob(
        "RELAY_CIRCUIT_MIN_ATTEMPTS",
        Api,
        "20",
        "attempts an endpoint must have made in the circuit's window before it can look down (1–100000)",
    ),
    knob(
        "RELAY_CIRCUIT_FAILURE_PERCENT",
        Api,
        "90",
        "share of those attempts that must have failed for the circuit to open (50–100); 429s, and 503s with Retry-After, count in neither",
    ),
    knob(
        "RELAY_CIRCUIT_WINDOW_MS",
        Api,
        "120000",
        "the sliding window the failure rate is measured over, in ms (production: 10000–3600000)",
    ),
    knob(
        "RELAY_CIRCUIT_QUIET_MS",
        Api,
        "30000",
        "how long an endpoint must have had no success before its circuit can open, in ms (production: 5000 up to the window)",
    ),
    knob(
        "RELAY_CIRCUIT_MIN_FAILED_RETRIES",
        Api,
        "5",
        "failed retries (attempts after a delivery's first) the current run of failures must hold before the circuit opens (0–1000): a receiver that refuses first requests and accepts retries never opens it",
    ),
    knob(
        "RELAY_DEV_CIRCUIT_OFF",
        Api,
        "false",
        "development only: the circuit never opens, to compare a run with the plain retry schedule (production refuses it)",
    ),
    knob(
        "RELAY_PROBE_BACKOFF_MS",
        Api,
        "10000,600000",
        "first and longest wait before probing an open circuit, in ms (tests only; production refuses a change)",
    ),
    knob("RELAY_RECOVER_PER_SECOND", Api, "20", "deliveries a bulk recovery of an endpoint sends again per second (1–10000)"),
    knob(
        "RELAY_RETENTION_DAYS",
        Api,
        "30",
        "days an event, its deliveries and their attempt log are kept once every delivery has ended (8–3650; longer than a dead letter's 7): the storage bound",
    ),
    knob("RELAY_SKIP_MIGRATIONS", Api, "false", "do not run the migrations at start-up"),
    knob("RELAY_RUN_RELAYS", Api, "true", "run the outbox and delivery relays in this process (an api can also only serve requests)"),
    knob(
        "RELAY_API_INTERNAL_URL",
        Dispatcher,
        "https://127.0.0.1:50052",
        "the api's internal mTLS port; several apis comma-separated: calls go to one until it fails at the transport, then to the next",
    ),
    knob("RELAY_API_TLS_NAME", Dispatcher, "relay-api", "the name the api's server certificate is checked against"),
    knob("RELAY_TLS_CA", Dispatcher, "", "the CA the api's server certificate is checked against (required)"),
    knob(
        "RELAY_ATTEMPT_TIMEOUT_MS",
        Both,
        "15000",
        "per-attempt timeout (100–120000): connect, send and read the status; the broker's ack wait and the api's lease rule derive from it, so give both services the same value",
    ),
    knob("RELAY_SEAM_TIMEOUT_MS", Both, "15000", "deadline of one call to the api's seam (100–60000); give both services the same value"),
    knob("RELAY_MAX_IN_FLIGHT", Dispatcher, "512", "attempts in flight across all endpoints (1–100000; one per endpoint)"),
    knob("RELAY_MAX_EXPANDING", Dispatcher, "256", "expansions in flight (1–10000)"),
    knob(
        "RELAY_DISPATCHER_THREADS",
        Dispatcher,
        "1",
        "worker threads of the dispatcher (1–256); one spends a quarter less CPU per delivery at moderate load than two (cross-thread wake-ups) and kept up at saturation on 2 cores; add dispatcher processes, or threads, past one core",
    ),
    knob("RELAY_EGRESS_PROXY", Dispatcher, "", "send webhooks through this HTTP proxy; the URL rules still apply"),
    knob("RELAY_DEV_ALLOW_HTTP_ENDPOINTS", Both, "false", "development allowance: accept plain http endpoints (never in production)"),
    knob(
        "RELAY_DEV_ALLOWED_ENDPOINT_RANGES",
        Both,
        "",
        "development allowance: CIDR ranges endpoints may target despite the address rules (never in production)",
    ),
    knob("RELAY_LOG", Both, "info", "log filter (tracing `EnvFilter` syntax)"),
    knob("RELAY_LOG_FORMAT", Both, "text", "`json` for one JSON object per line"),
    knob(
        "RELAY_OTLP_ENDPOINT",
        Both,
        "",
        "`http://host:port` of an OTLP/gRPC collector: export spans, one trace per event (off when unset; a malformed value refuses to start)",
    ),
];

/// The knob of that name; a name not in the catalogue is a programming
/// error, caught by the tests of the service that reads it.
/// The servers `RELAY_NATS_URL` names: one URL, or a comma-separated list.
pub fn nats_servers(spec: &str) -> Result<Vec<String>> {
    let servers: Vec<String> = spec.split(',').map(|s| s.trim().to_owned()).collect();
    if let Some(i) = servers.iter().position(String::is_empty) {
        bail!("RELAY_NATS_URL lists {} servers and server {} of them is empty: {spec:?}", servers.len(), i + 1);
    }
    Ok(servers)
}

pub fn knob_named(name: &str) -> &'static Knob {
    KNOBS.iter().find(|k| k.name == name).unwrap_or_else(|| panic!("{name} is not in relay_config::KNOBS"))
}

/// The configuration table of `docs/configuration.md`.
pub fn markdown_table() -> String {
    let mut out = String::from("| variable | read by | default | meaning |\n|---|---|---|---|\n");
    for k in KNOBS {
        let default = if k.default.is_empty() { String::new() } else { format!("`{}`", k.default) };
        out.push_str(&format!("| `{}` | {} | {} | {} |\n", k.name, k.readers.as_str(), default, k.meaning));
    }
    out
}

pub const TABLE_BEGIN: &str = "<!-- knobs: generated by `cargo run -q -p relay-config -- --write docs/configuration.md`; do not edit -->";
pub const TABLE_END: &str = "<!-- knobs end -->";

/// Where the generated table lives, from the workspace's root.
pub const TABLE_FILE: &str = "docs/configuration.md";

/// `doc` with its generated table replaced by the current one.
pub fn with_table(doc: &str) -> Result<String> {
    let start = doc.find(TABLE_BEGIN).context("no generated knob table (begin marker)")?;
    let end = doc.find(TABLE_END).context("no generated knob table (end marker)")?;
    if end < start {
        bail!("the knob table's end marker comes before its begin marker");
    }
    Ok(format!("{}{TABLE_BEGIN}\n{}{}", &doc[..start], markdown_table(), &doc[end..]))
}

/// Where this process runs. Production turns every dev allowance into a
/// start-up error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deployment {
    Development,
    Production,
}

impl Deployment {
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("" | "development" | "dev" | "test") => Ok(Self::Development),
            Some("production" | "prod") => Ok(Self::Production),
            Some(other) => bail!("RELAY_ENV must be development or production, got {other:?}"),
        }
    }

    pub fn from_env() -> Result<Self> {
        Self::parse(Env.string("RELAY_ENV").as_deref())
    }

    pub fn is_production(self) -> bool {
        self == Self::Production
    }
}

/// Reads catalogued variables from the process environment. Unset and blank
/// are the same: the default. Any variable may instead be given as a file:
/// `<NAME>_FILE` names a file whose contents (less a final newline) are the
/// value — how a secret mounted as a file (Kubernetes, Docker secrets)
/// reaches a setting without sitting in the process's environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Env;

/// The suffix that makes a variable name a path to the value.
pub const FILE_SUFFIX: &str = "_FILE";

impl Env {
    pub fn string(&self, name: &str) -> Option<String> {
        knob_named(name);
        if let Some(path) = std::env::var_os(format!("{name}{FILE_SUFFIX}")).filter(|p| !p.is_empty()) {
            // Checked readable by `check_files` at start-up; unreadable now is as unset.
            let value = std::fs::read_to_string(path).ok()?;
            let value = value.strip_suffix('\n').map(|v| v.strip_suffix('\r').unwrap_or(v)).unwrap_or(&value);
            return Some(value.to_string()).filter(|v| !v.trim().is_empty());
        }
        std::env::var(name).ok().filter(|v| !v.trim().is_empty())
    }

    /// Every `<NAME>_FILE` given for a catalogued variable names a readable
    /// file, and no variable is given both ways. Call before reading settings.
    pub fn check_files(&self) -> Result<()> {
        for k in KNOBS {
            let file_var = format!("{}{FILE_SUFFIX}", k.name);
            let Some(path) = std::env::var_os(&file_var).filter(|p| !p.is_empty()) else { continue };
            if std::env::var_os(k.name).is_some_and(|v| !v.is_empty()) {
                bail!("{} and {file_var} are both set: give the value one way", k.name);
            }
            std::fs::read_to_string(&path).with_context(|| format!("{file_var}: reading {}", std::path::Path::new(&path).display()))?;
        }
        Ok(())
    }

    /// The value, or the catalogue's default.
    pub fn string_or_default(&self, name: &str) -> String {
        self.string(name).unwrap_or_else(|| knob_named(name).default.to_owned())
    }

    pub fn flag(&self, name: &str) -> Result<bool> {
        let raw = self.string_or_default(name);
        match raw.trim() {
            "" | "0" | "false" | "off" | "no" => Ok(false),
            "1" | "true" | "on" | "yes" => Ok(true),
            other => bail!("{name} must be true or false, got {other:?}"),
        }
    }

    /// A number within `range`, the catalogue's default when unset.
    pub fn number<T>(&self, name: &str, range: RangeInclusive<T>) -> Result<T>
    where
        T: FromStr + PartialOrd + Display,
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        let raw = self.string_or_default(name);
        let n: T = raw.trim().parse().with_context(|| format!("{name} must be a whole number, got {raw:?}"))?;
        if !range.contains(&n) {
            bail!("{name} must be between {} and {}, got {n}", range.start(), range.end());
        }
        Ok(n)
    }

    pub fn millis(&self, name: &str, range: RangeInclusive<u64>) -> Result<Duration> {
        self.number(name, range).map(Duration::from_millis)
    }

    pub fn secs(&self, name: &str, range: RangeInclusive<u64>) -> Result<Duration> {
        self.number(name, range).map(Duration::from_secs)
    }

    pub fn addr(&self, name: &str) -> Result<SocketAddr> {
        let raw = self.string_or_default(name);
        raw.trim().parse().with_context(|| format!("{name} must be host:port, got {raw:?}"))
    }

    /// A listen address, or `None` when the variable says `off`.
    pub fn addr_or_off(&self, name: &str) -> Result<Option<SocketAddr>> {
        match self.string(name).as_deref().map(str::trim) {
            Some("off") => Ok(None),
            _ => self.addr(name).map(Some),
        }
    }

    /// A required file path.
    pub fn path(&self, name: &str) -> Result<PathBuf> {
        self.string(name).map(PathBuf::from).with_context(|| format!("{name} is required: {}", knob_named(name).meaning))
    }
}

/// The rules that tie settings of different services together. Each service
/// checks those it can see at start-up; the attempt and seam timeouts are
/// read by both services for this reason.
pub mod timing {
    use std::time::Duration;

    use anyhow::{Result, bail};

    /// The longest claim a dispatcher may take on an attempt (the api
    /// refuses a longer one).
    pub const MAX_CLAIM_HOLD: Duration = Duration::from_secs(600);

    /// Material a dispatcher holds is used to send for this long; older, it
    /// is fetched (and the attempt claimed) again first, so a slow attempt
    /// ahead of it cannot make it send to a URL or with a secret that has
    /// since changed, to an endpoint since disabled, or past its lease.
    pub const MATERIAL_FRESH: Duration = Duration::from_secs(2);

    /// The shortest lease (and claim) on first attempts handed to a
    /// dispatcher with their expansion: it sends them without asking again
    /// while their material is fresh, so neither may run out before that
    /// does, with room to spare.
    pub const MIN_IN_HAND_LEASE: Duration = Duration::from_secs(5);
    const _: () = assert!(MIN_IN_HAND_LEASE.as_millis() > 2 * MATERIAL_FRESH.as_millis());

    /// How long the broker waits for a delivery job's ack before handing it
    /// to another dispatcher: always longer than an attempt plus a seam call,
    /// so a slow customer never makes the broker think the dispatcher died.
    pub fn deliveries_ack_wait(attempt_timeout: Duration, seam_timeout: Duration) -> Duration {
        attempt_timeout + seam_timeout
    }

    /// How long the broker waits for an EVENTS message's ack (an expansion
    /// is one or two seam calls).
    pub fn events_ack_wait(seam_timeout: Duration) -> Duration {
        seam_timeout * 2
    }

    /// The api's lease on an attempt handed to the broker must outlast the
    /// dispatcher's hold on it (the ack wait), or the relay would hand the
    /// attempt out again while it is still being sent.
    pub fn check_lease(delivery_lease: Duration, attempt_timeout: Duration, seam_timeout: Duration) -> Result<()> {
        let ack_wait = deliveries_ack_wait(attempt_timeout, seam_timeout);
        if delivery_lease <= ack_wait {
            bail!(
                "RELAY_DELIVERY_LEASE_SECS ({} s) must be longer than the dispatcher's ack wait, RELAY_ATTEMPT_TIMEOUT_MS + RELAY_SEAM_TIMEOUT_MS ({} ms)",
                delivery_lease.as_secs(),
                ack_wait.as_millis()
            );
        }
        Ok(())
    }

    /// A dispatcher's claim on an attempt (material freshness + the attempt
    /// + a margin to report) must fit under the api's longest claim.
    pub fn check_claim(claim_hold: Duration) -> Result<()> {
        if claim_hold > MAX_CLAIM_HOLD {
            bail!(
                "an attempt's claim of {} ms exceeds the api's limit of {} ms: lower RELAY_ATTEMPT_TIMEOUT_MS",
                claim_hold.as_millis(),
                MAX_CLAIM_HOLD.as_millis()
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_url_takes_one_server_or_a_clusters_list() {
        assert_eq!(nats_servers("nats://127.0.0.1:4222").unwrap(), ["nats://127.0.0.1:4222"]);
        assert_eq!(
            nats_servers("nats://a:4222, nats://b:4222,nats://c:4222").unwrap(),
            ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
        );
        let e = nats_servers("nats://a:4222,,nats://c:4222").unwrap_err().to_string();
        assert!(e.contains("lists 3 servers and server 2 of them is empty"), "{e}");
        assert!(nats_servers("").is_err());
    }

    #[test]
    fn relay_env_has_one_meaning_everywhere() {
        assert_eq!(Deployment::parse(None).unwrap(), Deployment::Development);
        assert_eq!(Deployment::parse(Some("prod")).unwrap(), Deployment::Production);
        assert_eq!(Deployment::parse(Some(" production ")).unwrap(), Deployment::Production);
        let unknown = Deployment::parse(Some("staging")).unwrap_err().to_string();
        assert!(unknown.contains("staging"), "{unknown}");
    }

    #[test]
    fn the_catalogue_names_each_variable_once_with_a_meaning_that_fits_one_cell() {
        let mut names: Vec<&str> = KNOBS.iter().map(|k| k.name).collect();
        names.sort();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "a variable is catalogued twice");
        for k in KNOBS {
            assert!(!k.meaning.is_empty() && !k.meaning.contains('|'), "{}: a meaning that fits one table cell", k.name);
        }
    }

    #[test]
    fn the_configuration_page_table_is_the_generated_one() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md")).unwrap();
        assert_eq!(
            with_table(&doc).unwrap(),
            doc,
            "docs/configuration.md's table is stale: run `cargo run -q -p relay-config -- --write docs/configuration.md`"
        );
    }

    #[test]
    fn the_timing_rules_hold_at_the_defaults_and_refuse_a_short_lease() {
        let (attempt, seam) = (Duration::from_millis(15_000), Duration::from_millis(15_000));
        timing::check_lease(Duration::from_secs(300), attempt, seam).unwrap();
        assert!(timing::check_lease(Duration::from_secs(30), attempt, seam).is_err());
        assert!(timing::deliveries_ack_wait(attempt, seam) > attempt);
        timing::check_claim(Duration::from_secs(22)).unwrap();
        assert!(timing::check_claim(timing::MAX_CLAIM_HOLD + Duration::from_millis(1)).is_err());
    }
}
