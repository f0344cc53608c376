//! Issue 27.3: an endpoint's `max_in_flight`. A receiver limited to one
//! never sees two requests overlap, even with two dispatchers sending, while
//! an endpoint left at the platform's cap is sent to by both at once; the
//! field is validated and can return to the default. With one dispatcher,
//! an endpoint's own cap is how many requests it gets at once.

use std::time::Duration;

use relay_tests::{Options, Receiver, Reply, Rest, Stack};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_limited_to_one_never_sees_two_requests_overlap_across_dispatchers() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options::default()).await?;
    stack.start_dispatcher().await?;
    let tenant = stack.tenant("in-flight").await?;
    let receiver = Receiver::start().await?;
    // Slow receivers: each answer takes 100 ms, so sends that may overlap do.
    for path in ["/one", "/many"] {
        receiver.reply(path, Reply::Hang(Duration::from_millis(100)));
    }
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (status, one) = rest.post("/v1/webhooks", json!({"url": receiver.url("/one"), "event_types": ["f"], "max_in_flight": 1})).await?;
    assert_eq!((status, &one["endpoint"]["max_in_flight"]), (201, &json!(1)), "{one}");
    let (_, many) = rest.post("/v1/webhooks", json!({"url": receiver.url("/many"), "event_types": ["f"]})).await?;
    assert!(many["endpoint"]["max_in_flight"].is_null(), "unset: the platform's cap: {many}");

    const EVENTS: usize = 30;
    for n in 0..EVENTS {
        rest.publish("f", json!({"n": n})).await?;
    }
    assert_eq!(receiver.wait_at("/one", EVENTS, Duration::from_secs(60)).await.len(), EVENTS, "every event reaches the limited one");
    assert_eq!(receiver.wait_at("/many", EVENTS, Duration::from_secs(60)).await.len(), EVENTS);
    assert_eq!(receiver.most_at_once("/one"), 1, "never two requests at once at the limited endpoint");
    // The same events with both dispatchers sending: without the limit they overlap.
    assert!(receiver.most_at_once("/many") >= 2, "the unlimited endpoint had {} at once", receiver.most_at_once("/many"));
    stack.stop().await
}

/// One dispatcher: an endpoint's own cap is how many requests it gets at
/// once (never more), also while its receiver refuses some of them; without
/// one, a dispatcher sends one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dispatcher_sends_up_to_the_endpoints_own_cap_at_once_and_never_more() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("in-flight-one").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/four", Reply::Hang(Duration::from_millis(150)));
    receiver.reply("/default", Reply::Hang(Duration::from_millis(150)));
    // Refuses each webhook's first request, answering slowly: retries and
    // first attempts mix, and the cap holds for both.
    receiver.reply("/flaky", Reply::Flaky(relay_tests::flaky::Flaky::new(relay_tests::flaky::Behaviour::FailFirst(503))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for (path, cap) in [("/four", json!(4)), ("/default", json!(null)), ("/flaky", json!(3))] {
        let (status, body) =
            rest.post("/v1/webhooks", json!({"url": receiver.url(path), "event_types": ["f"], "max_in_flight": cap})).await?;
        assert_eq!(status, 201, "{body}");
    }
    const EVENTS: usize = 40;
    for n in 0..EVENTS {
        rest.publish("f", json!({"n": n})).await?;
    }
    for path in ["/four", "/default"] {
        assert_eq!(receiver.wait_at(path, EVENTS, Duration::from_secs(60)).await.len(), EVENTS, "{path}: every event once");
    }
    let flaky = receiver.wait_at("/flaky", 2 * EVENTS, Duration::from_secs(60)).await;
    assert_eq!(flaky.len(), 2 * EVENTS, "/flaky: every event's refused first request and its retry");
    let four = receiver.most_at_once("/four");
    assert!((2..=4).contains(&four), "/four had {four} at once: its cap is 4, and it is sent to concurrently");
    assert_eq!(receiver.most_at_once("/default"), 1, "without a cap of its own, one dispatcher sends one at a time");
    assert!(receiver.most_at_once("/flaky") <= 3, "/flaky had {} at once, over its cap of 3", receiver.most_at_once("/flaky"));
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_is_validated_and_returns_to_the_default() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("in-flight-rules").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let url = "http://127.0.0.1:9/f";
    for bad in [1001, 100_000] {
        let (status, body) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["f"], "max_in_flight": bad})).await?;
        assert_eq!((status, body["reason"].as_str()), (400, Some("max_in_flight_out_of_range")), "{body}");
        assert!(body["message"].as_str().unwrap_or_default().contains(&bad.to_string()), "{body}");
    }
    let (status, body) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["f"], "max_in_flight": -1})).await?;
    assert_eq!(status, 400, "{body}");
    let (status, created) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["f"], "max_in_flight": 8})).await?;
    assert_eq!((status, &created["endpoint"]["max_in_flight"]), (201, &json!(8)), "{created}");
    let path = format!("/v1/webhooks/{}", created["endpoint"]["id"].as_str().unwrap());
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"max_in_flight": 1001}))).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("max_in_flight_out_of_range")), "{body}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"url": url}))).await?;
    assert_eq!((status, &body["endpoint"]["max_in_flight"]), (200, &json!(8)), "another change leaves it: {body}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"max_in_flight": 0}))).await?;
    assert_eq!(status, 200, "{body}");
    assert!(body["endpoint"]["max_in_flight"].is_null(), "0 returns to the platform's cap: {body}");
    stack.stop().await
}
