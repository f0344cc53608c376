//! Logging and tracing for every Relay service.
//!
//! One rule lives here rather than in each binary: third-party crates that
//! write message bodies into their TRACE events (async-nats prints every
//! message it reads, payload included) are capped at DEBUG, whatever
//! `RELAY_LOG` asks for, so turning logging up never puts a customer's
//! payload into the logs.
//!
//! # Environment
//!
//! | variable | meaning |
//! | --- | --- |
//! | `RELAY_LOG` | log filter, `EnvFilter` syntax (default `info`), with the payload-logger cap |
//! | `RELAY_LOG_FORMAT` | `json` for one JSON object a line, anything else for text |
//! | `RELAY_OTLP_ENDPOINT` | `http://host:port` of an OTLP/gRPC collector; unset or empty: no span export |
//!
//! The OTLP exporter also honours the standard `OTEL_BSP_*` batch variables
//! (except the schedule delay, fixed at 500 ms here), `OTEL_EXPORTER_OTLP_HEADERS`
//! and `OTEL_RESOURCE_ATTRIBUTES`; `service.name` is always the name the
//! binary passes.
//!
//! # What is exported
//!
//! Only spans, never events: log lines (`info!`, `warn!`, …) stay in the
//! process's log output and are not attached to exported spans, so a field
//! that one of them carries is never shipped to a collector. Exported spans
//! are those at INFO or above, minus the spans of the transport crates
//! (hyper, h2, tonic, tower, async-nats and OpenTelemetry's own).
//!
//! Policy: a span's fields become attributes of the exported span, so the
//! services put identifiers in span fields (tenant, endpoint, event and
//! delivery ids, attempt numbers, status codes) and never a secret, a
//! signature, a header value from a tenant or a payload.
//!
//! # Propagation
//!
//! Trace context travels as W3C `traceparent`/`tracestate`, through NATS
//! headers, gRPC metadata (a REST call's `traceparent` header is forwarded
//! into it), or a database column (the api stores
//! the traceparent with an event and its deliveries so the relays, which run
//! later in other tasks, continue the same trace). See [`inject_current`],
//! [`set_parent`], [`current_traceparent`] and [`set_parent_from_traceparent`].
//!
//! Propagation needs the OpenTelemetry layer, which is installed only when
//! `RELAY_OTLP_ENDPOINT` is set: with export off, the helpers are no-ops
//! (nothing is injected, `current_traceparent` is `None`, an incoming context
//! is ignored). A service with export off therefore starts a new trace where
//! an upstream one would have continued; that is the accepted cost of not
//! building OpenTelemetry spans that nobody exports.

mod export;
mod propagation;

use anyhow::{Context as _, Result};
use tracing_subscriber::{EnvFilter, Layer as _, fmt, layer::SubscriberExt as _, util::SubscriberInitExt as _};

pub use export::OtlpExport;
pub use propagation::{
    GrpcMetadataRef, NatsHeaders, NatsHeadersRef, current_traceparent, inject_current, set_parent, set_parent_from_traceparent,
};

/// The variable that turns OTLP span export on.
pub const OTLP_ENDPOINT_VAR: &str = "RELAY_OTLP_ENDPOINT";

/// Targets that would log payloads at TRACE.
const PAYLOAD_LOGGERS: &[&str] = &["async_nats"];

/// The filter for a `RELAY_LOG`-style spec (default `info`), with the caps:
/// where the spec would let a payload logger reach TRACE (a global `trace`,
/// or that target at `trace`), it is held at DEBUG instead. A spec that does
/// not reach TRACE is left exactly as written.
pub fn filter(spec: &str) -> EnvFilter {
    let spec = if spec.trim().is_empty() { "info" } else { spec };
    let mut f = EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new("info"));
    let directives: Vec<&str> = spec.split(',').map(str::trim).collect();
    let global_trace = directives.iter().any(|d| d.eq_ignore_ascii_case("trace"));
    for target in PAYLOAD_LOGGERS {
        let target_trace = directives.iter().any(|d| d.starts_with(target) && d.to_ascii_lowercase().ends_with("=trace"));
        if global_trace || target_trace {
            f = f.add_directive(format!("{target}=debug").parse().expect("a valid directive"));
        }
    }
    f
}

/// Installs the process's subscriber: logs (`RELAY_LOG` for the filter,
/// `RELAY_LOG_FORMAT=json` for one JSON object a line) and, when
/// `RELAY_OTLP_ENDPOINT` is set, OTLP/gRPC span export (batched, 500 ms)
/// with `service.name = service_name`. Also sets the global OpenTelemetry
/// propagator to W3C TraceContext.
///
/// Fails, installing nothing, when `RELAY_OTLP_ENDPOINT` is not a plaintext
/// `http://host:port` URL, or when a global subscriber is already installed.
/// Keep the returned guard alive for the life of the process and call
/// [`Telemetry::shutdown`] (or drop it) before exiting, so the spans still
/// queued are sent.
pub fn init_with(service_name: &'static str) -> Result<Telemetry> {
    let env = relay_config::Env;
    let endpoint = env.string(OTLP_ENDPOINT_VAR);
    let export = match endpoint {
        Some(endpoint) => {
            Some(OtlpExport::start(service_name, endpoint.trim()).with_context(|| format!("{OTLP_ENDPOINT_VAR}={endpoint:?}"))?)
        }
        None => None,
    };

    let log_filter = filter(&env.string("RELAY_LOG").unwrap_or_default());
    let json = match env.string_or_default("RELAY_LOG_FORMAT").trim() {
        "text" => false,
        "json" => true,
        other => anyhow::bail!("RELAY_LOG_FORMAT must be text or json, got {other:?}"),
    };
    let logs = if json { fmt::layer().json().boxed() } else { fmt::layer().boxed() };
    let spans = export.as_ref().map(OtlpExport::layer);
    tracing_subscriber::registry()
        .with(logs.with_filter(log_filter))
        .with(spans)
        .try_init()
        .context("installing the tracing subscriber (is one already installed?)")?;

    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    match &export {
        Some(e) => tracing::info!(service = service_name, endpoint = e.endpoint(), "exporting spans over OTLP/gRPC"),
        None => tracing::debug!(service = service_name, "span export off ({OTLP_ENDPOINT_VAR} not set)"),
    }
    Ok(Telemetry { export })
}

/// What [`init_with`] installed. Dropping it, or calling
/// [`shutdown`](Self::shutdown), flushes the queued spans and stops the
/// exporter; spans ended after that are not exported.
#[must_use = "dropping the guard stops span export: keep it until the process exits"]
#[derive(Debug)]
pub struct Telemetry {
    export: Option<OtlpExport>,
}

impl Telemetry {
    /// Whether spans are exported (`RELAY_OTLP_ENDPOINT` was set).
    pub fn exporting(&self) -> bool {
        self.export.is_some()
    }

    /// Flushes the queued spans and stops the exporter (at most a few
    /// seconds when the collector is unreachable). It blocks, but may be
    /// called from async code on any Tokio runtime flavour: the exporter
    /// runs on a runtime of its own (a collector served by the caller's own
    /// current-thread runtime, as in tests, is the exception).
    pub fn shutdown(mut self) -> Result<()> {
        self.export.take().map_or(Ok(()), OtlpExport::shutdown)
    }
}

#[cfg(test)]
mod tests {
    use super::filter;

    #[test]
    fn payload_loggers_are_capped_only_where_trace_would_reach_them() {
        assert!(filter("trace").to_string().contains("async_nats=debug"));
        assert!(filter("info,async_nats=trace").to_string().contains("async_nats=debug"));
        assert!(!filter("warn").to_string().contains("async_nats"), "a quiet spec stays quiet");
        assert!(!filter("relay_api=trace").to_string().contains("async_nats"));
    }
}
