//! Endpoint health: a failing endpoint's circuit opens and its work is held
//! where no relay pass looks; a probe brings it back and the held work is
//! released in order, throttled; a 410 disables at once; Retry-After is
//! honoured; an endpoint failing for its environment's window is disabled,
//! probed and re-enabled by its first success; nothing is lost on the way.

use std::time::{Duration, SystemTime};

use relay_contracts::relay::admin::v1::SetDisablePolicyRequest;
use relay_tests::{
    Options, Receiver, Reply, Rest, Stack, eventually,
    flaky::{Behaviour, Flaky},
};
use serde_json::{Value, json};

/// A proto3-JSON 64-bit number (a string) or 32-bit one (a number).
pub(crate) fn num(v: &Value) -> u64 {
    v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok())).unwrap_or_else(|| panic!("not a number: {v}"))
}

async fn endpoint_where(rest: &Rest, id: &str, within: Duration, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let path = format!("/v1/webhooks/{id}");
    let found = eventually(within, || async { rest.get(&path).await.ok().filter(|e| ok(e)) }).await;
    match found {
        Some(e) => e,
        None => panic!("endpoint never {what}: {}", rest.get(&path).await.unwrap_or_default()),
    }
}

/// An endpoint's deliveries, in one snapshot: pending, held, and all of them.
pub(crate) async fn counts(pg: &sqlx::PgPool, endpoint: &str) -> anyhow::Result<(i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'held'), count(*)
         FROM webhook_deliveries WHERE endpoint_id = $1::uuid",
    )
    .bind(endpoint)
    .fetch_one(pg)
    .await?)
}

/// Publishes one event every 50 ms until `done` says the endpoint is as
/// wanted (at most `within`); returns the events and the endpoint as read.
pub(crate) async fn publish_until(rest: &Rest, id: &str, within: Duration, done: impl Fn(&Value) -> bool) -> (Vec<String>, Value) {
    let deadline = std::time::Instant::now() + within;
    let mut events = Vec::new();
    loop {
        events.push(rest.publish("t", json!({"n": events.len()})).await.expect("published"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let ep = rest.get(&format!("/v1/webhooks/{id}")).await.expect("read");
        if done(&ep) {
            return (events, ep);
        }
        assert!(std::time::Instant::now() < deadline, "the endpoint never got there: {ep}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_opens_on_evidence_holds_its_work_where_no_pass_looks_is_probed_with_its_most_tried_delivery_and_recovers()
-> anyhow::Result<()> {
    let stack = Stack::start(Options::default().probes(Duration::from_secs(5), Duration::from_secs(10))).await?;
    let tenant = stack.tenant("circuit").await?;
    let receiver = Receiver::start_https().await?;
    receiver.reply("/down", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/down"), &["t"]).await?;

    // Failures, retries failing too, for the quiet period and over enough
    // attempts: the circuit opens.
    let (mut events, ep) = publish_until(&rest, &endpoint, Duration::from_secs(20), |e| e["health"]["state"] == "open").await;
    let h = &ep["health"];
    assert!(num(&h["consecutive_failures"]) >= 5 && num(&h["recent_failures"]) >= 5, "{ep}");
    assert!(num(&h["recent_failures"]) * 10 >= num(&h["recent_attempts"]) * 9, "at least 90 % failed: {ep}");
    assert!(h["next_probe_at"].is_string() && h["last_failure_at"].is_string() && h["last_success_at"].is_null(), "{ep}");
    assert_eq!((ep["enabled"].as_bool(), ep["disabled_reason"].is_null()), (Some(true), true), "an open circuit is not a disable");
    let sent_before = receiver.at("/down").len();

    for n in 0..10 {
        events.push(rest.publish("t", json!({"late": n})).await?);
    }
    // Held, not pending: the due scan never meets them, however many. Every
    // event expanded first (the late ones reach the endpoint a moment after
    // their 202), so the count read is the count that stays.
    let pg = stack.pg().await?;
    let settled = eventually(Duration::from_secs(10), || async {
        // One snapshot: counted apart, a delivery expanded between two reads
        // slipped through as neither pending nor held.
        let (pending, held, all) = counts(&pg, &endpoint).await.ok()?;
        (all == events.len() as i64 && pending == 0 && held >= 10).then_some(held)
    })
    .await;
    let held = settled.unwrap_or_else(|| panic!("everything open held, nothing pending"));
    assert_eq!(receiver.at("/down").len(), sent_before, "nothing is sent while the circuit is open and no probe is due");
    let ep = rest.get(&format!("/v1/webhooks/{endpoint}")).await?;
    assert_eq!(num(&ep["held_deliveries"]) as i64, held, "{ep}");
    let metrics = reqwest::get(&stack.metrics_url).await?.text().await?;
    assert!(metrics.contains("relay_endpoint_circuits{state=\"open\"} 1"), "{metrics}");
    assert!(metrics.contains(&format!("relay_queue_depth{{queue=\"deliveries_held\"}} {held}")), "{metrics}");

    // The tenant sees them, a page at a time, in the order they fall due.
    let (mut listed, mut cursor) = (Vec::new(), String::new());
    for _ in 0..100 {
        let page = rest.get(&format!("/v1/webhooks/{endpoint}/held?limit=4&cursor={cursor}")).await?;
        let items = page["deliveries"].as_array().cloned().unwrap_or_default();
        assert!(items.len() <= 4, "{page}");
        listed.extend(items);
        cursor = page["next_cursor"].as_str().unwrap_or_default().to_owned();
        if cursor.is_empty() {
            break;
        }
    }
    assert_eq!(listed.len() as i64, held, "every held delivery is listed once");
    let due: Vec<&str> = listed.iter().map(|d| d["next_attempt_at"].as_str().unwrap()).collect();
    assert!(due.windows(2).all(|w| w[0] <= w[1]), "listed in the order they fall due: {due:?}");
    assert!(listed.iter().all(|d| d["state"] == "DELIVERY_STATE_HELD"));
    let most = listed.iter().map(|d| num(&d["attempt"])).max().unwrap();
    assert!(most > 1, "holding keeps the attempt count: some held delivery was tried before");
    let late: Vec<&Value> =
        listed.iter().filter(|d| events[events.len() - 10..].contains(&d["event_id"].as_str().unwrap().to_owned())).collect();
    assert_eq!(late.len(), 10, "the events published while open are held");
    assert!(late.iter().all(|d| d["attempt"] == 1), "never tried");
    let (status, body) = rest.call(reqwest::Method::GET, &format!("/v1/webhooks/{endpoint}/held?cursor=nonsense"), None).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_cursor")), "{body}");

    // The receiver comes back. The probe is the held delivery with the most
    // attempts (the earliest due of those): a receiver that accepts retries
    // answers it. Then the rest arrive, once each.
    receiver.reply("/down", Reply::Status(204));
    let all = receiver.wait_at("/down", sent_before + held as usize, Duration::from_secs(30)).await;
    assert_eq!(all.len(), sent_before + held as usize, "every held delivery arrives once");
    let probe = all[sent_before].header("relay-webhook-id");
    let expected = listed.iter().find(|d| num(&d["attempt"]) == most).unwrap();
    assert_eq!(probe, expected["event_id"].as_str().unwrap(), "the probe is the most tried held delivery");
    let mut arrived: Vec<String> = all[sent_before..].iter().map(|r| r.header("relay-webhook-id")).collect();
    arrived.sort();
    let mut want: Vec<String> = listed.iter().map(|d| d["event_id"].as_str().unwrap().to_owned()).collect();
    want.sort();
    assert_eq!(arrived, want);

    let ep = endpoint_where(&rest, &endpoint, Duration::from_secs(5), "closed", |e| e["health"]["state"] == "closed").await;
    assert_eq!(ep["health"]["consecutive_failures"], 0, "{ep}");
    assert!(ep["health"]["last_success_at"].is_string() && ep["health"]["next_probe_at"].is_null(), "{ep}");
    assert_eq!(num(&ep["held_deliveries"]), 0, "{ep}");
    // Each delivered one kept its attempt number: attempted as the retry it was.
    let d = rest.deliveries(expected["event_id"].as_str().unwrap()).await?;
    assert_eq!(d[0]["attempts"].as_array().unwrap().len() as u64, most, "{d:?}");
    pg.close().await;
    stack.stop().await
}

/// The outside tester's receiver: 500 to each webhook's first request, 200
/// to its retry. 60 events at once: with the old circuit (five failures in
/// a row) none arrived in 90 s; now each arrives on its second attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_refuses_each_first_request_gets_every_event_on_its_retry() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,200,200,200,200,200,200")).await?;
    let tenant = stack.tenant("not-ready").await?;
    let receiver = Receiver::start_https().await?;
    receiver.reply("/not-ready", Reply::Flaky(Flaky::new(Behaviour::FailFirst(500))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/not-ready"), &["t"]).await?;
    let events = futures::future::try_join_all((0..60).map(|n| rest.publish("t", json!({"n": n})))).await?;
    let got = receiver.wait_at("/not-ready", 120, Duration::from_secs(30)).await;
    let mut per_event: std::collections::HashMap<String, usize> = Default::default();
    for r in &got {
        *per_event.entry(r.header("relay-webhook-id")).or_default() += 1;
    }
    assert_eq!(per_event.len(), 60, "every event arrived");
    assert!(per_event.values().all(|&n| n == 2), "each on its second request: {per_event:?}");
    for id in &events {
        let d = eventually(Duration::from_secs(5), || async {
            rest.deliveries(id).await.ok().filter(|d| d[0]["state"] == "DELIVERY_STATE_DELIVERED")
        })
        .await;
        assert!(d.is_some_and(|d| d[0]["attempts"].as_array().unwrap().len() == 2), "{id}");
    }
    let ep = rest.get(&format!("/v1/webhooks/{endpoint}")).await?;
    assert_eq!(ep["health"]["state"], "closed", "a receiver whose retries succeed is not failing: {ep}");
    stack.stop().await
}

/// A delivery held longer than its environment allows becomes a dead letter
/// `endpoint_failing`, which replays like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_held_past_its_environments_bound_becomes_a_replayable_dead_letter() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("held-too-long").await?;
    let mut admin = stack.admin().await?;
    let policy =
        |max_held_secs| SetDisablePolicyRequest { environment_id: tenant.environment_id.clone(), max_held_secs, ..Default::default() };
    let err = admin.set_disable_policy(policy(2_592_001)).await.expect_err("out of range");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("max_held_secs") && err.message().contains("2592001"), "{err:?}");
    let env = admin.set_disable_policy(policy(0)).await?.into_inner().environment.unwrap();
    assert_eq!(env.max_held_secs, 7 * 24 * 3600, "the default: the dead-letter window");
    admin.set_disable_policy(policy(2)).await?;

    let receiver = Receiver::start_https().await?;
    receiver.reply("/gone", Reply::Status(410));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/gone"), &["t"]).await?;
    let event = rest.publish("t", json!({"n": 1})).await?;
    endpoint_where(&rest, &endpoint, Duration::from_secs(20), "disabled as gone", |e| e["disabled_reason"] == "gone").await;
    let letter = eventually(Duration::from_secs(20), || async {
        let letters = rest.get("/v1/dead-letters").await.ok()?;
        letters["dead_letters"].as_array()?.iter().find(|l| l["event_id"] == event.as_str()).cloned()
    })
    .await
    .unwrap_or_else(|| panic!("never dead-lettered"));
    assert_eq!((letter["reason"].as_str(), num(&letter["attempts"])), (Some("endpoint_failing"), 1), "{letter}");
    let d = rest.deliveries(&event).await?;
    assert_eq!(d[0]["state"], "DELIVERY_STATE_DEAD", "{d:?}");

    // The tenant fixes the receiver, enables the endpoint and replays it.
    receiver.reply("/gone", Reply::Status(204));
    rest.post(&format!("/v1/webhooks/{endpoint}/enable"), json!({})).await?;
    let (status, body) = rest.post(&format!("/v1/dead-letters/{}/replay", letter["id"].as_str().unwrap()), json!({})).await?;
    assert!(status < 300, "{status} {body}");
    let got = receiver.wait_at("/gone", 2, Duration::from_secs(20)).await;
    assert_eq!(got.iter().map(|r| r.header("relay-webhook-id")).collect::<Vec<_>>(), [event.clone(), event]);
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_disables_at_once_holds_what_follows_without_probing_and_enabling_releases_it() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("gone").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/gone", Reply::Status(410));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/gone"), &["t"]).await?;
    let e1 = rest.publish("t", json!({"n": 1})).await?;
    assert_eq!(receiver.wait_at("/gone", 1, Duration::from_secs(20)).await.len(), 1);
    let ep = endpoint_where(&rest, &endpoint, Duration::from_secs(5), "disabled as gone", |e| e["disabled_reason"] == "gone").await;
    assert_eq!(ep["enabled"], false, "{ep}");
    assert!(ep["health"]["next_probe_at"].is_null(), "a receiver that said 410 is not probed: {ep}");

    let e2 = rest.publish("t", json!({"n": 2})).await?;
    let e3 = rest.publish("t", json!({"n": 3})).await?;
    let pg = stack.pg().await?;
    let held = eventually(Duration::from_secs(5), || async {
        counts(&pg, &endpoint).await.ok().map(|(pending, held, _)| (pending, held)).filter(|c| *c == (0, 3))
    })
    .await;
    assert_eq!(held, Some((0, 3)), "events after the 410 are held, not dropped: (pending, held, all) {:?}", counts(&pg, &endpoint).await?);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(receiver.at("/gone").len(), 1, "one attempt, then nothing");
    let d1 = rest.deliveries(&e1).await?;
    assert_eq!((d1[0]["state"].as_str(), &d1[0]["attempt"]), (Some("DELIVERY_STATE_HELD"), &json!(2)), "{d1:?}");
    assert_eq!(d1[0]["attempts"][0]["http_status"], 410, "{d1:?}");

    receiver.reply("/gone", Reply::Status(204));
    let (status, body) = rest.post(&format!("/v1/webhooks/{endpoint}/enable"), json!({})).await?;
    assert_eq!((status, body["enabled"].as_bool(), body["disabled_reason"].is_null()), (200, Some(true), true), "{body}");
    let got = receiver.wait_at("/gone", 4, Duration::from_secs(20)).await;
    let mut ids: Vec<String> = got[1..].iter().map(|r| r.header("relay-webhook-id")).collect();
    ids.sort();
    let mut want = vec![e1, e2, e3];
    want.sort();
    assert_eq!(ids, want, "enabling releases every held delivery, once each");
    endpoint_where(&rest, &endpoint, Duration::from_secs(5), "emptied and closed", |e| {
        num(&e["held_deliveries"]) == 0 && e["health"]["state"] == "closed"
    })
    .await;
    pg.close().await;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabling_an_endpoint_that_holds_deliveries_makes_them_dead_letters() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("gone-then-off").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/gone", Reply::Status(410));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/gone"), &["t"]).await?;
    rest.publish("t", json!({"n": 1})).await?;
    endpoint_where(&rest, &endpoint, Duration::from_secs(20), "disabled as gone", |e| e["disabled_reason"] == "gone").await;
    rest.publish("t", json!({"n": 2})).await?;
    endpoint_where(&rest, &endpoint, Duration::from_secs(5), "holding two", |e| num(&e["held_deliveries"]) == 2).await;

    let (status, body) = rest.post(&format!("/v1/webhooks/{endpoint}/disable"), json!({})).await?;
    assert_eq!((status, body["disabled_reason"].as_str(), num(&body["held_deliveries"])), (200, Some("manual"), 0), "{body}");
    let letters = rest.get("/v1/dead-letters").await?;
    let reasons: Vec<&str> = letters["dead_letters"].as_array().unwrap().iter().map(|l| l["reason"].as_str().unwrap()).collect();
    assert_eq!(reasons, ["endpoint_disabled", "endpoint_disabled"], "{letters}");
    stack.stop().await
}

/// Attempts of an endpoint handed to the broker and not yet reported.
async fn handed_out(pg: &sqlx::PgPool, endpoint: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries WHERE endpoint_id = $1::uuid AND state = 'pending' AND dispatched_at IS NOT NULL",
    )
    .bind(endpoint)
    .fetch_one(pg)
    .await?)
}

/// An endpoint whose last attempt went unanswered (a timeout) is handed one
/// attempt at a time: its backlog waits in Postgres, not in the broker or a
/// lane behind a receiver that may be timing out; its first success gives
/// it its whole cap back. A fast 5xx does not narrow it (a receiver that
/// fails sometimes keeps its pace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_whose_last_attempt_timed_out_is_handed_one_attempt_at_a_time_until_it_succeeds() -> anyhow::Result<()> {
    // The retry comes 500 ms after the first failure: time for the test to
    // see that failure and change the receiver before the retry arrives.
    let stack = Stack::start(Options {
        endpoint_cap: 16,
        attempt_timeout: Duration::from_secs(3),
        retry_tiers: relay_domain::schedule::RetrySchedule::parse("0,500,500,500,500,500,500")?,
        ..Options::default()
    })
    .await?;
    let tenant = stack.tenant("wobbly").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/wobbly"), &["t"]).await?;
    let pg = stack.pg().await?;

    // A fast 500: the endpoint keeps its cap.
    receiver.reply("/wobbly", Reply::Status(500));
    let mut events = vec![rest.publish("t", json!({"n": 0})).await?];
    endpoint_where(&rest, &endpoint, Duration::from_secs(20), "failed once", |e| e["health"]["consecutive_failures"] == 1).await;
    let narrowed: bool =
        sqlx::query_scalar("SELECT one_at_a_time FROM endpoint_health WHERE endpoint_id = $1::uuid").bind(&endpoint).fetch_one(&pg).await?;
    assert!(!narrowed, "a fast 5xx does not narrow the endpoint");

    // Its retry times out (held past the 3 s attempt timeout).
    receiver.reply("/wobbly", Reply::Hang(Duration::from_secs(4)));
    endpoint_where(&rest, &endpoint, Duration::from_secs(20), "timed out", |e| e["health"]["consecutive_failures"] == 2).await;
    // Slow but answering: each request is held 2 s, then answered 200.
    receiver.reply("/wobbly", Reply::Hang(Duration::from_secs(2)));
    for n in 1..=8 {
        events.push(rest.publish("t", json!({"n": n})).await?);
    }
    let (mut most, mut waiting) = (0, 0);
    for _ in 0..15 {
        most = most.max(handed_out(&pg, &endpoint).await?);
        let (pending, _, _) = counts(&pg, &endpoint).await?;
        waiting = waiting.max(pending);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(waiting, 9, "all nine deliveries were pending while the first slow attempt ran");
    assert_eq!(most, 1, "one attempt handed out at a time while the last attempt had timed out");

    // The slow attempt succeeds: the whole cap is back, and the rest are
    // handed out together (the dispatcher still sends one at a time).
    let mut most_after = 0;
    for _ in 0..40 {
        most_after = most_after.max(handed_out(&pg, &endpoint).await?);
        if most_after >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(most_after >= 4, "after a success more than one attempt is handed out again, saw at most {most_after}");
    receiver.reply("/wobbly", Reply::Status(204));
    let got = receiver.wait_at("/wobbly", 11, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 11, "a failure and a timeout, then each of the nine events once");
    let mut ids: Vec<String> = got[2..].iter().map(|r| r.header("relay-webhook-id")).collect();
    ids.sort();
    events.sort();
    assert_eq!(ids, events, "every event delivered once");
    pg.close().await;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_on_429_and_503_puts_the_next_attempt_no_earlier_than_asked() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("busy").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/busy", Reply::StatusWith(429, "retry-after", "2".into()));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/busy"), &["t"]).await?;
    let event = rest.publish("t", json!({})).await?;
    assert_eq!(receiver.wait_at("/busy", 1, Duration::from_secs(20)).await.len(), 1);
    // The second answer asks with an HTTP date, four seconds on.
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(4));
    receiver.reply("/busy", Reply::StatusWith(503, "retry-after", date));
    assert_eq!(receiver.wait_at("/busy", 2, Duration::from_secs(20)).await.len(), 2);
    receiver.reply("/busy", Reply::Status(204));
    let got = receiver.wait_at("/busy", 3, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 3);
    let (gap1, gap2) = (got[1].at - got[0].at, got[2].at - got[1].at);
    assert!(gap1 >= Duration::from_secs(2) && gap1 < Duration::from_secs(10), "Retry-After: 2 was honoured: {gap1:?}");
    // A date has whole seconds: at least 4 s after it was written, less the
    // second it may have been truncated by and the 2 s already spent.
    assert!(gap2 >= Duration::from_millis(900), "Retry-After as a date was honoured: {gap2:?}");
    let d = eventually(Duration::from_secs(5), || async {
        rest.deliveries(&event).await.ok().filter(|d| d.first().is_some_and(|d| d["state"] == "DELIVERY_STATE_DELIVERED"))
    })
    .await;
    let d = d.unwrap_or_else(|| panic!("never recorded as delivered"));
    let statuses: Vec<u64> = d[0]["attempts"].as_array().unwrap().iter().map(|a| num(&a["http_status"])).collect();
    assert_eq!(statuses, [429, 503, 204], "each asked-for wait still counted as an attempt");
    stack.stop().await
}

/// A 429 is back-pressure: the endpoint's next request waits as long as
/// asked (whichever delivery it is), and the endpoint is not failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_slows_the_whole_endpoint_as_asked_and_is_not_a_failure() -> anyhow::Result<()> {
    let stack = Stack::start(Options { endpoint_cap: 8, ..Options::default().tiers("0,100,100,100,100,100,100") }).await?;
    let tenant = stack.tenant("slow-down").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/busy", Reply::StatusWith(429, "retry-after", "2".into()));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/busy"), &["t"]).await?;
    rest.publish("t", json!({"n": 0})).await?;
    assert_eq!(receiver.wait_at("/busy", 1, Duration::from_secs(20)).await.len(), 1);
    receiver.reply("/busy", Reply::Status(204));
    // Other events are due at once, but the endpoint asked for 2 s.
    let events = futures::future::try_join_all((1..=5).map(|n| rest.publish("t", json!({"n": n})))).await?;
    let got = receiver.wait_at("/busy", 7, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 7, "the first event twice, five others once");
    let gap = got[1].at - got[0].at;
    assert!(gap >= Duration::from_millis(1900), "the next request to the endpoint waited as asked: {gap:?}");
    let ids: std::collections::HashSet<String> = got.iter().map(|r| r.header("relay-webhook-id")).collect();
    assert!(events.iter().all(|e| ids.contains(e)));
    let ep = rest.get(&format!("/v1/webhooks/{endpoint}")).await?;
    assert_eq!((ep["health"]["state"].as_str(), &ep["health"]["consecutive_failures"]), (Some("closed"), &json!(0)), "{ep}");
    assert_eq!(ep["health"]["recent_failures"], 0, "a 429 counts neither way: {ep}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_failing_for_its_window_is_disabled_its_events_held_and_its_first_successful_probe_re_enables_it() -> anyhow::Result<()>
{
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("failing").await?;
    let mut admin = stack.admin().await?;
    let policy = |after, min| SetDisablePolicyRequest {
        environment_id: tenant.environment_id.clone(),
        disable_after_secs: after,
        disable_min_failures: min,
        ..Default::default()
    };
    for (after, min, reason) in [(2_592_001, 3, "disable_window_out_of_range"), (1, 100_001, "disable_min_failures_out_of_range")] {
        let err = admin.set_disable_policy(policy(after, min)).await.expect_err("out of range");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        let said = err.metadata().get(relay_contracts::ERROR_REASON_METADATA).and_then(|v| v.to_str().ok());
        assert_eq!(said, Some(reason), "{err:?}");
        assert!(err.message().contains(&after.max(min).to_string()), "the message names the number: {err:?}");
    }
    let env = admin.set_disable_policy(policy(1, 3)).await?.into_inner().environment.unwrap();
    assert_eq!((env.disable_after_secs, env.disable_min_failures), (1, 3));

    let receiver = Receiver::start().await?;
    receiver.reply("/flaky", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/flaky"), &["t"]).await?;
    // Events keep coming while it fails, so probes keep failing too.
    let mut events = Vec::new();
    let mut disabled = None;
    for n in 0..100 {
        events.push(rest.publish("t", json!({"n": n})).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ep = rest.get(&format!("/v1/webhooks/{endpoint}")).await?;
        if ep["disabled_reason"] == "failing" {
            disabled = Some(ep);
            break;
        }
    }
    let ep = disabled.expect("disabled as failing within 10 s of failures");
    assert_eq!(ep["enabled"], false, "{ep}");
    assert!(ep["health"]["next_probe_at"].is_string(), "a failing endpoint is probed: {ep}");
    let after = rest.publish("t", json!({"after": true})).await?;
    events.push(after.clone());
    let held = eventually(Duration::from_secs(5), || async {
        let d = rest.deliveries(&after).await.ok()?;
        (d.first()?["state"] == "DELIVERY_STATE_HELD").then_some(())
    })
    .await;
    assert!(held.is_some(), "an event for an endpoint disabled as failing is held: {:?}", rest.deliveries(&after).await?);

    receiver.reply("/flaky", Reply::Status(204));
    let ep = endpoint_where(&rest, &endpoint, Duration::from_secs(20), "re-enabled", |e| e["enabled"] == true).await;
    assert!(ep["disabled_reason"].is_null(), "{ep}");
    // Nothing lost: every event is delivered, or dead after its seven attempts.
    for id in &events {
        let settled = eventually(Duration::from_secs(20), || async {
            let d = rest.deliveries(id).await.ok()?;
            let state = d.first()?["state"].as_str()?.to_owned();
            (state == "DELIVERY_STATE_DELIVERED" || state == "DELIVERY_STATE_DEAD").then_some((state, d[0]["attempt"].clone()))
        })
        .await;
        match settled {
            Some((state, attempt)) => assert!(state == "DELIVERY_STATE_DELIVERED" || attempt == 7, "{id}: {state} at {attempt}"),
            None => panic!("{id} never settled: {:?}", rest.deliveries(id).await?),
        }
    }
    let delivered: std::collections::HashSet<String> = receiver.at("/flaky").iter().map(|r| r.header("relay-webhook-id")).collect();
    assert!(delivered.contains(&after), "the event held while disabled arrives after recovery");
    stack.stop().await
}
