//! `relay_telemetry::init_with` as a binary uses it, configured from the
//! environment and installed process-wide (hence a test binary of its own):
//! a bad `RELAY_OTLP_ENDPOINT` refuses to start; a good one exports spans to
//! an in-process collector, with the trace context carried across a stored
//! traceparent and NATS headers, and without the fields of log events.

use std::time::Duration;

use relay_telemetry::{NatsHeaders, NatsHeadersRef, inject_current, set_parent, set_parent_from_traceparent};
use relay_tests::otlp::Collector;
use tracing::Instrument as _;

const UPSTREAM_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const UPSTREAM_SPAN: &str = "b7ad6b7169203331";

#[test]
fn init_with_exports_spans_from_the_environment() {
    // SAFETY: no other thread exists yet (the runtime is built below), so
    // nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("RELAY_OTLP_ENDPOINT", "localhost:4317");
        std::env::set_var("RELAY_LOG", "warn");
    }
    let e = relay_telemetry::init_with("relay-telemetry-test").expect_err("a URL without a scheme");
    let message = format!("{e:#}");
    assert!(message.contains("RELAY_OTLP_ENDPOINT") && message.contains("http://host:port"), "{message}");
    assert!(!tracing::dispatcher::has_been_set(), "a failed init installs nothing");

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let collector = runtime.block_on(Collector::start()).unwrap();
    // SAFETY: the runtime's workers are idle and read no environment.
    unsafe { std::env::set_var("RELAY_OTLP_ENDPOINT", collector.endpoint()) };
    let telemetry = relay_telemetry::init_with("relay-telemetry-test").unwrap();
    assert!(telemetry.exporting());

    runtime.block_on(async {
        // The api: a request carrying the tenant's traceparent publishes an event.
        let request = tracing::info_span!("api.request", tenant = "t1");
        set_parent_from_traceparent(&request, &format!("00-{UPSTREAM_TRACE}-{UPSTREAM_SPAN}-01"));
        let headers = async {
            tracing::info!(payload = "do-not-export-this-payload", "publishing");
            let mut headers = async_nats::HeaderMap::new();
            inject_current(&mut NatsHeaders(&mut headers));
            headers
        }
        .instrument(request)
        .await;

        // The dispatcher, later: continues the trace from the message's headers.
        let consume = tracing::info_span!("dispatcher.consume");
        set_parent(&consume, &NatsHeadersRef(&headers));
        async { tracing::info_span!("dispatcher.attempt", attempt = 1_i64).in_scope(|| {}) }.instrument(consume).await;
    });

    // Within the 500 ms batch delay, without a flush.
    let spans = runtime.block_on(collector.wait_for(Duration::from_secs(10), |s| s.len() >= 3));
    let span = |name: &str| spans.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name} in {spans:#?}"));
    let (request, consume, attempt) = (span("api.request"), span("dispatcher.consume"), span("dispatcher.attempt"));
    for s in [request, consume, attempt] {
        assert_eq!(s.service, "relay-telemetry-test");
        assert_eq!(s.trace_id, UPSTREAM_TRACE, "one trace, the tenant's: {s:?}");
    }
    assert_eq!(request.parent_span_id, UPSTREAM_SPAN);
    assert_eq!(request.attribute("tenant"), Some("t1"));
    assert_eq!(consume.parent_span_id, request.span_id);
    assert_eq!(attempt.parent_span_id, consume.span_id);
    assert!(!format!("{spans:?}").contains("do-not-export-this-payload"), "log events are not exported");

    // Shutdown flushes what is still queued (it blocks: called from this
    // thread, not from one of the workers serving the collector).
    runtime.block_on(async { tracing::info_span!("last").in_scope(|| {}) });
    telemetry.shutdown().unwrap();
    assert!(collector.spans().iter().any(|s| s.name == "last"), "{:#?}", collector.spans());
}
