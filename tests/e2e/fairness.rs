//! Fair turns where events queue before their expansion: a quiet
//! environment's event is not held behind another environment's backlog in
//! the outbox relay (see the api's `relay::outbox::OutboxRelay::first_turns`),
//! nor behind a burst's batch in the api's expansion queue (the express
//! queue, `app::expansion_queues`), and events of one ordering key keep
//! their order when they take both queues.

use std::{collections::BTreeMap, time::Duration};

use relay_tests::{Options, Receiver, Rest, Stack};
use serde_json::json;

use crate::ordered_delivery::{ordered_endpoint, publish_keyed};

/// How many of these events the outbox has marked published (the broker has them).
async fn published(pg: &sqlx::PgPool, ids: &[String]) -> anyhow::Result<usize> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE id::text = ANY($1) AND published_at IS NOT NULL")
        .bind(ids)
        .fetch_one(pg)
        .await?;
    Ok(n as usize)
}

/// The EVENTS stream at its backlog limit, full of one environment's burst
/// (the dispatchers stopped, so nothing is taken from it): another
/// environment's event still goes to the broker at once, past the limit,
/// while the burst's events wait in the outbox, and an event with an
/// ordering key keeps the outbox's order (it waits too). When the
/// dispatchers are back every event arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_environments_event_goes_past_a_bursts_backlog_in_the_stream() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { events_backlog: 4, ..Options::default() }).await?;
    let receiver = Receiver::start().await?;
    let burst = Rest::new(&stack.rest_url, Some(&stack.tenant("burst").await?.api_key));
    let quiet = Rest::new(&stack.rest_url, Some(&stack.tenant("quiet").await?.api_key));
    let keyed = Rest::new(&stack.rest_url, Some(&stack.tenant("keyed").await?.api_key));
    burst.endpoint(&receiver.url("/burst"), &["b"]).await?;
    quiet.endpoint(&receiver.url("/quiet"), &["q"]).await?;
    ordered_endpoint(&keyed, &receiver, "/keyed", json!({})).await?;
    // Delivered: the dispatcher has created the EVENTS consumer whose
    // backlog the relay measures.
    burst.publish("b", json!({"warm": true})).await?;
    assert_eq!(receiver.wait_for(1, Duration::from_secs(20)).await.len(), 1, "the burst's environment delivers");
    stack.stop_dispatchers().await?;

    const BURST: usize = 40;
    let publishes = (0..BURST).map(|n| burst.publish("b", json!({"n": n})));
    let burst_ids: Vec<String> = futures::future::try_join_all(publishes).await?;
    let pg = stack.pg().await?;
    // The stream holds its limit of the burst, and the rest of the burst waits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stack.consumer_info(false).await?.num_pending < 4 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(stack.consumer_info(false).await?.num_pending >= 4, "the burst did not fill the stream to its limit in 10 s");
    tokio::time::sleep(Duration::from_millis(50)).await;

    let quiet_id = quiet.publish("q", json!({"quiet": true})).await?;
    let (keyed_id, _) = publish_keyed(&keyed, "k", json!({"keyed": true})).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while published(&pg, std::slice::from_ref(&quiet_id)).await? == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        published(&pg, std::slice::from_ref(&quiet_id)).await?,
        1,
        "the quiet environment's event waited behind the burst's backlog"
    );
    let burst_published = published(&pg, &burst_ids).await?;
    assert!(burst_published < BURST, "the stream's limit held none of the burst back ({burst_published} of {BURST} published)");
    assert_eq!(published(&pg, std::slice::from_ref(&keyed_id)).await?, 0, "an event with an ordering key went past the outbox's order");

    stack.start_dispatcher().await?;
    let all = receiver.wait_for(1 + BURST + 2, Duration::from_secs(60)).await;
    assert_eq!(all.len(), 1 + BURST + 2, "every event arrives once the dispatcher is back");
    let mut ids: Vec<String> = all.iter().map(|r| r.header("relay-webhook-id")).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 1 + BURST + 2, "no event arrived twice");
    stack.stop().await
}

/// One environment bursts while another publishes events of a few keys,
/// each key's one after another: the keyed environment's asks, alone of
/// theirs beside the burst's, take the api's express expansion queue, and
/// the next of the same environment the main one, so two events of a key
/// are at times expanded side by side. Each key still arrives in publish
/// order, numbered 1, 2, 3…, every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_environment_beside_a_burst_keeps_each_keys_order_across_both_expansion_queues() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let receiver = Receiver::start().await?;
    let (burst_key, keyed_key) = (stack.tenant("burst").await?.api_key, stack.tenant("keyed").await?.api_key);
    let client = |key: &str| Rest::new(&stack.rest_url, Some(key));
    let (burst, keyed) = (client(&burst_key), client(&keyed_key));
    for n in 0..5 {
        burst.endpoint(&receiver.url(&format!("/burst/{n}")), &["b"]).await?;
    }
    ordered_endpoint(&keyed, &receiver, "/keyed", json!({})).await?;
    let express = "relay_expansion_asks_total{queue=\"express\"}";
    let expressed_before = stack.metric(express).await?.unwrap_or(0.0);

    const BURST: usize = 400;
    const KEYS: usize = 4;
    const EACH: u64 = 25;
    let bursting = {
        let burst = client(&burst_key);
        tokio::spawn(async move {
            // 16 publishes at a time, as fast as they are accepted.
            let mut ids = Vec::new();
            for chunk in (0..BURST).collect::<Vec<_>>().chunks(16) {
                let publishes = chunk.iter().map(|n| burst.publish("b", json!({"n": n})));
                ids.extend(futures::future::try_join_all(publishes).await?);
            }
            anyhow::Ok(ids)
        })
    };
    let mut keys = Vec::new();
    for k in 0..KEYS {
        let keyed = client(&keyed_key);
        keys.push(tokio::spawn(async move {
            for n in 0..EACH {
                let key = format!("key-{k}");
                let (_, number) = publish_keyed(&keyed, &key, json!({"key": key, "n": n})).await?;
                anyhow::ensure!(number == n + 1, "{key}: event {n} numbered {number}");
            }
            anyhow::Ok(())
        }));
    }
    bursting.await??;
    for k in keys {
        k.await??;
    }

    let keyed_total = KEYS * EACH as usize;
    let got = receiver.wait_at("/keyed", keyed_total, Duration::from_secs(90)).await;
    assert_eq!(got.len(), keyed_total, "every keyed event arrives");
    let mut by_key: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    for request in &got {
        let body = request.json();
        let key = body["payload"]["key"].as_str().unwrap_or_default().to_owned();
        let sequence: u64 = request.header("relay-webhook-sequence").parse()?;
        by_key.entry(key).or_default().push((body["payload"]["n"].as_u64().unwrap_or(u64::MAX), sequence));
    }
    assert_eq!(by_key.len(), KEYS, "every key arrived");
    for (key, arrivals) in &by_key {
        let expected: Vec<(u64, u64)> = (0..EACH).map(|n| (n, n + 1)).collect();
        assert_eq!(arrivals, &expected, "{key}: arrivals (event, sequence) out of publish order or repeated");
    }
    let all = receiver.wait_for(BURST * 5 + keyed_total, Duration::from_secs(90)).await;
    assert_eq!(all.len(), BURST * 5 + keyed_total, "every delivery arrives");
    let mut ids: Vec<(String, String)> = all.iter().map(|r| (r.header("relay-webhook-id"), r.path.clone())).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), BURST * 5 + keyed_total, "no delivery arrived twice");
    let expressed = stack.metric(express).await?.unwrap_or(0.0) - expressed_before;
    assert!(expressed >= 1.0, "no expansion took the express queue beside the burst ({expressed})");
    stack.stop().await
}
