//! Bulk recovery of a range and the operations endpoint: dead letters sent
//! again once, throttled, across an api restart; an operations endpoint hears
//! an endpoint failing, recovered and gone, and dead letters announced together,
//! never about itself.

use crate::health::num;
use std::time::Duration;

use relay_tests::{Options, Receiver, Reply, Rest, Stack, eventually};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovering_a_range_sends_its_dead_letters_once_throttled_and_survives_an_api_restart() -> anyhow::Result<()> {
    use relay_contracts::relay::admin::v1::RecoverEndpointRequest;
    // No circuit here: each delivery dies after its own seven attempts.
    let opts = Options { recover_per_second: 1, ..Options::default().circuit_off() };
    let mut stack = Stack::start(opts).await?;
    let tenant = stack.tenant("recover").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/r", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/r"), &["t"]).await?;
    let publish = async |n: usize| -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        for i in 0..n {
            ids.push(rest.publish("t", json!({"i": i})).await?);
        }
        Ok(ids)
    };
    // The range is of deliveries' creation, which follows a publish by the
    // time the event takes to be expanded: each bound is taken once the
    // deliveries before it have been sent (so exist), not a fixed pause after
    // publishing (CI once saw 3 of 8 expanded after a 50 ms pause).
    let sent = async |ids: &[String]| {
        let seen = eventually(Duration::from_secs(20), || async {
            let at: std::collections::HashSet<String> = receiver.at("/r").iter().map(|r| r.header("relay-webhook-id")).collect();
            ids.iter().all(|id| at.contains(id)).then_some(())
        })
        .await;
        assert!(seen.is_some(), "each of {ids:?} was sent once at least");
    };
    let before = publish(2).await?;
    sent(&before).await;
    let since = chrono::Utc::now();
    let inside = publish(8).await?;
    sent(&inside).await;
    let until = chrono::Utc::now();
    let after = publish(2).await?;
    assert_eq!(receiver.wait_at("/r", 12 * 7, Duration::from_secs(30)).await.len(), 12 * 7, "every attempt of every event failed");
    let all_dead = eventually(Duration::from_secs(10), || async {
        let letters = rest.get("/v1/dead-letters").await.ok()?;
        (letters["dead_letters"].as_array()?.len() == 12).then_some(())
    })
    .await;
    assert!(all_dead.is_some(), "twelve dead letters");

    let path = format!("/v1/webhooks/{endpoint}/recover");
    let range = |dry: bool| json!({"since": since.to_rfc3339(), "until": until.to_rfc3339(), "dry_run": dry});
    let (status, body) = rest.post(&path, range(true)).await?;
    assert_eq!((status, body["would_recover"].as_u64()), (200, Some(8)), "a dry run counts the range: {body}");
    assert!(body["operation_id"].is_null(), "{body}");
    let mut admin = stack.admin().await?;
    let by_operator = admin
        .recover_endpoint(RecoverEndpointRequest {
            endpoint_id: endpoint.clone(),
            since: Some(prost_types::Timestamp { seconds: since.timestamp(), nanos: since.timestamp_subsec_nanos() as i32 }),
            until: Some(prost_types::Timestamp { seconds: until.timestamp(), nanos: until.timestamp_subsec_nanos() as i32 }),
            dry_run: true,
        })
        .await?
        .into_inner();
    assert_eq!(by_operator.would_recover, Some(8), "the operator's dry run over gRPC agrees");
    let backwards = json!({"since": until.to_rfc3339(), "until": since.to_rfc3339()});
    let (status, body) = rest.post(&path, backwards).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_range")), "{body}");
    let (status, body) = rest.post(&path, json!({"until": until.to_rfc3339()})).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("missing_field")), "{body}");

    receiver.reply("/r", Reply::Status(204));
    let (status, body) = rest.post(&path, range(false)).await?;
    assert_eq!(status, 202, "{body}");
    let op = body["operation_id"].as_str().expect("an operation id").to_owned();
    // The same range again while the first runs: it must send nothing twice.
    let (status, again) = rest.post(&path, range(false)).await?;
    assert_eq!(status, 202, "{again}");
    let op2 = again["operation_id"].as_str().unwrap().to_owned();

    // One a second: stop the api after the first pass, start it again, and
    // the operation goes on from where it was.
    let first_pass = eventually(Duration::from_secs(10), || async {
        let o = rest.get(&format!("/v1/operations/{op}")).await.ok()?;
        (num(&o["completed"]) >= 1).then_some(o)
    })
    .await
    .expect("the first pass ran");
    assert_eq!((first_pass["state"].as_str(), num(&first_pass["total"])), (Some("running"), 8), "{first_pass}");
    stack.stop_api().await?;
    let pg = stack.pg().await?;
    let (state, completed): (String, i32) =
        sqlx::query_as("SELECT state, completed FROM recover_operations WHERE id = $1::uuid").bind(&op).fetch_one(&pg).await?;
    assert!(state == "running" && completed < 8, "stopped part-way: {state} {completed}");
    stack.start_api().await?;
    let restarted = std::time::Instant::now();
    let done = finished(&rest, &op, Duration::from_secs(30)).await.expect("the operation finishes after the restart");
    assert_eq!(num(&done["completed"]), 8, "{done}");
    let second = finished(&rest, &op2, Duration::from_secs(20)).await.expect("the overlapping operation finishes");
    assert_eq!(num(&second["completed"]), 0, "the overlapping request found nothing left to send: {second}");

    let got = receiver.wait_at("/r", 12 * 7 + 8, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got_after: Vec<String> = receiver.at("/r")[12 * 7..].iter().map(|r| r.header("relay-webhook-id")).collect();
    assert_eq!(got.len(), 12 * 7 + 8);
    let mut sorted = got_after.clone();
    sorted.sort();
    let mut want = inside.clone();
    want.sort();
    assert_eq!(sorted, want, "exactly the range, each once; not {before:?} or {after:?}");
    // One a second: the restarted api's passes run a second apart, its
    // first no earlier than its start, so the last of what it released
    // arrives (rest - 1) s after the restart at the earliest. Measured from
    // the restart, not between arrivals: what passes before the stop
    // released waits for the api and may arrive with the first of the new
    // passes, and so may the first new ones while the dispatcher reconnects
    // (an earlier form of this check, between the first and last arrival,
    // failed that way on a loaded machine). The api's own start-up before
    // its first pass is the margin.
    let released_after_restart = 8 - completed;
    let last = receiver.at("/r")[12 * 7 + 7].at;
    let since_restart = last.saturating_duration_since(restarted);
    let floor = Duration::from_millis(950) * (released_after_restart.max(1) - 1) as u32;
    assert!(
        since_restart >= floor,
        "throttled at one a second: {released_after_restart} released after the restart, the last arrived {since_restart:?} after it"
    );
    let (status, _) = Rest::new(&stack.rest_url, Some(&stack.tenant("other").await?.api_key))
        .call(reqwest::Method::GET, &format!("/v1/operations/{op}"), None)
        .await?;
    assert_eq!(status, 404, "another tenant's operation does not exist for it");
    pg.close().await;
    stack.stop().await
}

/// The operational events that reached `path`, as (type, payload), first attempts only.
fn ops_events(receiver: &Receiver, path: &str) -> Vec<(String, Value)> {
    let mut seen = std::collections::HashSet::new();
    receiver
        .at(path)
        .into_iter()
        .filter(|r| seen.insert(r.header("relay-webhook-id")))
        .map(|r| {
            let v = r.json();
            (v["type"].as_str().unwrap_or_default().to_owned(), v["payload"].clone())
        })
        .collect()
}

/// The operation once it is done, within `within`.
async fn finished(rest: &Rest, op: &str, within: Duration) -> Option<Value> {
    eventually(within, || async {
        let o = rest.get(&format!("/v1/operations/{op}")).await.ok()?;
        (o["state"] == "done").then_some(o)
    })
    .await
}

/// An operations endpoint at `/ops` (named the environment's) and an
/// endpoint at `/dead` for type `t`: their ids.
async fn ops_and_dead(rest: &Rest, receiver: &Receiver) -> anyhow::Result<(String, String)> {
    let (ops, _) = rest.endpoint(&receiver.url("/ops"), &["nothing.here"]).await?;
    let (dead, _) = rest.endpoint(&receiver.url("/dead"), &["t"]).await?;
    assert_eq!(rest.call(reqwest::Method::PUT, "/v1/operations-endpoint", Some(json!({"endpoint_id": ops}))).await?.0, 200);
    Ok((ops, dead))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operations_endpoint_hears_that_an_endpoint_is_failing_recovered_and_gone() -> anyhow::Result<()> {
    // The first probe comes 2 s after the circuit opens: the test makes the
    // endpoint healthy once it has heard "failing" (announced within a
    // second or so), while deliveries are held to probe.
    let stack = Stack::start(Options::default().probes(Duration::from_secs(2), Duration::from_secs(4))).await?;
    let tenant = stack.tenant("ops").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/bad", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (ops, _) = rest.endpoint(&receiver.url("/ops"), &["nothing.here"]).await?;
    let (bad, _) = rest.endpoint(&receiver.url("/bad"), &["t"]).await?;
    let (status, body) = rest.call(reqwest::Method::PUT, "/v1/operations-endpoint", Some(json!({"endpoint_id": ops}))).await?;
    assert_eq!((status, body["endpoint_id"].as_str()), (200, Some(ops.as_str())), "{body}");
    assert_eq!(rest.get("/v1/operations-endpoint").await?["endpoint_id"], ops.as_str());
    let other = Rest::new(&stack.rest_url, Some(&stack.tenant("other").await?.api_key));
    let (status, _) = other.call(reqwest::Method::PUT, "/v1/operations-endpoint", Some(json!({"endpoint_id": ops}))).await?;
    assert_eq!(status, 404, "another tenant's endpoint cannot be named");

    // Failing for the quiet period, over enough attempts: announced.
    let mut failing = None;
    for n in 0..400 {
        rest.publish("t", json!({"n": n})).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        failing = ops_events(&receiver, "/ops").into_iter().find(|(t, _)| t == "endpoint.failing");
        if failing.is_some() {
            break;
        }
    }
    let failing = failing.expect("endpoint.failing announced");
    assert_eq!(failing.1["endpoint_id"].as_str(), Some(bad.as_str()), "{failing:?}");
    assert!(num(&failing.1["consecutive_failures"]) >= 5 && failing.1["failing_since"].is_string(), "{failing:?}");

    receiver.reply("/bad", Reply::Status(204));
    let recovered = eventually(Duration::from_secs(20), || async {
        ops_events(&receiver, "/ops").into_iter().find(|(t, _)| t == "endpoint.recovered")
    })
    .await
    .expect("endpoint.recovered announced after the probe succeeded");
    assert_eq!(recovered.1["endpoint_id"], bad.as_str());

    receiver.reply("/bad", Reply::Status(410));
    rest.publish("t", json!({"n": 2})).await?;
    let gone =
        eventually(Duration::from_secs(20), || async { ops_events(&receiver, "/ops").into_iter().find(|(t, _)| t == "endpoint.disabled") })
            .await
            .expect("endpoint.disabled announced");
    assert_eq!((gone.1["endpoint_id"].as_str(), gone.1["reason"].as_str()), (Some(bad.as_str()), Some("gone")), "{gone:?}");
    // Signed like any webhook, with the operations endpoint's secret.
    let first = &receiver.at("/ops")[0];
    assert!(first.header("relay-webhook-signature").starts_with("v1="), "signed");
    assert!(receiver.at("/bad").iter().all(|r| r.json()["type"] == "t"), "the failing endpoint itself hears nothing operational");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_announced_together_and_an_operations_endpoint_never_hears_about_itself() -> anyhow::Result<()> {
    // No circuit: each delivery dies after its own seven quick attempts.
    let opts = Options::default().tiers("0,10,10,10,10,10,10").circuit_off();
    let stack = Stack::start(opts).await?;
    let tenant = stack.tenant("ops-dead").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/dead", Reply::Status(500));
    // The operations endpoint fails too: its own dead letter must not be
    // announced to it.
    receiver.reply("/ops", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (_, dead) = ops_and_dead(&rest, &receiver).await?;
    for n in 0..3 {
        rest.publish("t", json!({"n": n})).await?;
    }
    // One announcement, with the count, tried seven times at the failing
    // operations endpoint.
    let got = receiver.wait_at("/ops", 7, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 7, "the announcement's seven attempts");
    let events = ops_events(&receiver, "/ops");
    assert_eq!(events.len(), 1, "{events:?}");
    let (kind, payload) = &events[0];
    assert_eq!(
        (kind.as_str(), payload["endpoint_id"].as_str(), &payload["count"]),
        ("delivery.dead_lettered", Some(dead.as_str()), &json!(3))
    );
    // Its own dead letter is counted, and never sent to it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(receiver.at("/ops").len(), 7, "the operations endpoint heard nothing about itself");
    stack.stop().await
}

/// Recovery takes held deliveries as well as dead ones: with the circuit
/// open and its probe minutes away, the tenant's recovery sends what is held
/// at once, each delivery once. It refuses another tenant's endpoint (404)
/// and a disabled one (nothing would receive what it sends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovering_a_range_sends_held_deliveries_at_once_and_refuses_a_foreign_or_disabled_endpoint() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().probes(Duration::from_secs(300), Duration::from_secs(600))).await?;
    let tenant = stack.tenant("recover-held").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/down", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/down"), &["t"]).await?;
    let since = chrono::Utc::now() - chrono::TimeDelta::seconds(1);
    let (mut events, _) = crate::health::publish_until(&rest, &endpoint, Duration::from_secs(20), |e| e["health"]["state"] == "open").await;
    for n in 0..5 {
        events.push(rest.publish("t", json!({"held": n})).await?);
    }
    let pg = stack.pg().await?;
    // Settled: every event has its delivery and none is pending (held, or
    // dead if its seven attempts ran out before the circuit opened).
    let (held, dead) = eventually(Duration::from_secs(10), || async {
        let (pending, held, all) = crate::health::counts(&pg, &endpoint).await.ok()?;
        (all == events.len() as i64 && pending == 0 && held >= 5).then_some((held, all - held))
    })
    .await
    .expect("everything held or dead, nothing pending");
    let sent_before = receiver.at("/down").len();
    let until = chrono::Utc::now() + chrono::TimeDelta::seconds(1);
    let range = |dry: bool| json!({"since": since.to_rfc3339(), "until": until.to_rfc3339(), "dry_run": dry});
    let path = format!("/v1/webhooks/{endpoint}/recover");
    let (status, body) = rest.post(&path, range(true)).await?;
    assert_eq!((status, body["would_recover"].as_i64()), (200, Some(held + dead)), "held and dead alike: {body}");

    let other = Rest::new(&stack.rest_url, Some(&stack.tenant("recover-other").await?.api_key));
    let (status, body) = other.post(&path, range(false)).await?;
    assert_eq!((status, body["reason"].as_str()), (404, Some("not_found")), "another tenant's endpoint: {body}");
    let (off, _) = rest.endpoint(&receiver.url("/off"), &["t"]).await?;
    assert_eq!(rest.post(&format!("/v1/webhooks/{off}/disable"), json!({})).await?.0, 200);
    let (status, body) = rest.post(&format!("/v1/webhooks/{off}/recover"), range(false)).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("endpoint_inactive")), "a disabled endpoint: {body}");
    assert_eq!(receiver.at("/down").len(), sent_before, "refusals send nothing, and no probe came");

    receiver.reply("/down", Reply::Status(204));
    let (status, body) = rest.post(&path, range(false)).await?;
    assert_eq!(status, 202, "{body}");
    let op = body["operation_id"].as_str().expect("an operation id").to_owned();
    let done = finished(&rest, &op, Duration::from_secs(30)).await.expect("the recovery finishes");
    assert_eq!(num(&done["completed"]) as i64, held + dead, "{done}");
    let all_delivered = eventually(Duration::from_secs(20), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE endpoint_id = $1::uuid AND state = 'delivered'")
            .bind(&endpoint)
            .fetch_one(&pg)
            .await
            .ok()?;
        (n == events.len() as i64).then_some(())
    })
    .await;
    assert!(all_delivered.is_some(), "every held and dead delivery delivered");
    let mut after: Vec<String> = receiver.at("/down")[sent_before..].iter().map(|r| r.header("relay-webhook-id")).collect();
    after.sort();
    let mut want = events.clone();
    want.sort();
    assert_eq!(after, want, "each event once, long before any probe");
    pg.close().await;
    stack.stop().await
}

/// `delivery.dead_lettered` comes at most once a minute per endpoint: dead
/// letters after an announcement wait out the minute and come counted in
/// the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_after_an_announcement_wait_out_the_minute_and_come_counted_together() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,10,10,10,10,10,10").circuit_off()).await?;
    let tenant = stack.tenant("ops-minute").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/dead", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (_, dead) = ops_and_dead(&rest, &receiver).await?;
    for n in 0..2 {
        rest.publish("t", json!({"first": n})).await?;
    }
    let first = receiver.wait_at("/ops", 1, Duration::from_secs(20)).await;
    assert_eq!(first.len(), 1, "the first announcement");
    let first_at = first[0].at;
    assert_eq!(first[0].json()["payload"]["count"], 2, "{}", first[0].json());

    for n in 0..3 {
        rest.publish("t", json!({"second": n})).await?;
    }
    // Dead well inside the minute, and not announced yet.
    let five = eventually(Duration::from_secs(10), || async {
        let letters = rest.get("/v1/dead-letters").await.ok()?;
        (letters["dead_letters"].as_array()?.len() == 5).then_some(())
    })
    .await;
    assert!(five.is_some(), "five dead letters");
    assert!(first_at.elapsed() < Duration::from_secs(50), "the second batch died inside the minute");
    assert_eq!(receiver.at("/ops").len(), 1, "nothing more announced inside the minute");

    let both = receiver.wait_at("/ops", 2, Duration::from_secs(90)).await;
    assert_eq!(both.len(), 2, "the second announcement, once the minute is out");
    let gap = both[1].at.duration_since(first_at);
    assert!(gap >= Duration::from_secs(58), "announced {gap:?} after the first");
    let payload = both[1].json()["payload"].clone();
    assert_eq!((payload["endpoint_id"].as_str(), &payload["count"]), (Some(dead.as_str()), &json!(3)), "{payload}");
    stack.stop().await
}
