//! Broker semantics and crash windows: each fault is made real — a process
//! killed with SIGKILL, a broker stopped, an api taken away — and the test
//! checks that nothing is lost and the schedule advances once.

use std::{collections::HashSet, time::Duration};

use async_nats::jetstream;
use relay_contracts::{StreamNames, relay::dispatch::v1::ExpandRequest};
use relay_tests::{Options, PrivateNats, Process, Receiver, Reply, Rest, Stack, eventually};
use serde_json::json;

/// Event ids that arrived at `path`, with how often each arrived.
pub(crate) fn arrivals(receiver: &Receiver, path: &str) -> (Vec<String>, HashSet<String>) {
    let all: Vec<String> = receiver.at(path).iter().map(|r| r.header("relay-webhook-id")).collect();
    let distinct = all.iter().cloned().collect();
    (all, distinct)
}

/// The repeats at `path`: how many arrivals beyond one per event. Asserts
/// that only events in `in_flight` (ones whose attempt a fault could catch
/// between the POST and its recorded outcome) came more than once, and
/// those at most twice; one fault loses at most one outcome per attempt.
pub(crate) fn repeats_only_of(receiver: &Receiver, path: &str, in_flight: &HashSet<String>, fault: &str) -> usize {
    let (all, distinct) = arrivals(receiver, path);
    for id in &distinct {
        let n = all.iter().filter(|a| *a == id).count();
        assert!(
            n == 1 || (n == 2 && in_flight.contains(id)),
            "{id} arrived {n} times; {fault} can repeat only an attempt it caught in flight"
        );
    }
    all.len() - distinct.len()
}

/// Waits (bounded) until every delivery of every event in `events` is
/// recorded delivered: from then on nothing more is owed to anyone, so a
/// request that still came would be a duplicate. Panics past `within`.
pub(crate) async fn all_delivered<'a>(rest: &Rest, events: impl IntoIterator<Item = &'a String>, within: Duration) {
    let events: Vec<&String> = events.into_iter().collect();
    let done = eventually(within, || async {
        for id in &events {
            let deliveries = rest.deliveries(id).await.ok()?;
            if deliveries.is_empty() || !deliveries.iter().all(|d| d["state"] == "DELIVERY_STATE_DELIVERED") {
                return None;
            }
        }
        Some(())
    })
    .await;
    assert!(done.is_some(), "not every delivery of {} events was recorded delivered within {within:?}", events.len());
}

/// How many of `expected` have not arrived at `path` once they all have, or
/// `within` has passed.
pub(crate) async fn missing_after(receiver: &Receiver, path: &str, expected: &HashSet<String>, within: Duration) -> usize {
    eventually(within, || async { expected.is_subset(&arrivals(receiver, path).1).then_some(()) }).await;
    expected.difference(&arrivals(receiver, path).1).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_messages_are_terminated_on_first_sight() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let names = StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
    let js = jetstream::new(async_nats::connect(&stack.opts.nats_url).await?);
    // Wait until the dispatcher's consumers exist, then feed them garbage.
    eventually(Duration::from_secs(10), || async { stack.consumer_info(true).await.ok().and(stack.consumer_info(false).await.ok()) })
        .await
        .expect("the dispatcher creates its consumers");
    let junk_delivery = js.publish(names.deliveries_subject("junk"), "\u{0}not protobuf\u{ff}".into()).await?.await?.sequence;
    let junk_event = js.publish(names.events_subject("junk"), "{not json".into()).await?.await?.sequence;

    for (deliveries, seq) in [(true, junk_delivery), (false, junk_event)] {
        let info = eventually(Duration::from_secs(10), || async {
            let i = stack.consumer_info(deliveries).await.ok()?;
            (i.ack_floor.stream_sequence >= seq).then_some(i)
        })
        .await
        .unwrap_or_else(|| panic!("the junk message (deliveries={deliveries}) was never settled"));
        // Past the ack floor with nothing pending: acknowledged or
        // terminated, which JetStream never delivers again (a NAK would
        // have left it pending).
        assert_eq!(info.num_ack_pending, 0);
        assert_eq!(info.num_redelivered, 0, "terminated on first sight, never redelivered");
    }
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_the_dispatcher_cannot_process_is_not_acked_and_comes_back() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("api-away").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/away"), &["x"]).await?;
    let event_id = rest.publish("x", json!({})).await?;
    stack
        .seam()
        .await?
        .expand(ExpandRequest {
            event_id: event_id.clone(),
            environment_id: tenant.environment_id.clone(),
            r#type: "x".into(),
            ..Default::default()
        })
        .await?;
    // Wait until the relay has handed the job to the broker, then take the api away.
    let pg = stack.pg().await?;
    eventually(Duration::from_secs(10), || async {
        let leased: Option<bool> = sqlx::query_scalar("SELECT dispatched_at IS NOT NULL FROM webhook_deliveries WHERE event_id = $1::uuid")
            .bind(&event_id)
            .fetch_optional(&pg)
            .await
            .ok()?;
        leased.filter(|l| *l)
    })
    .await
    .expect("the relay publishes the due delivery");
    pg.close().await;
    stack.stop_api().await?;

    stack.start_dispatcher().await?;
    let info = eventually(Duration::from_secs(15), || async {
        let i = stack.consumer_info(true).await.ok()?;
        (i.num_redelivered >= 1).then_some(i)
    })
    .await
    .expect("the job comes back while the api is unreachable");
    assert!(info.num_ack_pending >= 1 || info.num_pending >= 1, "the job is still owed: {info:?}");
    assert!(receiver.received().is_empty(), "nothing can be sent without the material");

    stack.start_api().await?;
    assert_eq!(receiver.wait_at("/away", 1, Duration::from_secs(20)).await.len(), 1, "delivered once the api is back");
    all_delivered(&rest, [&event_id], Duration::from_secs(20)).await;
    assert_eq!(receiver.at("/away").len(), 1);
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_between_post_and_outcome_resends_the_same_event_id_and_advances_the_schedule_once() -> anyhow::Result<()> {
    let stack = Stack::start(Options {
        dispatcher: false,
        attempt_timeout: Duration::from_secs(5),
        seam_timeout: Duration::from_secs(1),
        ..Options::default()
    })
    .await?;
    let tenant = stack.tenant("crash").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/crash", Reply::Hang(Duration::from_secs(30)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/crash"), &["c"]).await?;

    let first = Process::spawn("relay-dispatcher", &stack.dispatcher_env())?;
    let event_id = rest.publish("c", json!({"crash": true})).await?;
    // The POST is in the receiver's hands; the outcome has not been reported.
    assert_eq!(receiver.wait_at("/crash", 1, Duration::from_secs(20)).await.len(), 1);
    first.kill9().await?;
    receiver.reply("/crash", Reply::Status(200));

    let second = Process::spawn("relay-dispatcher", &stack.dispatcher_env())?;
    let got = receiver.wait_at("/crash", 2, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 2, "the unacknowledged job is redelivered and sent again");
    assert!(got.iter().all(|r| r.header("relay-webhook-id") == event_id), "the receiver can deduplicate on the event id");
    assert_eq!(got[0].body, got[1].body);
    let done = eventually(Duration::from_secs(10), || async {
        let d = rest.deliveries(&event_id).await.ok()?;
        d.into_iter().next().filter(|d| d["state"] == "DELIVERY_STATE_DELIVERED")
    })
    .await
    .expect("delivered");
    assert_eq!(done["attempt"], 1, "the schedule advanced once");
    assert_eq!(done["attempts"].as_array().unwrap().len(), 1, "one outcome recorded");
    second.kill9().await?;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_nats_while_events_are_published_loses_nothing() -> anyhow::Result<()> {
    let mut nats = PrivateNats::start().await?;
    // Every event by the outbox and EVENTS, which is what waits for the
    // broker here (an event expanded at publish does not: e2e
    // `at_publish::with_the_broker_stopped_an_event_expanded_at_publish_still_arrives`).
    let stack = Stack::start(Options { nats_url: nats.url(), expand_at_publish: 0, ..Options::default() }).await?;
    let tenant = stack.tenant("nats-outage").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/n"), &["n"]).await?;
    let mut published = HashSet::new();
    for i in 0..5 {
        published.insert(rest.publish("n", json!({"i": i})).await?);
    }
    assert_eq!(receiver.wait_at("/n", 5, Duration::from_secs(20)).await.len(), 5);

    let http = reqwest::Client::new();
    let ready = || async { http.get(format!("{}/readyz", stack.rest_url)).send().await.map(|r| r.status().as_u16()).unwrap_or(0) };
    assert_eq!(ready().await, 200, "ready while Postgres and NATS answer");
    nats.stop().await?;
    assert!(
        eventually(Duration::from_secs(10), || async { (ready().await == 503).then_some(()) }).await.is_some(),
        "not ready without the broker"
    );
    for i in 5..15 {
        published.insert(rest.publish("n", json!({"i": i})).await?); // the api keeps accepting
    }
    // What the "broker unavailable" alert reads (docs/operations.md): all
    // ten wait in the outbox, none published, so none can have been sent.
    // The oldest one's age is shown, and grows.
    let oldest = |m: &str| m.lines().find_map(|l| l.strip_prefix("relay_outbox_oldest_seconds ")).and_then(|v| v.parse::<f64>().ok());
    let metrics = eventually(Duration::from_secs(10), || async {
        let m = reqwest::get(&stack.metrics_url).await.ok()?.text().await.ok()?;
        (m.contains("relay_queue_depth{queue=\"outbox_unpublished\"} 10") && oldest(&m)? > 0.4).then_some(m)
    })
    .await
    .expect("the ten events wait in the outbox, the oldest for longer and longer");
    assert!(metrics.contains("relay_dependency_up{dependency=\"nats\"} 0"), "{metrics}");
    assert_eq!(receiver.at("/n").len(), 5, "nothing can move while the broker is down");
    nats.resume().await?;
    assert!(eventually(Duration::from_secs(20), || async { (ready().await == 200).then_some(()) }).await.is_some(), "ready again");

    let got = receiver.wait_at("/n", 15, Duration::from_secs(60)).await;
    all_delivered(&rest, &published, Duration::from_secs(30)).await;
    let (all, distinct) = arrivals(&receiver, "/n");
    assert_eq!(distinct, published, "every event arrives after the broker returns ({} of 15 so far)", got.len());
    assert_eq!(all.len(), 15, "and none twice");
    stack.stop().await?;
    nats.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_the_api_mid_relay_loses_nothing_and_sends_nothing_twice() -> anyhow::Result<()> {
    let stack = Stack::start(Options { api: false, ..Options::default() }).await?;
    let mut api = Process::spawn("relay-api", &stack.api_env())?;
    stack.wait_for_api().await?;
    let tenant = stack.tenant("api-crash").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for path in ["/a", "/b"] {
        rest.endpoint(&receiver.url(path), &["k"]).await?;
    }
    let mut published = HashSet::new();
    for i in 0..40 {
        if i == 20 {
            api.kill9().await?;
            api = Process::spawn("relay-api", &stack.api_env())?;
            stack.wait_for_api().await?;
        }
        published.insert(rest.publish("k", json!({"i": i})).await?);
    }
    for path in ["/a", "/b"] {
        receiver.wait_at(path, 40, Duration::from_secs(60)).await;
    }
    all_delivered(&rest, &published, Duration::from_secs(30)).await;
    for path in ["/a", "/b"] {
        let (all, distinct) = arrivals(&receiver, path);
        assert_eq!(distinct, published, "{path}: every event arrives");
        assert_eq!(all.len(), published.len(), "{path}: none twice");
    }
    api.kill9().await?;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_apis_and_two_dispatchers_share_the_work_and_send_each_delivery_once() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options::default()).await?;
    let (replica_rest, replica_internal) = stack.start_api_replica().await?;
    let mut second = stack.dispatcher_config();
    second.api_url = replica_internal;
    stack.start_dispatcher_with(second).await?;
    let tenant = stack.tenant("scale-out").await?;
    let receiver = Receiver::start().await?;
    let rests = [Rest::new(&stack.rest_url, Some(&tenant.api_key)), Rest::new(&replica_rest, Some(&tenant.api_key))];
    for path in ["/1", "/2", "/3"] {
        rests[0].endpoint(&receiver.url(path), &["s"]).await?;
    }
    let mut published = HashSet::new();
    for i in 0..60 {
        published.insert(rests[i % 2].publish("s", json!({"i": i})).await?);
    }
    for path in ["/1", "/2", "/3"] {
        receiver.wait_at(path, 60, Duration::from_secs(60)).await;
    }
    all_delivered(&rests[0], &published, Duration::from_secs(30)).await;
    for path in ["/1", "/2", "/3"] {
        let (all, distinct) = arrivals(&receiver, path);
        assert_eq!(distinct, published, "{path}: every event arrives");
        assert_eq!(all.len(), 60, "{path}: none twice");
    }
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deliveries_ack_wait_is_derived_from_the_attempt_timeout_and_follows_its_changes() -> anyhow::Result<()> {
    let mut stack =
        Stack::start(Options { attempt_timeout: Duration::from_secs(2), seam_timeout: Duration::from_secs(1), ..Options::default() })
            .await?;
    let info = eventually(Duration::from_secs(10), || async { stack.consumer_info(true).await.ok() }).await.expect("the consumer exists");
    assert_eq!(info.config.ack_wait, Duration::from_secs(3), "attempt timeout + seam timeout");
    assert!(info.config.ack_wait > Duration::from_secs(2), "always longer than an attempt");
    assert_eq!(info.config.max_deliver, 50, "the broker's own redelivery budget, not the customer's seven attempts");

    // A dispatcher deployed with a longer attempt timeout brings the broker along.
    let mut longer = stack.dispatcher_config();
    longer.attempt_timeout = Duration::from_secs(10);
    stack.start_dispatcher_with(longer).await?;
    let updated = eventually(Duration::from_secs(10), || async {
        stack.consumer_info(true).await.ok().filter(|i| i.config.ack_wait == Duration::from_secs(11))
    })
    .await;
    assert!(updated.is_some(), "the consumer's ack wait follows the configuration");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_written_by_one_api_wake_the_relay_of_another() -> anyhow::Result<()> {
    // The main api runs the relays but would sleep 60 s when idle; the replica
    // serves the seam and runs no relay. Only a cross-process wake-up can
    // get the delivery sent promptly.
    let mut stack = Stack::start(Options { dispatcher: false, relay_idle: Duration::from_secs(60), ..Options::default() }).await?;
    let mut serving_only = stack.api_config();
    serving_only.delivery.run_relays = false;
    let (_, replica_internal) = stack.start_api_replica_with(serving_only).await?;
    let mut via_replica = stack.dispatcher_config();
    via_replica.api_url = replica_internal;
    stack.start_dispatcher_with(via_replica).await?;
    let tenant = stack.tenant("wake").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/w"), &["w"]).await?;
    // Let the relay fall into its long idle sleep, then publish.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let published = std::time::Instant::now();
    rest.publish("w", json!({})).await?;
    let got = receiver.wait_at("/w", 1, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 1, "the delivery expanded by the replica was sent");
    assert!(
        got[0].at - published < Duration::from_secs(5),
        "woken across processes, not by the 60 s idle timer: {:?}",
        got[0].at - published
    );
    stack.stop().await
}

/// The direct path's crash window: an expansion committed its first attempt
/// already leased, and the process died before the broker had it. Made real
/// by writing exactly that row (leased, never published) before the event is
/// expanded, so the expansion creates nothing and publishes nothing: only the
/// relay, once the short lease lapses, can send it — and it must, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_attempt_leased_but_never_published_is_sent_once_its_lease_lapses() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("crash-window").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, _) = rest.endpoint(&receiver.url("/lost"), &["w"]).await?;
    let event_id = rest.publish("w", json!({"crash": "window"})).await?;
    let pg = stack.pg().await?;
    let started = std::time::Instant::now();
    sqlx::query(
        "INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id, dispatched_at, next_attempt_at)
         VALUES (relay_uuid_v7(), $1::uuid, $2::uuid, $3::uuid, now(), now() + interval '2 seconds')",
    )
    .bind(&tenant.environment_id)
    .bind(&endpoint_id)
    .bind(&event_id)
    .execute(&pg)
    .await?;
    stack.start_dispatcher().await?;
    let arrived = receiver.wait_at("/lost", 1, Duration::from_secs(20)).await;
    assert_eq!(arrived.len(), 1, "the orphaned first attempt is delivered");
    assert!(started.elapsed() >= Duration::from_millis(1500), "not before its lease lapsed: {:?}", started.elapsed());
    assert_eq!(arrived[0].header("relay-webhook-id"), event_id);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(receiver.at("/lost").len(), 1, "and only once");
    let deliveries = rest.deliveries(&event_id).await?;
    assert_eq!(deliveries.len(), 1, "the expansion added no second row");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_api_could_not_take_is_reported_when_it_is_back_and_the_attempt_is_not_sent_again() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options {
        dispatcher: false,
        attempt_timeout: Duration::from_secs(5),
        seam_timeout: Duration::from_secs(1),
        ..Options::default()
    })
    .await?;
    let tenant = stack.tenant("kept-outcome").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/kept", Reply::Hang(Duration::from_secs(2)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/kept"), &["k"]).await?;
    let dispatcher = Process::spawn("relay-dispatcher", &stack.dispatcher_env())?;
    let event_id = rest.publish("k", json!({"kept": true})).await?;
    assert_eq!(receiver.wait_at("/kept", 1, Duration::from_secs(20)).await.len(), 1);
    // The receiver answers 200 two seconds later, to a dispatcher whose api is
    // gone, and stays gone past every try of the report (about 15 s for an
    // attempt handed over with its expansion) and the attempt's lease: once
    // back, the api's relay hands the unrecorded attempt out again at once.
    stack.stop_api().await?;
    tokio::time::sleep(Duration::from_secs(20)).await;
    stack.start_api().await?;
    let done = eventually(Duration::from_secs(30), || async {
        let d = rest.deliveries(&event_id).await.ok()?;
        d.into_iter().next().filter(|d| d["state"] == "DELIVERY_STATE_DELIVERED")
    })
    .await
    .expect("the kept outcome is recorded once the api is back");
    assert_eq!(done["attempts"].as_array().map(Vec::len), Some(1), "one outcome recorded: {done}");
    assert_eq!(done["attempts"][0]["http_status"], 200, "the outcome the receiver gave: {done}");
    // Room for a second request, had the attempt been handed out and sent again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(receiver.at("/kept").len(), 1, "the receiver got the event once");
    dispatcher.kill9().await?;
    stack.stop().await
}

/// An attempt in a dispatcher's hands whose lease runs out while it waits
/// (behind slow attempts to the same endpoint) is published by the relay,
/// and that copy reaches the same dispatcher. If the dispatcher then dies,
/// the copy brings the attempt back once its claim has run out — not the
/// attempt's next lease (a minute here, five in production), as when the
/// copy was acked unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_an_attempt_in_hand_brings_it_back_when_the_dispatcher_holding_it_dies() -> anyhow::Result<()> {
    // A claim holds 2 + 3 + 5 = 10 s; so does the lease of a first attempt
    // handed over with its expansion.
    let stack =
        Stack::start(Options { dispatcher: false, attempt_timeout: Duration::from_secs(3), endpoint_cap: 6, ..Options::default() }).await?;
    let tenant = stack.tenant("copy-in-hand").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/slow", Reply::Hang(Duration::from_millis(2500)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/slow"), &["c"]).await?;
    let first = Process::spawn("relay-dispatcher", &stack.dispatcher_env())?;
    let mut published = HashSet::new();
    for i in 0..6 {
        published.insert(rest.publish("c", json!({"i": i})).await?);
    }
    // Six in hand, one at a time, 2.5 s each: the fifth and sixth are still
    // there when their leases run out at 10 s, and the relay publishes them.
    let copies = eventually(Duration::from_secs(30), || async {
        let info = stack.consumer_info(true).await.ok()?;
        (info.delivered.stream_sequence >= 2).then_some(info.delivered.stream_sequence)
    })
    .await
    .expect("the relay published the attempts whose leases ran out, and the dispatcher took them");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before_kill = arrivals(&receiver, "/slow").1;
    assert!(before_kill.len() < published.len(), "some attempts were still waiting when the dispatcher died: {before_kill:?}");
    first.kill9().await?;
    let killed_at = std::time::Instant::now();
    let second = Process::spawn("relay-dispatcher", &stack.dispatcher_env())?;
    // The copies come back a claim's hold after the dead dispatcher saw them,
    // and the attempts go out once its claims have run out: about 10 s. The
    // relay's next lease would take 60.
    let all = eventually(Duration::from_secs(30), || async {
        let (_, distinct) = arrivals(&receiver, "/slow");
        (distinct == published).then_some(distinct)
    })
    .await;
    assert!(
        all.is_some(),
        "every event reached the receiver within 30 s of the dispatcher's death ({copies} copies published): got {:?} of {published:?}",
        arrivals(&receiver, "/slow").1
    );
    eprintln!("every event arrived {:?} after the dispatcher died", killed_at.elapsed());
    second.kill9().await?;
    stack.stop().await
}
