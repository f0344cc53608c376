//! Expansion at publish (the api's `app::at_publish`): while the outbox
//! relay keeps up, an event without an ordering key is expanded by the api
//! as it is published and its first attempts go straight to a dispatcher
//! over `TakeAttempts`, never through EVENTS; with the knob at 0 every
//! event takes the outbox relay and EVENTS as before.

use std::{collections::HashMap, time::Duration};

use relay_tests::{Options, Receiver, Reply, Rest, Stack, flaky};
use serde_json::json;

const AT_PUBLISH: &str = "relay_expanded_at_publish_total";

/// Messages EVENTS has had so far (what its consumer took and what waits).
async fn in_events(stack: &Stack) -> anyhow::Result<u64> {
    let info = stack.consumer_info(false).await?;
    Ok(info.delivered.stream_sequence + info.num_pending)
}

/// How many requests each event's webhooks made to `path`, by event id.
fn requests_by_event(receiver: &Receiver, path: &str) -> HashMap<String, usize> {
    let mut by_event = HashMap::new();
    for r in receiver.at(path) {
        *by_event.entry(r.json()["id"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
    }
    by_event
}

/// Publishes one event at a time until the api expands one at publish
/// (the dispatcher's stream is open), within 20 s; returns how many it
/// published.
async fn until_taken(stack: &Stack, tenant: &Rest) -> anyhow::Result<usize> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    while stack.metric(AT_PUBLISH).await?.unwrap_or(0.0) < 1.0 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no event was expanded at publish in 20 s ({n} published)");
        tenant.publish("warm", json!({"warm": n})).await?;
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(n)
}

/// Events published one after another, to a receiver that refuses each
/// webhook's first request ("not ready yet") and one that takes it: each
/// arrives at both, the refused one again on its retry, none of them is
/// published to EVENTS — now, or later by a look at the outbox, since
/// each is marked published — and each was counted as expanded at publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_expanded_at_publish_go_straight_to_the_dispatcher_and_never_through_events() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let receiver = Receiver::start().await?;
    let tenant = Rest::new(&stack.rest_url, Some(&stack.tenant("straight").await?.api_key));
    tenant.endpoint(&receiver.url("/warm"), &["warm"]).await?;
    tenant.endpoint(&receiver.url("/ok"), &["e"]).await?;
    tenant.endpoint(&receiver.url("/not-ready"), &["e"]).await?;
    receiver.reply("/not-ready", Reply::Flaky(flaky::Flaky::new(flaky::Behaviour::FailFirst(503))));
    let warm = until_taken(&stack, &tenant).await?;
    receiver.wait_at("/warm", warm, Duration::from_secs(20)).await;

    let events_before = in_events(&stack).await?;
    let taken_before = stack.metric(AT_PUBLISH).await?.unwrap_or(0.0);
    const EVENTS: usize = 20;
    let mut ids = Vec::new();
    for n in 0..EVENTS {
        ids.push(tenant.publish("e", json!({"n": n})).await?);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    receiver.wait_at("/ok", EVENTS, Duration::from_secs(20)).await;
    // A first attempt refused, then the retry 1 s later.
    receiver.wait_at("/not-ready", 2 * EVENTS, Duration::from_secs(30)).await;
    let taken = stack.metric(AT_PUBLISH).await?.unwrap_or(0.0) - taken_before;
    assert_eq!(taken, EVENTS as f64, "every event was expanded at publish");

    // Past the relay's backstop look (500 ms here), twice over: a look
    // that found one of them unmarked would have published it.
    let pg = stack.pg().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let marked: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE id::text = ANY($1) AND published_at IS NOT NULL")
            .bind(&ids)
            .fetch_one(&pg)
            .await?;
        if marked as usize == EVENTS {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{marked} of {EVENTS} events marked published after 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(in_events(&stack).await? - events_before, 0, "no event expanded at publish went to EVENTS");

    let (ok, not_ready) = (requests_by_event(&receiver, "/ok"), requests_by_event(&receiver, "/not-ready"));
    for id in &ids {
        assert_eq!(ok.get(id), Some(&1), "event {id} at the receiver that takes it: {:?}", ok.get(id));
        assert_eq!(not_ready.get(id), Some(&2), "event {id} refused once, then taken: {:?}", not_ready.get(id));
    }
    let delivered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries d JOIN events v ON v.id = d.event_id
         WHERE v.id::text = ANY($1) AND d.state = 'delivered'",
    )
    .bind(&ids)
    .fetch_one(&pg)
    .await?;
    assert_eq!(delivered as usize, 2 * EVENTS, "each event's two deliveries recorded delivered");
    Ok(())
}

/// With `RELAY_EXPAND_AT_PUBLISH=0` every event goes by the outbox relay
/// and EVENTS, and arrives as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_expansion_at_publish_off_every_event_goes_through_events() -> anyhow::Result<()> {
    let stack = Stack::start(Options { expand_at_publish: 0, ..Options::default() }).await?;
    let receiver = Receiver::start().await?;
    let tenant = Rest::new(&stack.rest_url, Some(&stack.tenant("long-way").await?.api_key));
    tenant.endpoint(&receiver.url("/e"), &["e"]).await?;
    tenant.publish("e", json!({"first": true})).await?;
    receiver.wait_at("/e", 1, Duration::from_secs(20)).await;
    let events_before = in_events(&stack).await?;
    const EVENTS: usize = 5;
    for n in 0..EVENTS {
        tenant.publish("e", json!({"n": n})).await?;
    }
    let got = receiver.wait_at("/e", EVENTS + 1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), EVENTS + 1, "every event arrived");
    assert_eq!(in_events(&stack).await? - events_before, EVENTS as u64, "each went through EVENTS");
    assert_eq!(stack.metric(AT_PUBLISH).await?.unwrap_or(0.0), 0.0, "none was expanded at publish");
    Ok(())
}

/// With the broker stopped, an event expanded at publish still reaches its
/// receiver on its first attempt: nothing between the publish and the POST
/// goes through the broker on this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_broker_stopped_an_event_expanded_at_publish_still_arrives() -> anyhow::Result<()> {
    let mut nats = relay_tests::PrivateNats::start().await?;
    let stack = Stack::start(Options { nats_url: nats.url(), ..Options::default() }).await?;
    let receiver = Receiver::start().await?;
    let tenant = Rest::new(&stack.rest_url, Some(&stack.tenant("no-broker").await?.api_key));
    tenant.endpoint(&receiver.url("/warm"), &["warm"]).await?;
    tenant.endpoint(&receiver.url("/e"), &["e"]).await?;
    until_taken(&stack, &tenant).await?;

    nats.stop().await?;
    let id = tenant.publish("e", json!({"while": "the broker is stopped"})).await?;
    let arrived = receiver.wait_for_event(&id, Duration::from_secs(10)).await;
    nats.resume().await?;
    assert!(arrived.is_some(), "the event did not arrive in 10 s with the broker stopped");
    stack.stop().await?;
    nats.stop().await
}
