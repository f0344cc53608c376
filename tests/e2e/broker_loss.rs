//! The broker losing what it acknowledged: messages gone across a kill, a
//! store gone altogether. Each loss is made certain on a broker of the
//! test's own, and the events must still arrive.

use std::{collections::HashSet, time::Duration};

use async_nats::jetstream;
use relay_contracts::StreamNames;
use relay_tests::{Options, PrivateNats, Receiver, Rest, Stack, eventually};
use serde_json::json;

use crate::faults::arrivals;

/// A broker killed outright can come back without messages it had
/// acknowledged (not yet on its disk): here the EVENTS stream is emptied
/// before the kill, the loss made certain. The api, seeing its connection
/// come back, puts the published events no expansion took back in the
/// outbox, and they are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_the_broker_lost_after_acknowledging_them_are_published_again_when_it_is_back() -> anyhow::Result<()> {
    let mut nats = PrivateNats::start().await?;
    let mut stack = Stack::start(Options { nats_url: nats.url(), dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("broker-loss").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/lost"), &["l"]).await?;
    let (published, pg) = publish_five_and_lose_them(&stack, &nats, &rest).await?;
    nats.kill9().await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    nats.resume().await?;
    stack.start_dispatcher().await?;
    let arrived = eventually(Duration::from_secs(40), || async {
        let (_, distinct) = arrivals(&receiver, "/lost");
        (distinct == published).then_some(())
    })
    .await;
    assert!(arrived.is_some(), "every event the broker lost arrived: got {:?} of {published:?}", arrivals(&receiver, "/lost").1);
    let (all, _) = arrivals(&receiver, "/lost");
    assert_eq!(all.len(), published.len(), "each once: {all:?}");
    pg.close().await;
    stack.stop().await
}

/// The api that published events the broker then lost can die before it
/// looks, and the api started in its place remembers nothing it published:
/// here the EVENTS stream is emptied, the api stopped, the broker killed
/// and brought back while no api runs, and only then an api started. It
/// looks at its start, and every event arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_the_broker_lost_arrive_when_the_api_that_published_them_died_before_it_looked() -> anyhow::Result<()> {
    let mut nats = PrivateNats::start().await?;
    let mut stack = Stack::start(Options { nats_url: nats.url(), dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("broker-loss-restart").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/lost"), &["l"]).await?;
    let (published, pg) = publish_five_and_lose_them(&stack, &nats, &rest).await?;
    stack.stop_api().await?;
    nats.kill9().await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    nats.resume().await?;
    stack.start_api().await?;
    stack.start_dispatcher().await?;
    let arrived = eventually(Duration::from_secs(40), || async {
        let (_, distinct) = arrivals(&receiver, "/lost");
        (distinct == published).then_some(())
    })
    .await;
    assert!(arrived.is_some(), "every event the broker lost arrived: got {:?} of {published:?}", arrivals(&receiver, "/lost").1);
    let (all, _) = arrivals(&receiver, "/lost");
    assert_eq!(all.len(), published.len(), "each once: {all:?}");
    let unpublished: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NULL").fetch_one(&pg).await?;
    assert_eq!(unpublished, 0, "published again and marked");
    pg.close().await;
    stack.stop().await
}

/// A broker that comes back without its store (streams and consumers
/// gone): the api creates the streams again, the dispatcher its consumers,
/// and events published after the return are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_back_without_its_streams_gets_them_again_and_events_flow() -> anyhow::Result<()> {
    let mut nats = PrivateNats::start().await?;
    let stack = Stack::start(Options { nats_url: nats.url(), ..Options::default() }).await?;
    let tenant = stack.tenant("broker-wiped").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/w"), &["w"]).await?;
    let before = rest.publish("w", json!({"before": true})).await?;
    assert_eq!(receiver.wait_at("/w", 1, Duration::from_secs(20)).await.len(), 1);
    nats.kill9().await?;
    nats.wipe_store()?;
    nats.resume().await?;
    let mut published = HashSet::from([before]);
    for i in 0..3 {
        published.insert(rest.publish("w", json!({"after": i})).await?);
    }
    let arrived = eventually(Duration::from_secs(40), || async {
        let (_, distinct) = arrivals(&receiver, "/w");
        (distinct == published).then_some(())
    })
    .await;
    assert!(arrived.is_some(), "events published after the return arrived: got {:?} of {published:?}", arrivals(&receiver, "/w").1);
    stack.stop().await
}

/// Publishes five events, waits for the outbox to mark them published (the
/// broker acknowledged them), then empties EVENTS: the loss made certain.
async fn publish_five_and_lose_them(stack: &Stack, nats: &PrivateNats, rest: &Rest) -> anyhow::Result<(HashSet<String>, sqlx::PgPool)> {
    let mut published = HashSet::new();
    for i in 0..5 {
        published.insert(rest.publish("l", json!({"i": i})).await?);
    }
    let pg = stack.pg().await?;
    let marked = eventually(Duration::from_secs(20), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NOT NULL").fetch_one(&pg).await.ok()?;
        (n == 5).then_some(n)
    })
    .await;
    assert_eq!(marked, Some(5), "the broker acknowledged all five and the outbox marked them");
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let names = StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
    js.get_stream(names.events_stream()).await?.purge().await?;
    Ok((published, pg))
}
