//! Issue 29.2: `relay-dev listen`. The listener runs as a process against a
//! stack of two apis and two dispatchers; webhooks published through the
//! other api reach its local receiver signed exactly as webhooks (verified
//! with relay-webhook-verify); a local receiver that fails first gets the
//! retry, in the attempt log; a second listener with the same key is
//! refused; killing the listener removes its endpoint after the grace
//! period, its pending deliveries ending as dead letters `listener_gone`.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use relay_tests::{Options, Receiver, Reply, Rest, Stack, binary, flaky};
use relay_webhook_verify::Verifier;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

/// A running `relay-dev listen`, and what it said on starting.
struct Listener {
    child: tokio::process::Child,
    endpoint_id: String,
    secret: String,
}

async fn start_listener(grpc_url: &str, api_key: &str, forward_to: &str) -> anyhow::Result<Result<Listener, String>> {
    let mut child = tokio::process::Command::new(binary("relay-dev")?)
        .args(["listen", "--api", grpc_url, "--events", "order.paid,order.refunded", "--forward-to", forward_to])
        .env("RELAY_API_KEY", api_key)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let (mut endpoint_id, mut secret) = (None, None);
    let read = async {
        while let Some(line) = lines.next_line().await? {
            if let Some(v) = line.strip_prefix("endpoint_id=") {
                endpoint_id = Some(v.to_owned());
            } else if let Some(v) = line.strip_prefix("signing_secret=") {
                secret = Some(v.to_owned());
                break;
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(20), read).await??;
    // Keep reading its lines, so its stdout never fills.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    match (endpoint_id, secret) {
        (Some(endpoint_id), Some(secret)) => Ok(Ok(Listener { child, endpoint_id, secret })),
        _ => {
            let out = child.wait_with_output().await?;
            Ok(Err(format!("exit {:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr))))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_dev_listen_receives_signed_webhooks_retries_and_ends_with_its_process() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options::default().tiers("0,500,5000,5000,5000,5000,5000")).await?;
    let (replica_rest, replica_internal) = stack.start_api_replica().await?;
    let mut second = stack.dispatcher_config();
    second.api_url = replica_internal;
    stack.start_dispatcher_with(second).await?;
    let tenant = stack.tenant("listen").await?;
    let local = Receiver::start().await?;
    local.reply("/hooks", Reply::Flaky(flaky::Flaky::new(flaky::Behaviour::FailFirst(500))));

    let listener = start_listener(&stack.grpc_url, &tenant.api_key, &local.url("/hooks")).await?.map_err(anyhow::Error::msg)?;
    // Published through the other api, delivered by either dispatcher.
    let other_api = Rest::new(&replica_rest, Some(&tenant.api_key));
    let mut ids = Vec::new();
    for n in 0..6 {
        ids.push(other_api.publish("order.paid", json!({"n": n})).await?);
    }
    // Each event: refused once by the local receiver, then accepted.
    let got = local.wait_at("/hooks", 12, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 12, "each of 6 events twice (first refused)");
    let verifier = Verifier::relay_v1(&listener.secret).or(Verifier::standard(&listener.secret)?);
    for r in &got {
        let verified = verifier.verify(&r.headers, &r.body);
        assert!(verified.is_ok(), "a forwarded webhook verifies with the listener's secret: {verified:?}");
        assert!(ids.contains(&r.json()["id"].as_str().unwrap_or_default().to_owned()));
    }
    // The attempt log: attempt 1 refused 500, attempt 2 delivered.
    let deliveries = other_api.deliveries(&ids[0]).await?;
    let mine = deliveries.iter().find(|d| d["endpoint_id"] == listener.endpoint_id.as_str()).expect("the listener's delivery");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = other_api.deliveries(&ids[0]).await?;
        let d = now.iter().find(|d| d["endpoint_id"] == listener.endpoint_id.as_str()).expect("still there");
        if d["state"] == "DELIVERY_STATE_DELIVERED" {
            let statuses: Vec<u64> =
                d["attempts"].as_array().expect("attempts").iter().map(|a| a["http_status"].as_u64().unwrap_or(0)).collect();
            assert_eq!(statuses, [500, 200], "{d}");
            break;
        }
        assert!(Instant::now() < deadline, "never delivered: {mine}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The listener's endpoint counts against no quota, and shows as one.
    let endpoint = other_api.get(&format!("/v1/webhooks/{}", listener.endpoint_id)).await?;
    assert_eq!(endpoint["url"], "listen://relay-dev");
    // Its URL is its listener's: a new one is refused by name, and nothing changed.
    let (status, refused) = other_api
        .call(
            reqwest::Method::PATCH,
            &format!("/v1/webhooks/{}", listener.endpoint_id),
            Some(serde_json::json!({"url": "https://hooks.example.com/relay"})),
        )
        .await?;
    assert_eq!((status, refused["reason"].as_str()), (400, Some("listener_url_fixed")), "{refused}");
    assert_eq!(other_api.get(&format!("/v1/webhooks/{}", listener.endpoint_id)).await?["url"], "listen://relay-dev");

    // A second listener with the same key is refused while the first lives.
    let second = start_listener(&stack.grpc_url, &tenant.api_key, &local.url("/other")).await?;
    let refusal = second.err().expect("a second listener with the same key is refused");
    assert!(refusal.contains("already has a listener connected") && refusal.contains("exit Some(1)"), "{refusal}");

    // Killed: deliveries pending meanwhile end as dead letters listener_gone
    // once the grace period (2 s in tests) has passed, and the endpoint goes.
    let mut listener = listener;
    listener.child.kill().await?;
    listener.child.wait().await?;
    local.reply("/hooks", Reply::Status(200));
    let late = other_api.publish("order.refunded", json!({"late": true})).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _) = other_api.call(reqwest::Method::GET, &format!("/v1/webhooks/{}", listener.endpoint_id), None).await?;
        let letters = other_api.get("/v1/dead-letters").await?;
        let gone = letters["dead_letters"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|l| l["event_id"] == late.as_str() && l["reason"] == "listener_gone");
        if status == 404 && gone {
            break;
        }
        assert!(Instant::now() < deadline, "the endpoint ({status}) and its dead letter ({gone}) after the listener was killed: {letters}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And the key may listen again.
    let again = start_listener(&stack.grpc_url, &tenant.api_key, &local.url("/hooks")).await?.map_err(anyhow::Error::msg)?;
    assert_ne!(again.endpoint_id, listener.endpoint_id);
    Ok(())
}
