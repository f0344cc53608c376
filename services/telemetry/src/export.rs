//! OTLP/gRPC span export.
//!
//! The SDK's batch processor runs on its own thread and drives each export
//! with a blocking executor; the gRPC channel it sends through needs a Tokio
//! reactor. The channel is given a one-worker runtime of its own rather than
//! the service's, so that exporting neither needs the caller to be inside a
//! runtime nor deadlocks when a flush or shutdown blocks the only thread of
//! a current-thread runtime (as in `#[tokio::test]`).

use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::{
    Resource,
    trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider},
};
use tracing::{Level, Metadata, Subscriber, subscriber::Interest};
use tracing_subscriber::{
    Layer,
    layer::{Context, Filter},
    registry::LookupSpan,
};

/// How long spans wait in the batch queue before they are sent.
const SCHEDULED_DELAY: Duration = Duration::from_millis(500);
/// One export's budget, retries included; keeps shutdown under the SDK's 5 s.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Targets whose spans are never exported: transport internals that would
/// only add noise (or, for the exporter's own stack, feed back on itself).
const UNEXPORTED_TARGETS: &[&str] =
    &["h2", "hyper", "hyper_util", "tonic", "tower", "async_nats", "opentelemetry", "opentelemetry_sdk", "opentelemetry_otlp"];

/// A tracer provider that batches spans to an OTLP/gRPC collector, and the
/// runtime its channel runs on. [`init_with`](crate::init_with) builds one
/// from `RELAY_OTLP_ENDPOINT`; tests that need spans from code running in
/// their own process (with a subscriber of their own, set with
/// `tracing::subscriber::with_default` or `set_default`) can build one
/// directly and add [`layer`](Self::layer) to it.
///
/// Dropping it is [`shutdown`](Self::shutdown) with the error logged.
#[derive(Debug)]
pub struct OtlpExport {
    provider: SdkTracerProvider,
    endpoint: String,
    /// `None` once shut down.
    runtime: Option<tokio::runtime::Runtime>,
}

impl OtlpExport {
    /// Starts exporting to `endpoint` (`http://host:port`; plaintext only,
    /// no path). The channel connects lazily: an unreachable collector is
    /// not an error here, its exports fail later and are logged by the SDK.
    pub fn start(service_name: &'static str, endpoint: &str) -> Result<Self> {
        let uri = parse_endpoint(endpoint)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("relay-otlp")
            .enable_all()
            .build()
            .context("starting the OTLP exporter's runtime")?;
        let channel = {
            let _in_runtime = runtime.enter();
            tonic::transport::Endpoint::from(uri).connect_timeout(CONNECT_TIMEOUT).timeout(EXPORT_TIMEOUT).connect_lazy()
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_channel(channel)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .context("building the OTLP span exporter")?;
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(BatchConfigBuilder::default().with_scheduled_delay(SCHEDULED_DELAY).build())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batch)
            .with_resource(Resource::builder().with_service_name(service_name).build())
            .build();
        Ok(Self { provider, endpoint: endpoint.to_owned(), runtime: Some(runtime) })
    }

    /// The collector's address, as given.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The `tracing` layer that turns spans into exported OpenTelemetry
    /// spans: spans only (events never reach it), INFO and above, transport
    /// crates left out. Also what makes the propagation helpers work.
    pub fn layer<S>(&self) -> impl Layer<S> + Send + Sync + 'static
    where
        S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync + 'static,
    {
        otel_layer(self.provider.tracer("relay"))
    }

    /// Flushes, then stops the exporter and its runtime.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        let Some(runtime) = self.runtime.take() else { return Ok(()) };
        let result =
            self.provider.shutdown().map_err(|e| anyhow!(e)).with_context(|| format!("shutting down span export to {}", self.endpoint));
        // Allowed inside an async context, unlike dropping the runtime.
        runtime.shutdown_background();
        result
    }
}

impl Drop for OtlpExport {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = format!("{e:#}"), "span export did not shut down cleanly; recent spans may be lost");
        }
    }
}

/// The OpenTelemetry layer with the export policy of this crate.
pub(crate) fn otel_layer<S, T>(tracer: T) -> impl Layer<S> + Send + Sync + 'static
where
    S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync + 'static,
    T: opentelemetry::trace::Tracer + Send + Sync + 'static,
    T::Span: Send + Sync,
{
    tracing_opentelemetry::layer().with_tracer(tracer).with_threads(false).with_filter(ExportFilter)
}

/// [`exported`] as a per-layer filter that never lets a callsite's interest
/// be cached as `always`. With two per-layer filters on one registry (this
/// one and the log filter), a callsite that both call `always` skips
/// `enabled()`, and the registry then decides from a per-layer verdict left
/// behind by the last dynamic `enabled()` call on the thread (sqlx's query
/// logger makes one after every query): spans went missing from export at
/// the default log level and a trace fell apart (tokio-rs/tracing#2704,
/// #2519). `sometimes` keeps the verdict fresh at the cost of one call per
/// span; the log level no longer decides what is exported.
struct ExportFilter;

impl<S> Filter<S> for ExportFilter {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        exported(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if exported(meta) { Interest::sometimes() } else { Interest::never() }
    }
}

/// Spans (never events) at INFO or above, outside the transport crates.
pub(crate) fn exported(meta: &Metadata<'_>) -> bool {
    meta.is_span()
        && *meta.level() <= Level::INFO
        && !UNEXPORTED_TARGETS.iter().any(|t| meta.target().strip_prefix(t).is_some_and(|rest| rest.is_empty() || rest.starts_with("::")))
}

/// `http://host:port`, nothing else: tonic would accept more (or fail only
/// at the first export), and a misconfigured collector should stop start-up.
fn parse_endpoint(raw: &str) -> Result<http::Uri> {
    const EXPECTED: &str = "expected http://host:port of an OTLP/gRPC collector";
    let uri: http::Uri = raw.parse().with_context(|| format!("{raw:?} is not a URL; {EXPECTED}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => bail!("{raw:?}: TLS to the collector is not supported in this build; {EXPECTED} (or a local agent)"),
        Some(other) => bail!("{raw:?}: unsupported scheme {other:?}; {EXPECTED}"),
        None => bail!("{raw:?} has no scheme; {EXPECTED}"),
    }
    if uri.host().is_none_or(str::is_empty) {
        bail!("{raw:?} has no host; {EXPECTED}");
    }
    if uri.port_u16().is_none() {
        bail!("{raw:?} has no port (OTLP/gRPC is usually 4317); {EXPECTED}");
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        bail!("{raw:?} has a path or query, which gRPC does not use; {EXPECTED}");
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_must_be_plain_http_host_and_port() {
        for good in ["http://127.0.0.1:4317", "http://collector.local:4317/", "http://[::1]:4317"] {
            parse_endpoint(good).unwrap_or_else(|e| panic!("{good}: {e:#}"));
        }
        for (bad, why) in [
            ("127.0.0.1:4317", "no scheme"),
            ("localhost:4317", "scheme"),
            ("https://collector:4317", "TLS"),
            ("grpc://collector:4317", "unsupported scheme"),
            ("http://collector", "no port"),
            ("http://collector:4317/v1/traces", "path"),
            ("http://collector:99999", ""),
            ("not a url", "not a URL"),
            ("", "not a URL"),
        ] {
            let e = format!("{:#}", parse_endpoint(bad).expect_err(bad));
            assert!(e.contains(why), "{bad}: {e}");
            assert!(e.contains("http://host:port"), "{bad}: the message says what is expected: {e}");
        }
    }

    #[test]
    fn start_rejects_a_bad_endpoint_and_needs_no_ambient_runtime() {
        let e = OtlpExport::start("relay-test", "localhost:4317").expect_err("no scheme");
        assert!(format!("{e:#}").contains("expected http://host:port"));
        // Outside any Tokio runtime, with nothing listening: starts (lazily), stops at once.
        let export = OtlpExport::start("relay-test", "http://127.0.0.1:9").expect("a valid endpoint");
        assert_eq!(export.endpoint(), "http://127.0.0.1:9");
        export.shutdown().expect("nothing queued, nothing to fail");
    }
}
