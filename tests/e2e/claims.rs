//! Claims and the broker: only an attempt's claimant gets its material, a
//! job redelivered mid-attempt is not sent twice, no transaction stays open
//! while the broker is away, a tenant holding bodies open cannot starve
//! another, published events are marked without waiting for a look, an
//! ordered key's follower stays its sender's while its report waits, an
//! event no relay was offered still goes out under steady publishing.

use std::{collections::HashSet, time::Duration};

use relay_tests::{Options, Receiver, Rest, Stack};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use uuid::Uuid;

use crate::{
    edges::{assert_error_json, raw_exchange_within},
    ordered_delivery::{ordered_endpoint, publish_keyed},
};

/// Issue 9.9: an attempt is sent only by the dispatcher holding its claim.
/// A second copy of the job (a broker redelivery racing the original) is
/// refused its material while the first holds the attempt, and finds the
/// attempt finished once the first reports; a holder that died loses its
/// claim when the claim runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_claimant_of_an_attempt_gets_its_material() -> anyhow::Result<()> {
    use relay_contracts::relay::dispatch::v1::{ExpandRequest, MaterialRequest, OutcomeRequest};
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("claims").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint("http://127.0.0.1:9/c", &["c"]).await?;
    let mut seam = stack.seam().await?;
    let pg = stack.pg().await?;
    let mut deliveries = Vec::new();
    for _ in 0..2 {
        let event_id = rest.publish("c", json!({})).await?;
        let expand = ExpandRequest {
            event_id: event_id.clone(),
            environment_id: tenant.environment_id.clone(),
            r#type: "c".into(),
            ..Default::default()
        };
        relay_tests::eventually(Duration::from_secs(10), || {
            let (mut seam, expand) = (seam.clone(), expand.clone());
            async move { seam.expand(expand).await.ok() }
        })
        .await
        .expect("expanded");
        let id: Uuid =
            sqlx::query_scalar("SELECT id FROM webhook_deliveries WHERE event_id = $1::uuid").bind(&event_id).fetch_one(&pg).await?;
        deliveries.push(id.to_string());
    }
    let (a, b) = (Uuid::new_v4().to_string(), Uuid::new_v4().to_string());
    let ask = |delivery: &str, claimant: &str, hold_ms: u32| MaterialRequest {
        delivery_id: delivery.to_owned(),
        attempt: 1,
        generation: 0,
        claimant: claimant.to_owned(),
        hold_ms,
    };
    let reason = |st: &tonic::Status| st.metadata().get("relay-error-reason").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();

    let d = &deliveries[0];
    seam.material(ask(d, &a, 30_000)).await?;
    let refused = seam.material(ask(d, &b, 30_000)).await.expect_err("a second claimant is refused");
    assert_eq!((refused.code(), reason(&refused).as_str()), (tonic::Code::Unavailable, "in_hand_elsewhere"), "{refused:?}");
    seam.material(ask(d, &a, 30_000)).await.expect("the holder may ask again (a fresh fetch renews its claim)");
    seam.outcome(OutcomeRequest {
        delivery_id: d.clone(),
        attempt: 1,
        generation: 0,
        http_status: Some(200),
        latency_ms: 3,
        ..Default::default()
    })
    .await?;
    let done = seam.material(ask(d, &b, 30_000)).await.expect_err("a finished attempt has no material");
    assert_eq!(done.code(), tonic::Code::FailedPrecondition, "{done:?}");

    // A claimant that died: its short claim runs out, and the attempt is
    // handed to the next (the one duplicate a crash can cause).
    let d = &deliveries[1];
    seam.material(ask(d, &a, 200)).await?;
    assert!(seam.material(ask(d, &b, 30_000)).await.is_err(), "held");
    tokio::time::sleep(Duration::from_millis(400)).await;
    seam.material(ask(d, &b, 30_000)).await.expect("the claim of a dead holder runs out");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.9: second copies of jobs reaching another dispatcher while the
/// first is still sending (as after a broker restart) send nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_redelivered_to_another_dispatcher_mid_attempt_is_not_sent_twice() -> anyhow::Result<()> {
    use prost::Message as _;
    use relay_contracts::{StreamNames, relay::queue::v1::DeliveryJob};
    let mut stack = Stack::start(Options { attempt_timeout: Duration::from_secs(5), ..Options::default() }).await?;
    stack.start_dispatcher().await?;
    let tenant = stack.tenant("copies").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/slow", relay_tests::Reply::Hang(Duration::from_millis(800)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, _) = rest.endpoint(&receiver.url("/slow"), &["d"]).await?;
    let names = StreamNames::new(&stack.prefix).map_err(anyhow::Error::msg)?;
    let js = async_nats::jetstream::new(async_nats::connect(&stack.opts.nats_url).await?);
    let pg = stack.pg().await?;
    let mut published = HashSet::new();
    for i in 0..6 {
        let event_id = rest.publish("d", json!({"i": i})).await?;
        published.insert(event_id.clone());
        // Once the attempt is in the receiver's hands, put copies of its job
        // in the stream, as a broker that lost track of its acks would.
        let seen: Vec<String> =
            receiver.wait_at("/slow", i + 1, Duration::from_secs(20)).await.iter().map(|r| r.header("relay-webhook-id")).collect();
        assert_eq!(seen.len(), i + 1);
        assert_eq!(seen.iter().collect::<HashSet<_>>().len(), seen.len(), "an event was sent twice: {seen:?}");
        let id: Uuid =
            sqlx::query_scalar("SELECT id FROM webhook_deliveries WHERE event_id = $1::uuid").bind(&event_id).fetch_one(&pg).await?;
        let job = DeliveryJob {
            delivery_id: id.to_string(),
            endpoint_id: endpoint_id.clone(),
            environment_id: tenant.environment_id.clone(),
            attempt: 1,
            generation: 0,
        };
        for copy in 0..3 {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", format!("copy-{id}-{copy}").as_str());
            js.publish_with_headers(names.deliveries_subject(&tenant.environment_id), headers, job.encode_to_vec().into()).await?.await?;
        }
        relay_tests::eventually(Duration::from_secs(10), || async {
            let d = rest.deliveries(&event_id).await.ok()?.into_iter().next()?;
            (d["state"] == "DELIVERY_STATE_DELIVERED").then_some(())
        })
        .await
        .expect("delivered");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let all: Vec<String> = receiver.at("/slow").iter().map(|r| r.header("relay-webhook-id")).collect();
    assert_eq!(all.iter().cloned().collect::<HashSet<_>>(), published);
    assert_eq!(all.len(), published.len(), "no event was sent twice: {all:?}");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.9: the relays hold no Postgres transaction open while the broker
/// is away (they used to sit idle in transaction, row locks held, for the
/// length of a publish timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_transaction_stays_open_while_the_broker_is_away() -> anyhow::Result<()> {
    let mut nats = relay_tests::PrivateNats::start().await?;
    let stack = Stack::start(Options { nats_url: nats.url(), ..Options::default() }).await?;
    let tenant = stack.tenant("outage").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/o"), &["o"]).await?;
    rest.publish("o", json!({"before": true})).await?;
    assert_eq!(receiver.wait_at("/o", 1, Duration::from_secs(20)).await.len(), 1);
    nats.stop().await?;
    let pg = stack.pg().await?;
    let mut longest = 0.0f64;
    for i in 0..30 {
        if i % 3 == 0 {
            rest.publish("o", json!({"during": i})).await?;
        }
        let open: Option<f64> = sqlx::query_scalar(
            "SELECT max(extract(epoch FROM now() - state_change))::float8 FROM pg_stat_activity
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(&pg)
        .await?;
        longest = longest.max(open.unwrap_or(0.0));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(longest < 0.5, "a session sat idle in a transaction for {longest:.1} s while the broker was away");
    nats.resume().await?;
    assert_eq!(receiver.wait_at("/o", 11, Duration::from_secs(60)).await.len(), 11, "everything arrives once the broker is back");
    pg.close().await;
    stack.stop().await?;
    nats.stop().await
}

/// Issue 9.4: a tenant that opens many calls and trickles (or never sends)
/// their bodies holds at most its share of the body budget, and only for the
/// body deadline: another tenant's publishes go on, and the trickler gets 408.
/// A client that half-closes after a complete request still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holding_bodies_open_cannot_starve_another_and_is_timed_out() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let (slow, other) = (stack.tenant("slow").await?, stack.tenant("other").await?);
    let addr = stack.addrs.rest;
    // Calls that declare bodies and send none: large ones, then small ones
    // to take whatever room is left — more than the whole body budget, let
    // alone the slow tenant's share of it.
    let held: Vec<_> = (0..300)
        .map(|i| {
            let key = slow.api_key.clone();
            let declared = if i < 100 { 200_000 } else { 200 };
            tokio::spawn(async move {
                let head = format!(
                    "POST /v1/events HTTP/1.1\r\nhost: relay\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n{{"
                );
                raw_exchange_within(addr, head.as_bytes(), Duration::from_secs(20)).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let rest = Rest::new(&stack.rest_url, Some(&other.api_key));
    let started = std::time::Instant::now();
    for i in 0..5 {
        rest.publish("x", json!({"i": i})).await?;
    }
    assert!(started.elapsed() < Duration::from_secs(2), "the other tenant waited {:?}", started.elapsed());
    let mut statuses = std::collections::BTreeMap::new();
    for h in held {
        let (status, head, body) = h.await??;
        assert!(status == 408 || status == 503, "a held body answered {status}: {body}");
        assert_error_json("a held body", status, &head, &body, status);
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert!(statuses.contains_key(&408), "some held calls got room, then a deadline: {statuses:?}");

    // Half-close after a complete request: the answer still comes.
    use tokio::io::AsyncReadExt;
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(
        format!("GET /v1/webhooks HTTP/1.1\r\nhost: relay\r\nconnection: close\r\nauthorization: Bearer {}\r\n\r\n", other.api_key)
            .as_bytes(),
    )
    .await?;
    tcp.shutdown().await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await??;
    assert!(out.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&out));
    stack.stop().await
}

/// Published events are marked in batches (`relay::outbox::MARK_DELAY`), and
/// a quiet relay writes the last batch within that delay, not at its next
/// look at the outbox: with the look 30 s away, the marks still land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_events_are_marked_soon_after_the_last_one_without_waiting_for_a_look() -> anyhow::Result<()> {
    let stack = Stack::start(Options { relay_idle: Duration::from_secs(30), ..Options::default() }).await?;
    let tenant = stack.tenant("marks").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/m"), &["m"]).await?;
    for i in 0..5 {
        rest.publish("m", json!({ "i": i })).await?;
    }
    receiver.wait_at("/m", 5, Duration::from_secs(20)).await;
    let pg = stack.pg().await?;
    let unmarked = relay_tests::eventually(Duration::from_secs(3), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NULL").fetch_one(&pg).await.ok()?;
        (n == 0).then_some(n)
    })
    .await;
    assert_eq!(unmarked, Some(0), "every delivered event is marked published within seconds, long before the next look");
    stack.stop().await
}

/// An event in the outbox that no relay was offered (its api died between
/// its commit and its offer) goes out while publishes keep the relay busy
/// with their offers: the relay looks at the outbox once its idle interval
/// has passed since its last look, offers or not. (Before, it only looked
/// when it slept out the interval, which steady publishing never let it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_no_relay_was_offered_goes_out_while_publishes_keep_the_relay_busy() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("unoffered").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/u"), &["u"]).await?;
    // Publishing, and delivered: the relay is up and taking offers.
    rest.publish("u", json!({"first": true})).await?;
    receiver.wait_at("/u", 1, Duration::from_secs(20)).await;
    let pg = stack.pg().await?;
    let unoffered = Uuid::new_v4().to_string();
    sqlx::query("INSERT INTO events (environment_id, id, event_type, envelope) VALUES ($1::uuid, $2::uuid, 'u', '\\x7b7d'::bytea)")
        .bind(&tenant.environment_id)
        .bind(&unoffered)
        .execute(&pg)
        .await?;
    // A publish every 50 ms (the relay's idle interval here is 500 ms) for
    // up to 10 s, until the unoffered event arrives.
    let started = tokio::time::Instant::now();
    let mut arrived = false;
    while !arrived && started.elapsed() < Duration::from_secs(10) {
        rest.publish("u", json!({"n": 1})).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        arrived = receiver.received().iter().any(|r| r.header("relay-webhook-id") == unoffered);
    }
    assert!(arrived, "the event no relay was offered was not published in 10 s of steady publishing");
    stack.stop().await
}

/// A backlog in the outbox is published in turns across environments: one
/// environment's burst, written while the broker was away, does not go
/// ahead of another's few events when the broker comes back (the relay
/// keeps only `events_backlog` events in the stream, so what the outbox
/// publishes first is what is expanded first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_in_the_outbox_goes_out_in_turns_across_environments() -> anyhow::Result<()> {
    let mut nats = relay_tests::PrivateNats::start().await?;
    // Every event by the outbox (none expanded at publish, which needs no
    // broker): the backlog is what this test is about.
    let stack = Stack::start(Options { nats_url: nats.url(), events_backlog: 8, expand_at_publish: 0, ..Options::default() }).await?;
    let receiver = Receiver::start().await?;
    let burst = Rest::new(&stack.rest_url, Some(&stack.tenant("burst").await?.api_key));
    let steady = Rest::new(&stack.rest_url, Some(&stack.tenant("steady").await?.api_key));
    burst.endpoint(&receiver.url("/burst"), &["b"]).await?;
    steady.endpoint(&receiver.url("/steady"), &["s"]).await?;
    burst.publish("b", json!({"warm": true})).await?;
    steady.publish("s", json!({"warm": true})).await?;
    assert_eq!(receiver.wait_for(2, Duration::from_secs(20)).await.len(), 2, "both environments deliver");

    nats.stop().await?;
    const BURST: usize = 300;
    for n in 0..BURST {
        burst.publish("b", json!({"n": n})).await?;
    }
    let mut few = HashSet::new();
    for n in 0..3 {
        few.insert(steady.publish("s", json!({"n": n})).await?);
    }
    nats.resume().await?;
    let all = receiver.wait_for(2 + BURST + 3, Duration::from_secs(120)).await;
    assert_eq!(all.len(), 2 + BURST + 3, "everything arrives once the broker is back");
    // Arrival order after the outage: the steady environment's events were
    // written last, and still come within the first turns.
    let after = &all[2..];
    let last_steady = after.iter().rposition(|r| few.contains(&r.header("relay-webhook-id"))).expect("the steady events arrived");
    let burst_before = after[..last_steady].iter().filter(|r| r.path == "/burst").count();
    assert!(burst_before < BURST / 4, "the steady environment's 3 events waited behind {burst_before} of the burst's {BURST}");
    stack.stop().await?;
    nats.stop().await
}

/// A lane follower's report waits on its predecessor's (answered
/// `predecessor_unrecorded`); for as long as that takes the follower stays
/// its sender's: each deferral renews the sender's claim, so however long
/// the predecessor's report is delayed, no other dispatcher is given the
/// follower's material once it is promoted, and it is recorded once, from
/// its sender's report. (A claim that ran out meanwhile let a second
/// dispatcher send an event the receiver had already answered 2xx: a
/// duplicate no fault explained.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_report_waits_on_its_predecessor_stays_its_senders() -> anyhow::Result<()> {
    use relay_contracts::relay::dispatch::v1::{
        ExpandBatchRequest, ExpandRequest, MaterialBatchRequest, MaterialRequest, OutcomeBatchRequest, OutcomeDecision, OutcomeRequest,
        expand_result::Result as X, material_result::Result as M, outcome_result::Result as O,
    };
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("ordered-claims").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    ordered_endpoint(&rest, &receiver, "/never", json!({})).await?;
    let mut events = Vec::new();
    for n in 1..=3 {
        events.push(publish_keyed(&rest, "k", json!({"n": n})).await?.0);
    }
    let (sender, other) = (uuid::Uuid::new_v4().to_string(), uuid::Uuid::new_v4().to_string());
    // The shortest hold the api grants attempts taken in hand.
    const HOLD_MS: u32 = 5000;
    let mut seam = stack.seam().await?;
    let items = events
        .iter()
        .map(|e| ExpandRequest {
            event_id: e.clone(),
            environment_id: tenant.environment_id.clone(),
            r#type: "o".into(),
            ..Default::default()
        })
        .collect();
    let expanded = seam
        .expand_batch(ExpandBatchRequest { items, claimant: sender.clone(), hold_ms: HOLD_MS, express: false })
        .await?
        .into_inner()
        .items;
    let head = expanded
        .iter()
        .find_map(|r| match &r.result {
            Some(X::Expanded(x)) => x.attempts.first().cloned(),
            _ => None,
        })
        .ok_or_else(|| anyhow::anyhow!("the lane's head was not handed to its expander: {expanded:?}"))?;
    assert_eq!(head.followers.len(), 2, "the head comes with the two deliveries queued behind it: {head:?}");
    let follower = head.followers[0].clone();

    // The run: the head answered 2xx, the follower sent and answered 2xx;
    // the follower's report arrives first and keeps being told to wait,
    // for twice the claim's hold.
    let report = |m: &relay_contracts::relay::dispatch::v1::MaterialResponse, lane_follower: bool, next: &str, released: Vec<String>| {
        OutcomeRequest {
            delivery_id: m.delivery_id.clone(),
            attempt: m.attempt,
            generation: m.generation,
            http_status: Some(200),
            latency_ms: 20,
            lane_follower,
            next_follower: next.to_owned(),
            released_followers: released,
            ..Default::default()
        }
    };
    let batch = |items: Vec<OutcomeRequest>| OutcomeBatchRequest { items, claimant: sender.clone(), hold_ms: HOLD_MS };
    let deferred_until = tokio::time::Instant::now() + Duration::from_millis(2 * HOLD_MS as u64);
    let mut deferrals = 0;
    while tokio::time::Instant::now() < deferred_until {
        let answer = seam.outcome_batch(batch(vec![report(&follower, true, "", vec![head.followers[1].delivery_id.clone()])])).await?;
        let answer = answer.into_inner().items;
        assert!(
            matches!(&answer[0].result, Some(O::Error(e)) if e.reason == "predecessor_unrecorded"),
            "a follower reported before its predecessor waits: {answer:?}"
        );
        deferrals += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(deferrals >= 10, "{deferrals} deferrals");
    let pg = stack.pg().await?;
    let (claimant, live): (String, bool) =
        sqlx::query_as("SELECT claimant::text, until > now() FROM attempt_claims WHERE delivery_id = $1::uuid")
            .bind(&follower.delivery_id)
            .fetch_one(&pg)
            .await?;
    assert_eq!((claimant.as_str(), live), (sender.as_str(), true), "the deferred follower's claim is its sender's, and holds");

    // The head's report lands at last, promoting the follower: another
    // dispatcher asking for the follower (a relay's copy) is refused it.
    let answer = seam.outcome_batch(batch(vec![report(&head, false, &follower.delivery_id, Vec::new())])).await?.into_inner().items;
    assert!(matches!(&answer[0].result, Some(O::Outcome(o)) if o.decision == OutcomeDecision::Delivered as i32), "{answer:?}");
    let ask = |claimant: &str| MaterialBatchRequest {
        items: vec![MaterialRequest {
            delivery_id: follower.delivery_id.clone(),
            attempt: follower.attempt,
            generation: follower.generation,
            claimant: claimant.to_owned(),
            hold_ms: HOLD_MS,
        }],
    };
    let refused = seam.material_batch(ask(&other)).await?.into_inner().items;
    assert!(
        matches!(&refused[0].result, Some(M::Error(e)) if e.reason == "in_hand_elsewhere"),
        "the promoted follower is still in its sender's hands: {refused:?}"
    );
    // Its sender's report is recorded, once; after it the attempt is nobody's to send.
    let answer = seam.outcome_batch(batch(vec![report(&follower, true, "", vec![head.followers[1].delivery_id.clone()])])).await?;
    let answer = answer.into_inner().items;
    assert!(matches!(&answer[0].result, Some(O::Outcome(o)) if o.decision == OutcomeDecision::Delivered as i32), "{answer:?}");
    let late = seam.material_batch(ask(&other)).await?.into_inner().items;
    assert!(matches!(&late[0].result, Some(M::Error(e)) if e.reason == "stale_attempt"), "{late:?}");
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM delivery_attempts WHERE delivery_id = $1::uuid")
        .bind(&follower.delivery_id)
        .fetch_one(&pg)
        .await?;
    assert_eq!(attempts, 1, "the follower's attempt is recorded once");
    stack.stop().await
}
