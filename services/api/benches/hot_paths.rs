//! The api's per-event CPU work without I/O: the REST facade's transcoder
//! (a publish body bound to its protobuf input and framed as the in-process
//! gRPC call) and the envelope encoder (the bytes every attempt sends).
//! `cargo bench -p relay-api`.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use relay_api::{
    app::events::{checked_payload, envelope},
    rest::BodyTranscoder,
};

/// A 1 KiB JSON payload, as the end-to-end benchmark publishes.
fn payload() -> String {
    serde_json::json!({"n": 42, "data": "x".repeat(1024 - 30), "nested": {"ok": true, "list": [1, 2, 3]}}).to_string()
}

fn transcoder(c: &mut Criterion) {
    let publish = BodyTranscoder::for_rule("POST", "/v1/events").expect("the publish rule");
    let body = serde_json::json!({"type": "invoice.paid", "payload": serde_json::from_str::<serde_json::Value>(&payload()).unwrap()})
        .to_string()
        .into_bytes();
    publish.frame(&body).expect("a valid publish body");
    let mut group = c.benchmark_group("transcoder");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("POST /v1/events, 1 KiB payload", |b| b.iter(|| publish.frame(black_box(&body)).expect("framed")));
    group.finish();
}

fn envelope_encoder(c: &mut Criterion) {
    let text = payload();
    let (id, environment) = (relay_domain::EventId::mint(), relay_domain::EnvironmentId::mint());
    let at = chrono::Utc::now();
    let mut group = c.benchmark_group("envelope");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("check and encode a 1 KiB payload", |b| {
        b.iter(|| {
            let raw = checked_payload(black_box(&text)).expect("valid JSON");
            envelope(id, "invoice.paid", environment, at, raw).expect("encoded")
        })
    });
    group.finish();
}

criterion_group!(benches, transcoder, envelope_encoder);
criterion_main!(benches);
