//! One trace per event, end to end: the real api and dispatcher binaries
//! export to an in-process OTLP collector, and the spans of one event's whole
//! path (REST call → outbox → expand → the first attempts, and relay → each
//! retry) arrive in the caller's trace, each parented on the step before it.

use std::time::Duration;

use relay_tests::{Options, Process, Receiver, Reply, Rest, Stack, otlp::CollectedSpan, otlp::Collector};
use serde_json::json;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn one<'a>(spans: &'a [CollectedSpan], name: &str) -> &'a CollectedSpan {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "exactly one {name} span in the trace; got {found:#?}");
    found[0]
}

/// At the log level the services run with when nothing is set, as
/// `deploy/local/up` runs them: export must not depend on the log filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_events_path_arrives_at_the_collector_as_one_trace_at_the_default_log_level() -> anyhow::Result<()> {
    one_events_path_arrives_as_one_trace(None, Way::Events).await
}

/// The same, for an event the api expands at publish (`app::at_publish`):
/// publish, then the api's expansion beneath it, then the first attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_expanded_at_publish_arrives_at_the_collector_as_one_trace() -> anyhow::Result<()> {
    one_events_path_arrives_as_one_trace(None, Way::AtPublish).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_events_path_arrives_at_the_collector_as_one_trace_with_verbose_logs() -> anyhow::Result<()> {
    one_events_path_arrives_as_one_trace(Some("debug"), Way::Events).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_events_path_arrives_at_the_collector_as_one_trace_with_quiet_logs() -> anyhow::Result<()> {
    one_events_path_arrives_as_one_trace(Some("warn"), Way::Events).await
}

/// Which way the traced event's expansion goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// The outbox relay, EVENTS, the dispatcher's `ExpandBatch`
    /// (expansion at publish turned off).
    Events,
    /// Expanded by the api as it is published.
    AtPublish,
}

async fn one_events_path_arrives_as_one_trace(log: Option<&str>, way: Way) -> anyhow::Result<()> {
    let collector = Collector::start().await?;
    let expand_at_publish = if way == Way::AtPublish { 64 } else { 0 };
    let stack = Stack::start(Options { api: false, dispatcher: false, expand_at_publish, ..Options::default() }).await?;
    let with_otlp = |mut env: Vec<(&'static str, String)>| {
        env.push(("RELAY_OTLP_ENDPOINT", collector.endpoint()));
        env
    };
    let api = Process::spawn_logging("relay-api", &with_otlp(stack.api_env()), log)?;
    stack.wait_for_api().await?;
    let dispatcher = Process::spawn_logging("relay-dispatcher", &with_otlp(stack.dispatcher_env()), log)?;
    let tenant = stack.tenant("traced").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/fails", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (_, ok_secret) = rest.endpoint(&receiver.url("/ok"), &["t.traced"]).await?;
    let (_, failing_secret) = rest.endpoint(&receiver.url("/fails"), &["t.traced"]).await?;

    // Events nobody subscribes to first, so the traced one meets a warm
    // path (connections open, statements prepared) and its timeline is the
    // steady state's, but for the receiver's connection. Several, one at a
    // time: the publish batcher's connections take batches in turn, and a
    // connection's first statement costs its preparation (an idle stack's
    // publish 5 ms on a cold connection against 1.4–2.4 ms on warm ones).
    for _ in 0..10 {
        rest.publish("t.warmup", json!({})).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The caller's own trace context: the event's spans must join it.
    let marker = "payload-marker-7f3a";
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/events", stack.rest_url))
        .bearer_auth(&tenant.api_key)
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
        .json(&json!({"type": "t.traced", "payload": {"note": marker}}))
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 202, "{}", resp.text().await?);

    // 1 delivery to /ok, 7 attempts then a dead letter at /fails.
    let ours = |spans: &[CollectedSpan]| -> Vec<CollectedSpan> { spans.iter().filter(|s| s.trace_id == TRACE_ID).cloned().collect() };
    let spans = ours(
        &collector
            .wait_for(Duration::from_secs(30), |all| {
                let t = ours(all);
                t.iter().filter(|s| s.name == "attempt").count() >= 8 && t.iter().filter(|s| s.name == "delivery_relay").count() >= 6
            })
            .await,
    );
    receiver.wait_at("/ok", 1, Duration::from_secs(5)).await;
    api.kill9().await?;
    dispatcher.kill9().await?;

    let publish = one(&spans, "publish_event");
    assert_eq!(
        (publish.service.as_str(), publish.parent_span_id.as_str()),
        ("relay-api", CALLER_SPAN),
        "the REST call joins the caller's trace"
    );
    // The spans the first attempts continue, from the publish on.
    let mut path: Vec<&CollectedSpan> = vec![publish];
    let handed_over_by = match way {
        Way::Events => {
            let outbox = one(&spans, "outbox_relay");
            assert_eq!((outbox.service.as_str(), &outbox.parent_span_id), ("relay-api", &publish.span_id), "outbox after the publish");
            let expand_event = one(&spans, "expand_event");
            assert_eq!(
                (expand_event.service.as_str(), &expand_event.parent_span_id),
                ("relay-dispatcher", &outbox.span_id),
                "through NATS headers"
            );
            let expand = one(&spans, "expand");
            assert_eq!(
                (expand.service.as_str(), &expand.parent_span_id),
                ("relay-api", &expand_event.span_id),
                "its traceparent rides in the batched Expand item"
            );
            path.extend([outbox, expand_event, expand]);
            expand_event
        }
        Way::AtPublish => {
            assert!(spans.iter().all(|s| s.name != "outbox_relay" && s.name != "expand_event"), "never through EVENTS");
            let expand = one(&spans, "expand");
            assert_eq!(
                (expand.service.as_str(), &expand.parent_span_id, expand.attribute("at_publish")),
                ("relay-api", &publish.span_id, Some("true")),
                "expanded by the api, beneath the publish"
            );
            path.push(expand);
            expand
        }
    };
    let expand = one(&spans, "expand");
    assert_eq!(expand.attribute("created"), Some("2"));

    let relays: Vec<&CollectedSpan> = spans.iter().filter(|s| s.name == "delivery_relay").collect();
    let attempts: Vec<&CollectedSpan> = spans.iter().filter(|s| s.name == "attempt").collect();
    // The first attempts come back with their expansion into the
    // dispatcher's hands; each retry is handed out by the relay.
    assert_eq!((relays.len(), attempts.len()), (6, 8), "one relay span per retry and one attempt span per attempt: {spans:#?}");
    for r in &relays {
        assert_eq!(r.parent_span_id, expand.span_id, "every retry's relay continues the expansion (stored with the row)");
    }
    let mut statuses: Vec<&str> = attempts.iter().map(|a| a.attribute("http_status").unwrap_or("none")).collect();
    statuses.sort();
    assert_eq!(statuses, ["200", "500", "500", "500", "500", "500", "500", "500"]);
    for a in &attempts {
        assert_eq!(a.service, "relay-dispatcher");
        if a.attribute("attempt") == Some("1") {
            assert_eq!(a.parent_span_id, handed_over_by.span_id, "a first attempt continues the expansion that handed it over: {a:?}");
        } else {
            assert!(relays.iter().any(|r| r.span_id == a.parent_span_id), "retry {a:?} hangs off a relay span");
        }
        assert!(a.attribute("outcome").is_some(), "the recorded decision is on the attempt: {a:?}");
    }
    let mut numbers: Vec<&str> =
        attempts.iter().filter(|a| a.attribute("http_status") == Some("500")).filter_map(|a| a.attribute("attempt")).collect();
    numbers.sort();
    assert_eq!(numbers, ["1", "2", "3", "4", "5", "6", "7"]);

    // The hop-by-hop timeline of the delivered attempt, printed for the
    // record (`--nocapture`): each span's start after the publish began, and
    // its length. Every step starts after the one it continues.
    let delivered = attempts.iter().find(|a| a.attribute("http_status") == Some("200")).expect("the 200");
    path.push(delivered);
    let t0 = publish.start_unix_nanos;
    let ms = |ns: u64| ns as f64 / 1e6;
    for s in &path {
        println!(
            "trace timeline: {:>14} {:>16}  starts at {:>8.3} ms, lasts {:>8.3} ms",
            s.name,
            s.service,
            ms(s.start_unix_nanos.saturating_sub(t0)),
            ms(s.end_unix_nanos.saturating_sub(s.start_unix_nanos))
        );
    }
    for pair in path.windows(2) {
        assert!(pair[1].start_unix_nanos >= pair[0].start_unix_nanos, "{} starts before {}", pair[1].name, pair[0].name);
    }

    // Nothing sensitive in any exported span, ours or not.
    let secret_parts = [ok_secret.trim_start_matches("whsec_"), failing_secret.trim_start_matches("whsec_")];
    for s in collector.spans() {
        for (k, v) in &s.attributes {
            assert!(!v.contains(marker), "payload in span {} attribute {k}", s.name);
            assert!(!v.contains(&tenant.api_key), "API key in span {} attribute {k}", s.name);
            for p in secret_parts {
                assert!(!v.contains(p), "signing secret in span {} attribute {k}", s.name);
            }
        }
    }
    stack.stop().await
}
