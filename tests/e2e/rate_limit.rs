//! Issue 27.3: an endpoint's rate limit, enforced. 200 events published at
//! once to an endpoint limited to 5 a second (bursts of 5) all arrive, never
//! more than 5 + 5 in any second, none of them counted as a failure, while
//! an unlimited endpoint of the same events gets them all at once; the same
//! with two apis and two dispatchers (the limit is the endpoint's, not a
//! process's). And the field's rules.

use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use relay_tests::{Options, Receiver, Rest, Stack};
use serde_json::json;

const EVENTS: usize = 200;
const RATE: usize = 5;
const BURST: usize = 5;

/// Publishes `EVENTS` events at once, 16 at a time, round robin over the
/// apis; the instant the last was accepted.
async fn publish_all(rests: &[Rest]) -> anyhow::Result<Instant> {
    let results: Vec<anyhow::Result<String>> =
        stream::iter(0..EVENTS).map(|n| rests[n % rests.len()].publish("rl", json!({"n": n}))).buffer_unordered(16).collect().await;
    for r in results {
        r?;
    }
    Ok(Instant::now())
}

/// The most arrivals within any one second (a window opening at each).
fn busiest_second(times: &[Instant]) -> usize {
    let mut sorted = times.to_vec();
    sorted.sort();
    (0..sorted.len()).map(|i| sorted[i..].iter().take_while(|t| **t < sorted[i] + Duration::from_secs(1)).count()).max().unwrap_or(0)
}

async fn limited_and_free(rests: &[Rest], receiver: &Receiver) -> anyhow::Result<String> {
    let (status, limited) = rests[0]
        .post(
            "/v1/webhooks",
            json!({"url": receiver.url("/limited"), "event_types": ["rl"], "rate_limit": {"per_second": RATE, "burst": BURST}}),
        )
        .await?;
    assert_eq!((status, &limited["endpoint"]["rate_limit"]), (201, &json!({"per_second": RATE, "burst": BURST})), "{limited}");
    rests[0].endpoint(&receiver.url("/free"), &["rl"]).await?;
    Ok(limited["endpoint"]["id"].as_str().unwrap_or_default().to_owned())
}

/// All arrive, at the limit, none failed; the free endpoint is not held back.
async fn assert_paced(stack: &Stack, receiver: &Receiver, limited: &str, published: Instant) -> anyhow::Result<()> {
    let free = receiver.wait_at("/free", EVENTS, Duration::from_secs(30)).await;
    assert_eq!(free.len(), EVENTS, "the unlimited endpoint gets every event");
    let free_done = free.iter().map(|r| r.at).max().unwrap();
    let limited_by_then = receiver.at("/limited").iter().filter(|r| r.at <= free_done).count();
    assert!(
        limited_by_then < EVENTS / 2,
        "the unlimited endpoint was done ({:?} after publishing) before the limited one had half ({limited_by_then})",
        free_done.saturating_duration_since(published)
    );
    // (200 - 5) / 5 a second = 39 s at the limit; the bound leaves room for a slow machine.
    let got = receiver.wait_at("/limited", EVENTS, Duration::from_secs(90)).await;
    assert_eq!(got.len(), EVENTS, "every event reaches the limited endpoint");
    let ids: std::collections::HashSet<String> = got.iter().map(|r| r.header("relay-webhook-id")).collect();
    assert_eq!(ids.len(), EVENTS, "each once");
    let times: Vec<Instant> = got.iter().map(|r| r.at).collect();
    // The gate lets at most RATE × T + BURST go in any T. Arrival times
    // carry the hops' jitter (relay pass, broker, dispatcher, receiver):
    // one emission interval of it (1/RATE s) turns a second of arrivals
    // into 1 + 1/RATE s of sends, so one more than RATE + BURST can arrive
    // in a second without the gate letting more through (CI, under the
    // full suite, once saw 11). A gate that let the events go at once
    // would put dozens in one second.
    let busiest = busiest_second(&times);
    assert!(
        busiest <= RATE + BURST + 1,
        "{busiest} arrived within one second at a limit of {RATE}/s, bursts of {BURST} (and one emission interval of jitter)"
    );
    let first = *times.iter().min().unwrap();
    let span = times.iter().max().unwrap().duration_since(first);
    assert!(span >= Duration::from_secs(((EVENTS - BURST) / RATE - 2) as u64), "{EVENTS} arrived within {span:?}: not paced");
    // Waiting for the gate is not failing: every delivery went on its first attempt.
    let pg = stack.pg().await?;
    let (most, failures): (i32, i32) = sqlx::query_as(
        "SELECT (SELECT max(attempt) FROM webhook_deliveries WHERE endpoint_id = $1::uuid),
                (SELECT consecutive_failures FROM endpoint_health WHERE endpoint_id = $1::uuid)",
    )
    .bind(limited)
    .fetch_one(&pg)
    .await?;
    assert_eq!((most, failures), (1, 0), "no attempt beyond the first, no failure counted");
    pg.close().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_endpoint_gets_every_event_at_its_rate_and_others_are_not_slowed() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("rate").await?;
    let receiver = Receiver::start().await?;
    let rests = [Rest::new(&stack.rest_url, Some(&tenant.api_key))];
    let limited = limited_and_free(&rests, &receiver).await?;
    let published = publish_all(&rests).await?;
    assert_paced(&stack, &receiver, &limited, published).await?;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_is_the_endpoints_across_two_apis_and_two_dispatchers() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options::default()).await?;
    let (replica_rest, replica_internal) = stack.start_api_replica().await?;
    let mut second = stack.dispatcher_config();
    second.api_url = replica_internal;
    // From its own address, so the receiver tells the two apart.
    second.source_address = Some("127.0.0.2".parse()?);
    stack.start_dispatcher_with(second).await?;
    let tenant = stack.tenant("rate-2x2").await?;
    let receiver = Receiver::start().await?;
    let rests = [Rest::new(&stack.rest_url, Some(&tenant.api_key)), Rest::new(&replica_rest, Some(&tenant.api_key))];
    let limited = limited_and_free(&rests, &receiver).await?;
    let published = publish_all(&rests).await?;
    assert_paced(&stack, &receiver, &limited, published).await?;
    // Both dispatchers sent to the limited endpoint: the limit held across them.
    let senders: std::collections::HashSet<String> = receiver.at("/limited").iter().map(|r| r.peer.ip().to_string()).collect();
    assert_eq!(senders, ["127.0.0.1", "127.0.0.2"].map(String::from).into(), "both dispatchers sent to it");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_validated_and_can_be_removed() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("rate-rules").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let url = "http://127.0.0.1:9/rl";
    for (limit, words) in [
        (json!({"per_second": 0}), "got 0"),
        (json!({"per_second": 10001}), "got 10001"),
        (json!({"per_second": 5, "burst": 10001}), "burst must be 1–10000, got 10001"),
    ] {
        let (status, body) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["rl"], "rate_limit": limit})).await?;
        assert_eq!((status, body["reason"].as_str()), (400, Some("rate_limit_out_of_range")), "{body}");
        assert!(body["message"].as_str().unwrap_or_default().contains(words), "{body} should say {words}");
    }
    // (A string of digits is a number in proto3 JSON, so "5" is not among them.)
    for wrong in [json!({"per_second": -1}), json!({"per_second": "five"}), json!(5), json!({"per_second": 1e30})] {
        let (status, body) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["rl"], "rate_limit": wrong})).await?;
        assert_eq!(status, 400, "{wrong}: {body}");
    }
    let (status, created) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["rl"], "rate_limit": {"per_second": 20}})).await?;
    assert_eq!((status, &created["endpoint"]["rate_limit"]), (201, &json!({"per_second": 20, "burst": 1})), "burst defaults to 1");
    let path = format!("/v1/webhooks/{}", created["endpoint"]["id"].as_str().unwrap());
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"url": url}))).await?;
    assert_eq!((status, &body["endpoint"]["rate_limit"]), (200, &json!({"per_second": 20, "burst": 1})), "kept: {body}");
    let both = json!({"rate_limit": {"per_second": 1}, "clear_rate_limit": true});
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(both)).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("rate_limit_out_of_range")), "{body}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"clear_rate_limit": true}))).await?;
    assert_eq!((status, &body["endpoint"]["rate_limit"]), (200, &serde_json::Value::Null), "{body}");
    Ok(())
}
