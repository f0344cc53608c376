//! The catalogue of every `RELAY_*` variable: which service reads it, its
//! default as an operator would write it, and what it means.

/// Which services read a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readers {
    Api,
    Dispatcher,
    Both,
}

impl Readers {
    pub(crate) fn as_str(self) -> &'static str {
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
        "attempts one endpoint may have handed out and unreported, unless its own max_in_flight is lower (1–10000; an endpoint's throughput is at most this over the claim-to-outcome round trip)",
    ),
    knob(
        "RELAY_EXPAND_AT_PUBLISH",
        Api,
        "64",
        "events the api expands itself as they are published, at once, at most (0–4096; 0: every event goes by the outbox relay and EVENTS); a quarter of it per environment, and only while the outbox relay keeps up and a dispatcher takes attempts from this api",
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
    knob(
        "RELAY_LISTEN_GRACE_SECS",
        Api,
        "60",
        "seconds a listener's endpoint (relay-dev listen) outlives its call before it is deleted, its pending deliveries ending as dead letters listener_gone (1–3600)",
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
        "RELAY_EXPANDING_PER_ENVIRONMENT",
        Dispatcher,
        "16",
        "expansions in flight of any one environment while another has had work in the last 2 s (1–10000): the rest wait their turn, so a burst cannot queue ahead of a quiet environment's events; an environment alone may use all of RELAY_MAX_EXPANDING",
    ),
    knob(
        "RELAY_DISPATCHER_THREADS",
        Dispatcher,
        "1",
        "worker threads of the dispatcher (1–256); one spends a quarter less CPU per delivery at moderate load than two (cross-thread wake-ups) and kept up at saturation on 2 cores; add dispatcher processes, or threads, past one core",
    ),
    knob("RELAY_EGRESS_PROXY", Dispatcher, "", "send webhooks through this HTTP proxy; the URL rules still apply"),
    knob(
        "RELAY_RECEIVER_CA_FILE",
        Dispatcher,
        "",
        "PEM certificates of CAs the dispatcher trusts for receivers besides the platform's roots (a private CA every endpoint may use); an endpoint's own ca_bundle pins instead",
    ),
    knob(
        "RELAY_DEV_SOURCE_ADDRESS",
        Dispatcher,
        "",
        "development allowance: the local address webhooks are sent from (the crash torture tells its dispatchers apart by it; never in production)",
    ),
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
