//! How attempts are sent: hanging endpoints never delay a healthy one,
//! redirects, timeouts and refused connections are failures with their cause,
//! the stored states are the code's, a backlog behind the cap goes out as
//! slots free, an answer is kept to its first 4 KiB, retries and replays go
//! to the endpoint's current URL.

use std::time::{Duration, Instant};

use relay_tests::{Options, Receiver, Reply, Rest, Stack, eventually};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_hanging_endpoints_do_not_delay_a_healthy_one() -> anyhow::Result<()> {
    const HANGING: usize = 100;
    const FAILING: usize = 5;
    const EVENTS: usize = 20;
    // The bound the healthy endpoint's publish-to-arrival latency must stay
    // within, while every hanging attempt takes the full 1 s timeout.
    const BOUND: Duration = Duration::from_millis(1500);
    let stack = Stack::start(Options {
        attempt_timeout: Duration::from_secs(1),
        ..Options::default().tiers("0,60000,60000,60000,60000,60000,60000")
    })
    .await?;
    let tenant = stack.tenant_with_quota("isolation", 110).await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for i in 0..HANGING {
        let path = format!("/hang/{i}");
        receiver.reply(&path, Reply::Hang(Duration::from_secs(5)));
        rest.endpoint(&receiver.url(&path), &["iso"]).await?;
    }
    for i in 0..FAILING {
        let path = format!("/fail/{i}");
        receiver.reply(&path, Reply::Status(500));
        rest.endpoint(&receiver.url(&path), &["iso"]).await?;
    }
    rest.endpoint(&receiver.url("/healthy"), &["iso"]).await?;

    let mut latencies = Vec::new();
    for n in 0..EVENTS {
        let published = Instant::now();
        let id = rest.publish("iso", json!({"n": n})).await?;
        let arrived = eventually(Duration::from_secs(10), || async {
            receiver.at("/healthy").into_iter().find(|r| r.header("relay-webhook-id") == id).map(|r| r.at)
        })
        .await
        .unwrap_or_else(|| panic!("event {n} never reached the healthy endpoint"));
        latencies.push(arrived - published);
    }
    latencies.sort();
    let worst = *latencies.last().unwrap();
    eprintln!("healthy endpoint beside {HANGING} hanging and {FAILING} failing: p50 {:?}, max {worst:?}", latencies[EVENTS / 2]);
    assert!(worst <= BOUND, "the healthy endpoint waited {worst:?} (bound {BOUND:?}): {latencies:?}");
    // The hanging endpoints were really being attempted all along.
    assert!(receiver.received().iter().filter(|r| r.path.starts_with("/hang/")).count() >= HANGING, "hanging endpoints were attempted");
    // The operator sees each endpoint's attempts in flight, never above the cap.
    let metrics = reqwest::get(&stack.metrics_url).await?.text().await?;
    let in_flight: Vec<i64> = metrics
        .lines()
        .filter(|l| l.starts_with("relay_endpoint_in_flight{endpoint_id="))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(in_flight.len() >= HANGING / 2, "in-flight gauges for the hanging endpoints: {metrics}");
    assert!(in_flight.iter().all(|n| (1..=4).contains(n)), "each within the cap of 4: {in_flight:?}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_timeouts_and_refused_connections_are_failures_with_their_cause_recorded() -> anyhow::Result<()> {
    let stack = Stack::start(Options { attempt_timeout: Duration::from_millis(700), ..Options::default().tiers("0") }).await?;
    let tenant = stack.tenant("failures").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/moved", Reply::Redirect(receiver.url("/target")));
    receiver.reply("/slow", Reply::Hang(Duration::from_secs(3)));
    receiver.reply("/teapot", Reply::Status(418));
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?; // bound, then dropped: nothing listens
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (moved, _) = rest.endpoint(&receiver.url("/moved"), &["f"]).await?;
    let (slow, _) = rest.endpoint(&receiver.url("/slow"), &["f"]).await?;
    let (teapot, _) = rest.endpoint(&receiver.url("/teapot"), &["f"]).await?;
    let (refused, _) = rest.endpoint(&format!("http://{closed}/hook"), &["f"]).await?;
    let (created, _) = rest.endpoint(&receiver.url("/created"), &["f"]).await?;
    receiver.reply("/created", Reply::Status(201));
    let event_id = rest.publish("f", json!({})).await?;

    let deliveries = eventually(Duration::from_secs(20), || async {
        let d = rest.deliveries(&event_id).await.ok()?;
        (d.len() == 5 && d.iter().all(|d| d["state"] != "DELIVERY_STATE_PENDING")).then_some(d)
    })
    .await
    .expect("every delivery finishes after its single attempt");
    let of = |endpoint: &str| deliveries.iter().find(|d| d["endpoint_id"] == endpoint).unwrap().clone();
    let last_attempt = |endpoint: &str| of(endpoint)["attempts"][0].clone();

    assert_eq!(of(&created)["state"], "DELIVERY_STATE_DELIVERED", "any 2xx is success");
    assert_eq!(of(&moved)["state"], "DELIVERY_STATE_DEAD", "a 3xx is a failure");
    assert_eq!(last_attempt(&moved)["http_status"], 302);
    assert!(receiver.at("/target").is_empty(), "the redirect was followed");
    assert_eq!(of(&teapot)["state"], "DELIVERY_STATE_DEAD");
    assert_eq!(last_attempt(&teapot)["http_status"], 418);

    let timeout = last_attempt(&slow);
    assert_eq!(of(&slow)["state"], "DELIVERY_STATE_DEAD", "a response after the timeout is a failure");
    assert!(timeout["http_status"].is_null(), "{timeout}");
    assert!(timeout["error"].as_str().unwrap().starts_with("timeout"), "{timeout}");
    let refusal = last_attempt(&refused);
    assert!(refusal["http_status"].is_null(), "{refusal}");
    assert!(refusal["error"].as_str().unwrap().starts_with("connect"), "{refusal}");

    let letters = rest.get("/v1/dead-letters").await?;
    assert_eq!(letters["dead_letters"].as_array().unwrap().len(), 4, "{letters}");
    stack.stop().await
}

/// Issue 10: the state column's CHECK constraint and the code's states are
/// the same set, so a state the code writes is never refused and a stored
/// state the code reads is always one it knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_states_are_exactly_the_states_the_code_knows() -> anyhow::Result<()> {
    use relay_domain::delivery::DeliveryState;
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let pg = stack.pg().await?;
    let check: String =
        sqlx::query_scalar("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'webhook_deliveries_state_check'")
            .fetch_one(&pg)
            .await?;
    let stored: std::collections::BTreeSet<&str> = check.split('\'').skip(1).step_by(2).collect();
    let known: std::collections::BTreeSet<&str> = DeliveryState::ALL.iter().map(|s| s.as_str()).collect();
    assert_eq!(stored, known, "{check}");
    pg.close().await;
    stack.stop().await
}

/// Issue 12: a backlog behind an endpoint's in-flight cap is handed to the
/// dispatcher that frees each slot, with the outcome that freed it, instead
/// of going through a relay pass and the broker; the cap still holds, and
/// every event arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_behind_the_cap_is_handed_back_with_the_outcomes_that_free_its_slots() -> anyhow::Result<()> {
    let stack = Stack::start(Options { endpoint_cap: 4, ..Options::default() }).await?;
    let tenant = stack.tenant("refill").await?;
    let receiver = Receiver::start().await?;
    // Slow enough that the events are all published while the first four are
    // still being sent: the other 36 wait for a slot.
    receiver.reply("/slow", Reply::Hang(Duration::from_millis(40)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, _) = rest.endpoint(&receiver.url("/slow"), &["r"]).await?;
    let pg = stack.pg().await?;
    let mut published = std::collections::HashSet::new();
    for i in 0..40 {
        published.insert(rest.publish("r", json!({"i": i})).await?);
    }
    // While they drain, the endpoint never has more than its cap handed out.
    let mut most = 0i64;
    let started = Instant::now();
    while receiver.at("/slow").len() < 40 && started.elapsed() < Duration::from_secs(30) {
        let leased: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM webhook_deliveries WHERE endpoint_id = $1::uuid AND state = 'pending' AND dispatched_at IS NOT NULL",
        )
        .bind(&endpoint_id)
        .fetch_one(&pg)
        .await?;
        most = most.max(leased);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ids: Vec<String> = receiver.at("/slow").iter().map(|r| r.header("relay-webhook-id")).collect();
    assert_eq!(ids.iter().cloned().collect::<std::collections::HashSet<_>>(), published, "every event arrived");
    assert_eq!(ids.len(), 40, "each once: {ids:?}");
    assert!(most <= 4, "{most} attempts handed out at once, past the cap of 4");
    // Four went with the expansion; of the 36 that waited, the relay handed
    // at most a few to the broker (one pass may run before the first
    // outcome frees a slot): the rest came back with the outcomes.
    let names = relay_contracts::StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
    let js = async_nats::jetstream::new(async_nats::connect(&stack.opts.nats_url).await?);
    let through_broker = js.get_stream(names.deliveries_stream()).await?.info().await?.state.messages;
    assert!(through_broker <= 8, "{through_broker} of 36 waiting deliveries went through DELIVERIES");
    pg.close().await;
    stack.stop().await
}

/// docs/webhooks.md: the attempt log keeps the first 4,096 bytes of a
/// receiver's answer, exactly, and no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attempt_log_keeps_an_answers_first_4096_bytes() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("body-cap").await?;
    let receiver = Receiver::start().await?;
    let answer: String = (0..10_000u32).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    receiver.reply("/big", Reply::Body(200, answer.clone()));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/big"), &["b"]).await?;
    let event_id = rest.publish("b", json!({})).await?;
    let done = crate::delivery::delivery_state(&rest, &event_id, "DELIVERY_STATE_DELIVERED", Duration::from_secs(20)).await;
    let kept = done["attempts"][0]["response_body"].as_str().unwrap_or_default();
    assert_eq!(kept.len(), relay_contracts::RESPONSE_BODY_KEPT_BYTES, "{done}");
    assert_eq!(kept, &answer[..relay_contracts::RESPONSE_BODY_KEPT_BYTES], "the first bytes, as sent");
    stack.stop().await
}

/// docs/webhooks.md: a retry, and a replay, go to the URL the endpoint has
/// when they are sent, not the one it had when the event came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_and_a_replay_go_to_the_endpoints_current_url() -> anyhow::Result<()> {
    // A second between the first two attempts, to move the endpoint in; then
    // the rest quickly, to make a dead letter.
    let stack = Stack::start(Options::default().tiers("0,1000,50,50,50,50,50")).await?;
    let tenant = stack.tenant("moved").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/old", Reply::Status(500));
    receiver.reply("/failing", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (id, _) = rest.endpoint(&receiver.url("/old"), &["m"]).await?;
    let moved = |to: &str| {
        let (rest, path, to) = (&rest, format!("/v1/webhooks/{id}"), receiver.url(to));
        async move {
            let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"url": to}))).await?;
            anyhow::ensure!(status == 200, "moving the endpoint answered {status}: {body}");
            anyhow::Ok(())
        }
    };

    let first = rest.publish("m", json!({"n": 1})).await?;
    assert_eq!(receiver.wait_at("/old", 1, Duration::from_secs(20)).await.len(), 1);
    moved("/new").await?;
    let done = crate::delivery::delivery_state(&rest, &first, "DELIVERY_STATE_DELIVERED", Duration::from_secs(20)).await;
    assert_eq!(done["attempt"], 2, "{done}");
    let at_new = receiver.at("/new");
    assert_eq!(at_new.len(), 1, "the retry went to the new URL");
    assert_eq!(at_new[0].header("relay-webhook-id"), first);
    assert_eq!(receiver.at("/old").len(), 1, "and nothing more to the old one");

    moved("/failing").await?;
    let second = rest.publish("m", json!({"n": 2})).await?;
    crate::delivery::delivery_state(&rest, &second, "DELIVERY_STATE_DEAD", Duration::from_secs(20)).await;
    moved("/fixed").await?;
    let letters = rest.get("/v1/dead-letters").await?;
    let letter = letters["dead_letters"].as_array().and_then(|l| l.iter().find(|l| l["event_id"] == second.as_str())).cloned();
    let letter = letter.unwrap_or_else(|| panic!("no dead letter for {second}: {letters}"));
    let (status, body) = rest.post(&format!("/v1/dead-letters/{}/replay", letter["id"].as_str().unwrap_or_default()), json!({})).await?;
    assert_eq!(status, 202, "{body}");
    let replayed = receiver.wait_at("/fixed", 1, Duration::from_secs(20)).await;
    assert_eq!(replayed.len(), 1, "the replay went to the endpoint's URL now");
    assert_eq!(replayed[0].header("relay-webhook-id"), second);
    stack.stop().await
}
