//! An in-process OTLP/gRPC trace collector: point a service's
//! `RELAY_OTLP_ENDPOINT` (or a `relay_telemetry::OtlpExport`) at
//! [`Collector::endpoint`] and read back the spans it exported.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, KeyValue, any_value::Value},
};
use tokio::{net::TcpListener, sync::oneshot};
use tonic::transport::{Server, server::TcpIncoming};

/// One span as the collector received it.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectedSpan {
    /// `service.name` of the resource the span came with.
    pub service: String,
    pub name: String,
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits.
    pub span_id: String,
    /// 16 lowercase hex digits; empty for a root span.
    pub parent_span_id: String,
    /// Values stringified: strings as they are, numbers and booleans as
    /// Rust prints them, arrays and maps in a Debug-like form.
    pub attributes: Vec<(String, String)>,
    /// When the span started and ended, in ns since the Unix epoch.
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
}

impl CollectedSpan {
    /// The value of attribute `key`, if the span has it.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    pub fn is_root(&self) -> bool {
        self.parent_span_id.is_empty()
    }
}

/// A trace collector on 127.0.0.1, stopped when dropped.
///
/// It is served by the runtime it was started on: with a current-thread
/// runtime (`#[tokio::test]`), flush or shut an exporter down in
/// `spawn_blocking`, not on the runtime's thread, or the export waits for a
/// collector that cannot run.
pub struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<CollectedSpan>>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Collector {
    /// Binds 127.0.0.1:0 and serves the OTLP `TraceService` until dropped.
    pub async fn start() -> Result<Collector> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the OTLP collector")?;
        let addr = listener.local_addr()?;
        let spans = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = oneshot::channel::<()>();
        let router = Server::builder().add_service(TraceServiceServer::new(Sink(spans.clone())));
        tokio::spawn(async move {
            let stopped = async {
                let _ = stopped.await;
            };
            if let Err(e) = router.serve_with_incoming_shutdown(TcpIncoming::from(listener), stopped).await {
                eprintln!("OTLP test collector stopped: {e:#}");
            }
        });
        Ok(Collector { addr, spans, stop: Some(stop) })
    }

    /// `http://127.0.0.1:PORT`, the form `RELAY_OTLP_ENDPOINT` takes.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<CollectedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// Polls (every 50 ms) until `pred` holds for the spans received so far
    /// or `within` has passed, and returns the spans either way: assert on
    /// the result.
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&[CollectedSpan]) -> bool) -> Vec<CollectedSpan> {
        let deadline = Instant::now() + within;
        loop {
            let spans = self.spans();
            if pred(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

struct Sink(Arc<Mutex<Vec<CollectedSpan>>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = Vec::new();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                .map(|kv| stringify(kv.value.as_ref()))
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                received.push(CollectedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex::encode(span.trace_id),
                    span_id: hex::encode(span.span_id),
                    parent_span_id: hex::encode(span.parent_span_id),
                    attributes: span.attributes.iter().map(|kv| (kv.key.clone(), stringify(kv.value.as_ref()))).collect(),
                    start_unix_nanos: span.start_time_unix_nano,
                    end_unix_nanos: span.end_time_unix_nano,
                });
            }
        }
        self.0.lock().unwrap().extend(received);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

fn stringify(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        None => String::new(),
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BytesValue(b)) => hex::encode(b),
        Some(Value::ArrayValue(a)) => {
            format!("[{}]", a.values.iter().map(|v| stringify(Some(v))).collect::<Vec<_>>().join(", "))
        }
        Some(Value::KvlistValue(kvs)) => format!("{{{}}}", kvs.values.iter().map(pair).collect::<Vec<_>>().join(", ")),
        Some(other) => format!("{other:?}"),
    }
}

fn pair(kv: &KeyValue) -> String {
    format!("{}: {}", kv.key, stringify(kv.value.as_ref()))
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// The real exporter of `relay-telemetry` (gRPC, batch processor) sends
    /// a parent and a child span to the collector, which hands them back
    /// linked. The test's runtime is current-thread on purpose: the
    /// exporter must not need it.
    #[tokio::test]
    async fn spans_exported_over_otlp_arrive_linked() {
        let collector = Collector::start().await.unwrap();
        let export = relay_telemetry::OtlpExport::start("relay-otlp-test", &collector.endpoint()).unwrap();
        let subscriber = tracing_subscriber::registry().with(export.layer());
        tracing::subscriber::with_default(subscriber, || {
            let parent = tracing::info_span!("parent", tenant = "t1", attempt = 2_i64);
            parent.in_scope(|| tracing::info_span!("child", ok = true).in_scope(|| {}));
        });

        // Within the batch delay, without a flush.
        let spans = collector.wait_for(Duration::from_secs(10), |s| s.len() >= 2).await;
        assert_eq!(spans.len(), 2, "{spans:#?}");
        let parent = spans.iter().find(|s| s.name == "parent").expect("the parent span");
        let child = spans.iter().find(|s| s.name == "child").expect("the child span");
        assert_eq!(parent.service, "relay-otlp-test");
        assert_eq!(child.service, "relay-otlp-test");
        assert!(parent.is_root(), "{parent:?}");
        assert_eq!(parent.trace_id.len(), 32);
        assert_eq!(parent.span_id.len(), 16);
        assert_eq!(child.trace_id, parent.trace_id);
        assert_eq!(child.parent_span_id, parent.span_id);
        assert_eq!(parent.attribute("tenant"), Some("t1"));
        assert_eq!(parent.attribute("attempt"), Some("2"));
        assert_eq!(child.attribute("ok"), Some("true"));

        // A span still queued at shutdown is sent, not lost.
        let subscriber = tracing_subscriber::registry().with(export.layer());
        tracing::subscriber::with_default(subscriber, || tracing::info_span!("last").in_scope(|| {}));
        // Shutdown blocks until the collector answers, and the collector is
        // served by this (single-threaded) runtime: block elsewhere.
        tokio::task::spawn_blocking(move || export.shutdown()).await.unwrap().unwrap();
        assert!(collector.spans().iter().any(|s| s.name == "last"), "{:#?}", collector.spans());
    }
}
