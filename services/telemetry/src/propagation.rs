//! W3C trace-context propagation between `tracing` spans and carriers:
//! NATS headers, gRPC metadata, and a bare `traceparent`
//! string for a database column.
//!
//! All of it works through the OpenTelemetry layer: where the current
//! subscriber has none (span export off), injecting writes nothing and
//! extracting sets nothing.

use std::collections::HashMap;

use opentelemetry::{
    Context,
    propagation::{Extractor, Injector, TextMapPropagator as _},
    trace::TraceContextExt as _,
};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::{OpenTelemetrySpanExt as _, SetParentError};

const TRACEPARENT: &str = "traceparent";

/// Writes the context of the current span (`traceparent`, and `tracestate`
/// when there is one) into `map`. Nothing when there is no current span or
/// no OpenTelemetry layer.
///
/// When the current span is one the layer does not export (below INFO, or
/// of a transport crate), the innermost exported span that is entered
/// stands in for it.
pub fn inject_current(map: &mut impl Injector) {
    let cx = tracing::Span::current().context();
    let cx = if cx.span().span_context().is_valid() { cx } else { Context::current() };
    inject(&cx, map);
}

/// Makes `span` a child of the remote context in `extractor`. Call it right
/// after creating the span and before entering it or creating children:
/// once started, a span's parent is fixed. A no-op when the carrier has no
/// valid `traceparent`, without an OpenTelemetry layer, or when `span` is
/// one the layer does not export (use an INFO span where work arrives).
pub fn set_parent(span: &tracing::Span, extractor: &impl Extractor) {
    let cx = TraceContextPropagator::new().extract(extractor);
    if !cx.span().span_context().is_valid() {
        return;
    }
    match span.set_parent(cx) {
        Ok(()) | Err(SetParentError::LayerNotFound | SetParentError::SpanDisabled) => {}
        Err(e @ SetParentError::AlreadyStarted) => tracing::debug!(error = %e, "remote trace context ignored"),
    }
}

/// The current span's `traceparent` (`00-<trace id>-<span id>-<flags>`), to
/// store with a row that another task picks up later; `tracestate` is not
/// kept. `None` when there is no current span or no OpenTelemetry layer.
pub fn current_traceparent() -> Option<String> {
    let mut map = HashMap::new();
    inject_current(&mut map);
    map.remove(TRACEPARENT)
}

/// Makes `span` a child of a stored `traceparent` (see
/// [`current_traceparent`]); same rules as [`set_parent`]. A malformed value
/// is ignored: the span starts a trace of its own.
pub fn set_parent_from_traceparent(span: &tracing::Span, traceparent: &str) {
    let map = HashMap::from([(TRACEPARENT.to_owned(), traceparent.trim().to_owned())]);
    set_parent(span, &map);
}

fn inject(cx: &Context, map: &mut impl Injector) {
    TraceContextPropagator::new().inject_context(cx, map);
}

/// Injector for the headers of a NATS message being published.
pub struct NatsHeaders<'a>(pub &'a mut async_nats::HeaderMap);

/// Extractor for the headers of a received NATS message. Names are matched
/// exactly first, then regardless of case.
pub struct NatsHeadersRef<'a>(pub &'a async_nats::HeaderMap);

impl Injector for NatsHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (key.parse::<async_nats::HeaderName>(), value.parse::<async_nats::HeaderValue>()) {
            self.0.insert(name, value);
        }
    }
}

impl Extractor for NatsHeadersRef<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        // `HeaderMap::get(&str)` panics on an invalid name: parse first.
        let exact = key.parse::<async_nats::HeaderName>().ok().and_then(|name| self.0.get(name));
        exact
            .or_else(|| {
                self.0.iter().find(|(name, _)| AsRef::<str>::as_ref(*name).eq_ignore_ascii_case(key)).and_then(|(_, values)| values.first())
            })
            .map(async_nats::HeaderValue::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_ref()).collect()
    }
}

/// Extractor for the metadata of an incoming gRPC request.
pub struct GrpcMetadataRef<'a>(pub &'a tonic::metadata::MetadataMap);

impl Extractor for GrpcMetadataRef<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => k.as_str(),
                tonic::metadata::KeyRef::Binary(k) => k.as_str(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
    use opentelemetry_sdk::{
        error::OTelSdkResult,
        trace::{SdkTracerProvider, SpanData, SpanExporter},
    };
    use tracing::info_span;
    use tracing_subscriber::{Layer as _, filter::LevelFilter, layer::SubscriberExt as _};

    use super::*;

    /// Keeps every span it is given.
    #[derive(Debug, Clone, Default)]
    struct Keep(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Keep {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    /// Runs `f` under a local subscriber shaped like the one `init_with`
    /// installs: a log layer that sees every span (as with `RELAY_LOG=trace`)
    /// and this crate's OpenTelemetry layer (no network: spans go to memory
    /// as they end).
    fn traced<R>(f: impl FnOnce() -> R) -> (R, Vec<SpanData>) {
        let keep = Keep::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(keep.clone()).build();
        let logs = tracing_subscriber::fmt::layer().with_test_writer().with_filter(LevelFilter::TRACE);
        let subscriber = tracing_subscriber::registry().with(logs).with(crate::export::otel_layer(provider.tracer("test")));
        let r = tracing::subscriber::with_default(subscriber, f);
        provider.shutdown().unwrap();
        let spans = keep.0.lock().unwrap().clone();
        (r, spans)
    }

    fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name} in {:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>()))
    }

    fn ids(span: &tracing::Span) -> (TraceId, SpanId) {
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        (sc.trace_id(), sc.span_id())
    }

    /// Publisher span → carrier → consumer span (with a child), checked on
    /// the carrier and on the exported spans.
    fn round_trip(inject_into: impl FnOnce() -> Box<dyn Fn(&tracing::Span)>) -> Vec<SpanData> {
        let ((sent_trace, sent_span), spans) = traced(|| {
            let publish = info_span!("publish");
            let sent = publish.in_scope(|| ids(&tracing::Span::current()));
            let consume_with_parent = publish.in_scope(inject_into);
            drop(publish);
            let consume = info_span!("consume");
            consume_with_parent(&consume);
            consume.in_scope(|| info_span!("deliver").in_scope(|| {}));
            sent
        });
        assert_ne!(sent_trace, TraceId::INVALID);
        let publish = named(&spans, "publish");
        let consume = named(&spans, "consume");
        let deliver = named(&spans, "deliver");
        assert_eq!(publish.span_context.span_id(), sent_span);
        assert_eq!(consume.span_context.trace_id(), sent_trace, "the consumer continues the publisher's trace");
        assert_eq!(consume.parent_span_id, sent_span, "the consumer's parent is the publisher");
        assert!(consume.parent_span_is_remote);
        assert_eq!(deliver.span_context.trace_id(), sent_trace);
        assert_eq!(deliver.parent_span_id, consume.span_context.span_id());
        spans
    }

    #[test]
    fn nats_headers_round_trip() {
        round_trip(|| {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", "e1");
            inject_current(&mut NatsHeaders(&mut headers));
            let tp = headers.get("traceparent").expect("a traceparent header").as_str().to_owned();
            let (trace, span) = ids(&tracing::Span::current());
            assert_eq!(tp, format!("00-{trace}-{span}-01"));
            assert_eq!(headers.get("Nats-Msg-Id").unwrap().as_str(), "e1", "other headers are kept");
            Box::new(move |s| set_parent(s, &NatsHeadersRef(&headers)))
        });
    }

    #[test]
    fn nats_header_names_match_regardless_of_case() {
        round_trip(|| {
            let mut headers = async_nats::HeaderMap::new();
            inject_current(&mut NatsHeaders(&mut headers));
            let mut shouted = async_nats::HeaderMap::new();
            shouted.insert("Traceparent", headers.get("traceparent").unwrap().as_str());
            Box::new(move |s| set_parent(s, &NatsHeadersRef(&shouted)))
        });
    }

    #[test]
    fn grpc_metadata_round_trip() {
        round_trip(|| {
            // As a client would send it.
            let mut md = tonic::metadata::MetadataMap::new();
            md.insert("traceparent", current_traceparent().expect("inside a span").parse().unwrap());
            assert!(GrpcMetadataRef(&md).keys().contains(&"traceparent"));
            Box::new(move |s| set_parent(s, &GrpcMetadataRef(&md)))
        });
    }

    #[test]
    fn traceparent_column_round_trip() {
        round_trip(|| {
            let tp = current_traceparent().expect("a traceparent inside a span");
            assert_eq!(tp.len(), 55, "{tp}");
            Box::new(move |s| set_parent_from_traceparent(s, &tp))
        });
    }

    #[test]
    fn inside_an_unexported_span_the_exported_one_around_it_is_injected() {
        let ((outer, tp), spans) = traced(|| {
            info_span!("outer").in_scope(|| {
                let outer = ids(&tracing::Span::current());
                let tp = tracing::debug_span!("detail").in_scope(current_traceparent);
                (outer, tp)
            })
        });
        assert_eq!(tp, Some(format!("00-{}-{}-01", outer.0, outer.1)));
        assert_eq!(spans.len(), 1, "the debug span is not exported");
    }

    #[test]
    fn a_bad_or_missing_context_starts_a_new_trace() {
        let (_, spans) = traced(|| {
            assert_eq!(current_traceparent(), None, "no current span");
            let garbage = info_span!("garbage");
            set_parent_from_traceparent(&garbage, "00-not-a-traceparent-01");
            garbage.in_scope(|| {});
            let empty = info_span!("empty");
            set_parent(&empty, &NatsHeadersRef(&async_nats::HeaderMap::new()));
            empty.in_scope(|| {});
        });
        for name in ["garbage", "empty"] {
            assert_eq!(named(&spans, name).parent_span_id, SpanId::INVALID, "{name} is a root");
        }
    }

    #[test]
    fn without_the_layer_everything_is_a_no_op() {
        let subscriber = tracing_subscriber::registry().with(tracing_subscriber::fmt::layer().with_test_writer());
        tracing::subscriber::with_default(subscriber, || {
            let span = info_span!("logged");
            span.in_scope(|| {
                let mut headers = async_nats::HeaderMap::new();
                inject_current(&mut NatsHeaders(&mut headers));
                assert!(headers.is_empty());
                assert_eq!(current_traceparent(), None);
            });
            let other = info_span!("other");
            set_parent_from_traceparent(&other, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
            other.in_scope(|| assert_eq!(current_traceparent(), None));
        });
        // And with no subscriber at all.
        assert_eq!(current_traceparent(), None);
        set_parent_from_traceparent(&info_span!("none"), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    }

    #[test]
    fn spans_are_exported_without_events_debug_spans_or_transport_spans() {
        let (_, spans) = traced(|| {
            let span = info_span!("handle", tenant = "t1", attempt = 3);
            span.in_scope(|| {
                tracing::info!(body = "secret payload", "received");
                tracing::error!(signature = "v1=abc", "failed");
                tracing::debug_span!("detail").in_scope(|| {});
                info_span!(target: "h2::proto", "connection").in_scope(|| {});
            });
        });
        assert_eq!(spans.iter().map(|s| s.name.as_ref()).collect::<Vec<_>>(), ["handle"]);
        let handle = &spans[0];
        assert!(handle.events.is_empty(), "events stay in the logs: {:?}", handle.events);
        let attr = |k: &str| handle.attributes.iter().find(|kv| kv.key.as_str() == k).map(|kv| kv.value.to_string());
        assert_eq!(attr("tenant").as_deref(), Some("t1"));
        assert_eq!(attr("attempt").as_deref(), Some("3"));
        let all = format!("{:?}", handle);
        assert!(!all.contains("secret payload") && !all.contains("v1=abc"), "{all}");
    }
}
