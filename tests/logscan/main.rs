//! Runs a full flow with every crate logging at TRACE into memory, then looks
//! for the secrets, API keys, key material and payloads it created: none may
//! appear in any log line.

use std::{
    io::Write,
    sync::{Arc, Mutex},
    time::Duration,
};

use base64::{Engine, engine::general_purpose::STANDARD};
use relay_tests::{
    Options, Receiver, Reply, Rest, Stack, eventually,
    flaky::{Behaviour, Flaky},
};
use serde_json::json;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("not poisoned").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_flow_at_trace_level_logs_no_secret_key_or_payload() -> anyhow::Result<()> {
    let captured = Captured::default();
    let sink = captured.clone();
    // The services' own filter policy, asked for everything at TRACE.
    tracing_subscriber::fmt()
        .with_env_filter(relay_telemetry::filter("trace"))
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .try_init()
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    let key_material = STANDARD.encode([0x5au8; 32]);
    let stack = Stack::start(Options { secret_keys: Some(format!("scan:{key_material}")), ..Options::default() }).await?;
    let tenant = stack.tenant("logscan").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, first_secret) = rest.endpoint(&receiver.url("/scan"), &["scan.me"]).await?;
    let (status, rotated) = rest.post(&format!("/v1/webhooks/{endpoint_id}/rotate-secret"), json!({})).await?;
    assert_eq!(status, 200);
    let second_secret = rotated["secret"].as_str().unwrap().to_owned();
    // The failing paths log most: a receiver that accepts only retries, and
    // one that fails every attempt until the delivery is a dead letter.
    receiver.reply("/retried", Reply::Flaky(Flaky::new(Behaviour::FailFirst(500))));
    receiver.reply("/dead", Reply::Status(500));
    rest.endpoint(&receiver.url("/retried"), &["scan.me"]).await?;
    rest.endpoint(&receiver.url("/dead"), &["scan.me"]).await?;
    let marker = format!("payload-marker-{}", uuid::Uuid::new_v4().simple());
    let event_id = rest.publish("scan.me", json!({"card": marker})).await?;
    assert_eq!(receiver.wait_at("/scan", 1, Duration::from_secs(20)).await.len(), 1);
    let ended = eventually(Duration::from_secs(20), || async {
        let d = rest.deliveries(&event_id).await.ok()?;
        let states: Vec<&str> = d.iter().filter_map(|d| d["state"].as_str()).collect();
        let attempts: Vec<u64> = d.iter().filter_map(|d| d["attempt"].as_u64()).collect();
        (states.iter().filter(|s| **s == "DELIVERY_STATE_DELIVERED").count() == 2 && states.contains(&"DELIVERY_STATE_DEAD"))
            .then_some(attempts)
    })
    .await
    .expect("delivered at two endpoints, dead at the third");
    let mut attempts = ended;
    attempts.sort();
    assert_eq!(attempts, [1, 2, 7], "one first try, one retry, seven failures");
    stack.stop().await?;

    let logs = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    // The capture is real: it saw the flow at trace level, failures included.
    assert!(logs.contains("attempt recorded") && logs.contains("TRACE"), "the capture saw nothing useful ({} bytes)", logs.len());
    let failed = logs.lines().filter(|l| l.contains("attempt recorded") && l.contains("status=Some(500)")).count();
    assert!(failed >= 8, "the failed attempts were logged: {failed} of 8 (one before the retry, seven to the dead letter)");
    assert!(logs.contains(&event_id), "ids are fine to log, and were");
    // The random parts (base64url may itself contain '_', so split on the
    // known prefixes, never on the last '_').
    let api_key_secret = tenant.api_key.strip_prefix("rk_").and_then(|r| r.split_once('_')).map(|(_, s)| s.to_owned()).unwrap();
    let secret_random = |s: &str| s.strip_prefix("whsec_").unwrap().to_owned();
    for (what, needle) in [
        ("the API key", tenant.api_key.clone()),
        ("the API key's secret part", api_key_secret),
        ("the first signing secret", first_secret.clone()),
        ("the first signing secret's random part", secret_random(&first_secret)),
        ("the rotated signing secret's random part", secret_random(&second_secret)),
        ("the rotated signing secret", second_secret.clone()),
        ("the secrets key material", key_material.clone()),
        ("the event payload", marker.clone()),
    ] {
        let hits: Vec<&str> = logs.lines().filter(|l| l.contains(&needle)).take(3).collect();
        assert!(hits.is_empty(), "{what} appears in the logs:\n{}", hits.join("\n"));
    }
    Ok(())
}
