//! Failover: a NATS cluster losing nodes, Postgres crashing or failing over
//! to its standby, a dispatcher's api going away, a commit that cannot be
//! replicated — every acknowledged event arrives, and repeats only where a
//! fault caught an attempt in flight.

use crate::faults::{arrivals, missing_after, repeats_only_of};
use std::{collections::HashSet, time::Duration};

use async_nats::jetstream;
use relay_contracts::StreamNames;
use relay_tests::{Options, PrivateNats, Process, Receiver, Rest, Stack, eventually};
use serde_json::json;

/// Issue 14: on a 3-node JetStream cluster with both streams replicated ×3,
/// the node leading DELIVERIES is killed (SIGKILL) under publishing, comes
/// back, and then another node is killed: every event is delivered, nothing
/// is restarted but the broker nodes, and the api and dispatcher, given all
/// three servers, fail over on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_cluster_loses_its_deliveries_leader_then_another_node_and_every_event_arrives() -> anyhow::Result<()> {
    let mut cluster = relay_tests::NatsCluster::start().await?;
    let stack = Stack::start(Options { nats_url: cluster.url(), stream_replicas: 3, ..Options::default() }).await?;
    let tenant = stack.tenant("cluster").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/c"), &["c"]).await?;
    let mut published = HashSet::new();
    let publish = async |n: usize, published: &mut HashSet<String>| -> anyhow::Result<()> {
        for i in 0..n {
            published.insert(rest.publish("c", json!({ "i": i })).await?);
        }
        Ok(())
    };
    let all_arrive = async |published: &HashSet<String>, fault: &str| {
        let started = std::time::Instant::now();
        let missing = missing_after(&receiver, "/c", published, Duration::from_secs(60)).await;
        assert_eq!(missing, 0, "{missing} of {} events missing after {fault}", published.len());
        println!("cluster: after {fault}: every one of {} events arrived within {:?}", published.len(), started.elapsed());
    };

    publish(10, &mut published).await?;
    all_arrive(&published, "start-up").await;
    let deliveries = StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?.deliveries_stream();
    let js = jetstream::new(async_nats::connect(cluster.nodes[0].url()).await?);
    for name in [deliveries.clone(), StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?.events_stream()] {
        assert_eq!(js.get_stream(&name).await?.info().await?.config.num_replicas, 3, "{name} is replicated ×3");
    }

    // The leader of DELIVERIES dies mid-stream.
    let leader = cluster.leader_of(&deliveries).await?;
    cluster.nodes[leader].kill9().await?;
    publish(15, &mut published).await?;
    all_arrive(&published, "killing the DELIVERIES leader").await;

    // It comes back; then another node dies (two down at once would take the
    // streams' quorum, which is what three replicas cannot promise).
    cluster.nodes[leader].resume().await?;
    publish(10, &mut published).await?;
    all_arrive(&published, "the old leader's restart").await;
    let other = (leader + 1) % 3;
    cluster.nodes[other].kill9().await?;
    publish(15, &mut published).await?;
    all_arrive(&published, "killing a second node").await;
    cluster.nodes[other].resume().await?;

    // The schedule and the claims live in Postgres: a job the broker hands
    // out again finds its attempt recorded or in hand, and is not sent twice.
    let repeated = repeats_only_of(&receiver, "/c", &HashSet::new(), "losing broker nodes");
    println!("cluster: {} events, {repeated} repeated", published.len());
    assert_eq!(repeated, 0);
    stack.stop().await
}

/// Issue 14: the database goes away as in a crash (`pg_ctl stop -m
/// immediate`) and comes back; the api, never restarted, serves again on its
/// own, and every event it acknowledged is delivered — those before the
/// crash, and those after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_serves_again_after_its_postgres_crashes_and_restarts_and_no_acknowledged_event_is_lost() -> anyhow::Result<()> {
    let pg = relay_tests::PrivatePostgres::start().await?;
    let stack = Stack::start(Options { pg_port: pg.port, ..Options::default() }).await?;
    let tenant = stack.tenant("pg-crash").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/p"), &["p"]).await?;
    let mut acknowledged = HashSet::new();
    for i in 0..10 {
        acknowledged.insert(rest.publish("p", json!({ "before": i })).await?);
    }
    let before_crash = acknowledged.clone();

    pg.crash()?;
    // Down: a publish is refused (never acknowledged and then lost).
    let (status, body) = rest.post("/v1/events", json!({"type": "p", "payload": {"during": true}})).await?;
    assert!(status >= 500 || status == 429, "a publish while the database is down answered {status}: {body}");
    pg.resume()?;
    let started = std::time::Instant::now();
    let back = eventually(Duration::from_secs(30), || async {
        let (status, body) = rest.post("/v1/events", json!({"type": "p", "payload": {"after": 0}})).await.ok()?;
        (status == 202).then(|| body["event_id"].as_str().map(str::to_owned)).flatten()
    })
    .await;
    let first = back.ok_or_else(|| anyhow::anyhow!("the api did not accept a publish within 30 s of the database's return"))?;
    println!("postgres: the api accepted again {:?} after the database returned", started.elapsed());
    acknowledged.insert(first);
    for i in 1..10 {
        acknowledged.insert(rest.publish("p", json!({ "after": i })).await?);
    }
    let missing = missing_after(&receiver, "/p", &acknowledged, Duration::from_secs(60)).await;
    assert_eq!(missing, 0, "{missing} of {} acknowledged events never arrived", acknowledged.len());
    let repeated = repeats_only_of(&receiver, "/p", &before_crash, "the database's crash");
    println!("postgres: {} acknowledged, all arrived, {repeated} repeated", acknowledged.len());
    stack.stop().await
}

/// Publishes `id` until it is answered 202 (each try waits for its answer),
/// within `within`; how long that took.
async fn publish_until_accepted(rest: &Rest, id: &str, within: Duration) -> anyhow::Result<Duration> {
    let started = std::time::Instant::now();
    let accepted = eventually(within, || async {
        let (status, _) = rest.post("/v1/events", json!({"id": id, "type": "p", "payload": {"id": id}})).await.ok()?;
        (status == 202).then_some(())
    })
    .await;
    accepted.ok_or_else(|| anyhow::anyhow!("event {id} was not accepted within {within:?}"))?;
    Ok(started.elapsed())
}

/// Issue 14: a synchronous standby is promoted after its primary goes away
/// (`pg_ctl stop -m immediate`, then `pg_ctl promote`). The api, given both
/// servers libpq-style and never restarted, finds the new primary by itself,
/// accepts again within seconds, and every event it acknowledged — before
/// the failover and after — is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_follows_a_promoted_standby_and_no_acknowledged_event_is_lost() -> anyhow::Result<()> {
    let primary = relay_tests::PrivatePostgres::synchronous_primary().await?;
    let standby = relay_tests::PrivatePostgres::standby_of(&primary).await?;
    primary.wait_for_synchronous_standby().await?;
    let mut stack = Stack::start(Options { pg_port: primary.port, standby_pg_port: Some(standby.port), ..Options::default() }).await?;
    let tenant = stack.tenant("pg-failover").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/p"), &["p"]).await?;
    let mut acknowledged = HashSet::new();
    for _ in 0..10 {
        let id = uuid::Uuid::new_v4().to_string();
        publish_until_accepted(&rest, &id, Duration::from_secs(10)).await?;
        acknowledged.insert(id);
    }

    let before_crash = acknowledged.clone();
    primary.crash()?;
    // Down, not yet promoted: a publish is refused, never acknowledged and lost.
    let (status, body) = rest.post("/v1/events", json!({"type": "p", "payload": {"during": true}})).await?;
    assert!(status >= 500 || status == 429, "a publish with no primary answered {status}: {body}");
    standby.promote()?;
    let first = uuid::Uuid::new_v4().to_string();
    let took = publish_until_accepted(&rest, &first, Duration::from_secs(30)).await?;
    println!("postgres failover: the api accepted again {took:?} after the standby's promotion");
    assert!(took < Duration::from_secs(10), "the api took {took:?} to write to the promoted standby");
    acknowledged.insert(first);
    for _ in 0..9 {
        let id = uuid::Uuid::new_v4().to_string();
        publish_until_accepted(&rest, &id, Duration::from_secs(10)).await?;
        acknowledged.insert(id);
    }
    stack.db.moved_to(standby.port);
    let missing = missing_after(&receiver, "/p", &acknowledged, Duration::from_secs(60)).await;
    assert_eq!(missing, 0, "{missing} of {} acknowledged events never arrived", acknowledged.len());
    let repeated = repeats_only_of(&receiver, "/p", &before_crash, "the primary's loss");
    println!("postgres failover: {} acknowledged, all arrived, {repeated} repeated", acknowledged.len());
    stack.stop().await
}

/// Issue 14: a dispatcher given two apis (`RELAY_API_INTERNAL_URL` as a
/// list) carries on through the other when the one it calls goes away:
/// events published after the loss arrive without that api's return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_given_two_apis_carries_on_through_the_other_when_one_goes_away() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let (second_rest, second_internal) = stack.start_api_replica().await?;
    let mut cfg = stack.dispatcher_config();
    cfg.api_url = format!("{},{second_internal}", stack.internal_url);
    stack.start_dispatcher_with(cfg).await?;
    let tenant = stack.tenant("two-apis").await?;
    let receiver = Receiver::start().await?;
    let first = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    first.endpoint(&receiver.url("/a"), &["p"]).await?;
    let mut published = HashSet::new();
    for i in 0..5 {
        published.insert(first.publish("p", json!({ "before": i })).await?);
    }
    assert_eq!(missing_after(&receiver, "/a", &published, Duration::from_secs(30)).await, 0, "before the loss");

    // The api the dispatcher calls first goes away and stays away.
    stack.stop_api().await?;
    let second = Rest::new(&second_rest, Some(&tenant.api_key));
    let started = std::time::Instant::now();
    let mut after = HashSet::new();
    for i in 0..10 {
        after.insert(second.publish("p", json!({ "after": i })).await?);
    }
    let missing = missing_after(&receiver, "/a", &after, Duration::from_secs(30)).await;
    assert_eq!(missing, 0, "{missing} of 10 events published after the first api's loss never arrived");
    println!("two apis: all 10 events published after the loss arrived within {:?}", started.elapsed());
    stack.stop().await
}

/// Issue 14: the dispatcher's health port (`RELAY_HEALTH_ADDR`, what a
/// Kubernetes probe asks): `/healthz` answers while the process runs,
/// `/readyz` is 200 only while it is connected to NATS — 503 once the broker
/// is gone, 200 again after it returns, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatchers_readiness_follows_its_broker_connection() -> anyhow::Result<()> {
    let mut nats = PrivateNats::start().await?;
    let stack = Stack::start(Options { dispatcher: false, nats_url: nats.url(), ..Options::default() }).await?;
    let health = relay_tests::free_addr().await?;
    let mut env = stack.dispatcher_env();
    env.retain(|(k, _)| *k != "RELAY_HEALTH_ADDR");
    env.push(("RELAY_HEALTH_ADDR", health.to_string()));
    let dispatcher = Process::spawn("relay-dispatcher", &env)?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    let status = async |path: &str| http.get(format!("http://{health}{path}")).send().await.ok().map(|r| r.status().as_u16());
    let becomes = async |path: &str, want: u16| {
        eventually(Duration::from_secs(20), || async { (status(path).await == Some(want)).then_some(()) }).await
    };
    assert!(becomes("/healthz", 200).await.is_some(), "/healthz never answered 200");
    assert!(becomes("/readyz", 200).await.is_some(), "/readyz never answered 200 with NATS up");
    nats.kill9().await?;
    assert!(becomes("/readyz", 503).await.is_some(), "/readyz still ready 20 s after NATS went away");
    assert_eq!(status("/healthz").await, Some(200), "alive while not ready");
    nats.resume().await?;
    assert!(becomes("/readyz", 200).await.is_some(), "/readyz not ready again 20 s after NATS returned");
    dispatcher.kill9().await?;
    stack.stop().await
}

/// Issue 14: with synchronous replication and its standby gone, a commit
/// waits until a standby returns. A tenant is not left hanging: past the
/// deadline a publish is answered 503 (gRPC UNAVAILABLE) saying nothing can
/// be assumed; the same id retried once the standby is back is accepted,
/// and the event is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_whose_commit_cannot_be_replicated_is_answered_503_in_time_and_the_retry_delivers_it_once() -> anyhow::Result<()> {
    use relay_contracts::relay::tenant::v1::{PublishEventRequest, event_service_client::EventServiceClient};
    let primary = relay_tests::PrivatePostgres::synchronous_primary().await?;
    let standby = relay_tests::PrivatePostgres::standby_of(&primary).await?;
    primary.wait_for_synchronous_standby().await?;
    let deadline = Duration::from_secs(3);
    let stack = Stack::start(Options { pg_port: primary.port, tenant_work_deadline: deadline, ..Options::default() }).await?;
    let tenant = stack.tenant("no-standby").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/s"), &["p"]).await?;

    standby.crash()?;
    let id = uuid::Uuid::new_v4().to_string();
    let started = std::time::Instant::now();
    let (status, body) = rest.post("/v1/events", json!({"id": id, "type": "p", "payload": {"once": true}})).await?;
    let took = started.elapsed();
    assert_eq!((status, body["reason"].as_str()), (503, Some("not_confirmed")), "{body}");
    assert!(body["message"].as_str().is_some_and(|m| m.contains("retry")), "{body}");
    assert!(took >= deadline && took < deadline * 3, "answered after {took:?}, the deadline being {deadline:?}");
    let mut grpc = EventServiceClient::connect(stack.grpc_url.clone()).await?;
    let mut req = tonic::Request::new(PublishEventRequest { r#type: "p".into(), payload: "{}".into(), ..Default::default() });
    req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
    let refused = grpc.publish_event(req).await.expect_err("no standby, no acknowledgement");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");

    standby.resume()?;
    primary.wait_for_synchronous_standby().await?;
    publish_until_accepted(&rest, &id, Duration::from_secs(30)).await?;
    let got = receiver.wait_at("/s", 1, Duration::from_secs(30)).await;
    assert!(got.iter().any(|r| r.header("relay-webhook-id") == id), "the retried event arrived");
    crate::faults::all_delivered(&rest, [&id], Duration::from_secs(20)).await;
    let (all, _) = arrivals(&receiver, "/s");
    assert_eq!(all.iter().filter(|a| **a == id).count(), 1, "once, though it was published twice");
    stack.stop().await
}
