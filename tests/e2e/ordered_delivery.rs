//! Issue 28, ordered delivery: an endpoint with `ordering: "per_key"` gets
//! each key's events one after another in publish order, keys in parallel,
//! from a receiver that fails at random and answers slowly, through two
//! dispatchers; each request says its key and its place in the key's
//! sequence. A head that dies lets its key move on, and its replay joins
//! the key's tail. The field's rules.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use relay_tests::{
    Options, Receiver, Reply, Rest, Stack,
    flaky::{Behaviour, Flaky},
};
use serde_json::{Value, json};

/// An ordered endpoint on this path; its id.
pub(crate) async fn ordered_endpoint(rest: &Rest, receiver: &Receiver, path: &str, extra: Value) -> anyhow::Result<String> {
    let mut body = json!({"url": receiver.url(path), "event_types": ["o"], "ordering": "per_key"});
    body.as_object_mut().expect("object").extend(extra.as_object().cloned().unwrap_or_default());
    let (status, created) = rest.post("/v1/webhooks", body).await?;
    anyhow::ensure!(status == 201, "creating an ordered endpoint answered {status}: {created}");
    anyhow::ensure!(created["endpoint"]["ordering"] == "per_key", "{created}");
    Ok(created["endpoint"]["id"].as_str().unwrap_or_default().to_owned())
}

/// Publishes an event of type `o` with a key; its id and its number in the key.
pub(crate) async fn publish_keyed(rest: &Rest, key: &str, payload: Value) -> anyhow::Result<(String, u64)> {
    let (status, reply) = rest.post("/v1/events", json!({"type": "o", "payload": payload, "ordering_key": key})).await?;
    anyhow::ensure!(status == 202, "publishing answered {status}: {reply}");
    Ok((reply["event_id"].as_str().unwrap_or_default().to_owned(), reply["ordering_sequence"].as_str().unwrap_or("0").parse()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_keys_events_arrive_in_publish_order_from_a_slow_randomly_failing_receiver_keys_in_parallel() -> anyhow::Result<()> {
    let options = Options { endpoint_cap: 64, ..Options::default() };
    // Attempts before a delivery is dead-lettered, under the stack's schedule.
    let attempts = options.retry_tiers.max_attempts();
    let mut stack = Stack::start(options).await?;
    stack.start_dispatcher().await?;
    let tenant = stack.tenant("ordered").await?;
    let receiver = Receiver::start().await?;
    // A quarter of the requests refused at random, every answer 20 ms late.
    let flaky = Flaky::new(Behaviour::SlowAndFailingRandomly { percent: 25, hold: Duration::from_millis(20) });
    receiver.reply("/ordered", Reply::Flaky(flaky.clone()));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    ordered_endpoint(&rest, &receiver, "/ordered", json!({"max_in_flight": 50})).await?;

    const KEYS: usize = 50;
    const EACH: usize = 20;
    // Ten publishers, five keys each, interleaving their keys: a key's
    // publish order is its publisher's.
    let mut tasks = Vec::new();
    for publisher in 0..10 {
        let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
        tasks.push(tokio::spawn(async move {
            for n in 0..EACH {
                for k in (publisher * 5)..(publisher * 5 + 5) {
                    let key = format!("key-{k}");
                    let (_, number) = publish_keyed(&rest, &key, json!({"key": key, "n": n})).await?;
                    anyhow::ensure!(number == n as u64 + 1, "{key}: event {n} numbered {number}");
                }
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }

    // Every event settled: delivered (a 200), or refused on all of its
    // attempts (a quarter refused at random: 0.25^attempts of the events, about
    // one run in sixteen, are dead-lettered and their key moves on, as
    // documented).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    let settled = || {
        let mut by_id: HashMap<String, (bool, u32)> = HashMap::new();
        for a in flaky.log() {
            let e = by_id.entry(a.id).or_default();
            if a.answer.status == 200 {
                e.0 = true;
            } else {
                e.1 += 1;
            }
        }
        by_id.values().filter(|(ok, refused)| *ok || *refused >= attempts).count()
    };
    while settled() < KEYS * EACH && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let got = receiver.at("/ordered");
    // Each request's answer, found by its webhook id and how many times that
    // id had come before (the receiver records a request when it answers).
    let answers: HashMap<(String, u32), u16> = flaky.log().into_iter().map(|a| ((a.id, a.nth), a.answer.status)).collect();
    let mut nth: HashMap<String, u32> = HashMap::new();
    let mut by_key: BTreeMap<String, Vec<(u64, u64, bool)>> = BTreeMap::new();
    for request in &got {
        let id = request.header("relay-webhook-id");
        let n = nth.entry(id.clone()).or_default();
        *n += 1;
        let status = answers.get(&(id, *n)).copied().unwrap_or_default();
        let body = request.json();
        let key = body["payload"]["key"].as_str().unwrap_or_default().to_owned();
        assert_eq!(request.header("relay-webhook-ordering-key"), key, "each request names its key");
        let sequence: u64 = request.header("relay-webhook-sequence").parse()?;
        by_key.entry(key).or_default().push((body["payload"]["n"].as_u64().unwrap_or(u64::MAX), sequence, status == 200));
    }
    assert_eq!(by_key.len(), KEYS, "every key arrived");
    let mut failures = 0;
    for (key, arrivals) in &by_key {
        // In arrival order: the events' numbers never go down (a retry
        // repeats the one before it), and each is delivered once.
        let ns: Vec<u64> = arrivals.iter().map(|a| a.0).collect();
        assert!(ns.windows(2).all(|w| w[0] <= w[1]), "{key}: arrivals out of publish order: {ns:?}");
        // Each event delivered once, or refused on every attempt (then
        // dead-lettered, and the key went on without it).
        let delivered: Vec<u64> = arrivals.iter().filter(|a| a.2).map(|a| a.0).collect();
        let dead: Vec<u64> = (0..EACH as u64)
            .filter(|n| !delivered.contains(n) && arrivals.iter().filter(|a| a.0 == *n && !a.2).count() == attempts as usize)
            .collect();
        let mut settled = delivered.clone();
        settled.extend(&dead);
        settled.sort_unstable();
        assert_eq!(settled, (0..EACH as u64).collect::<Vec<_>>(), "{key}: each event delivered once, in order: {arrivals:?}");
        assert!(dead.len() <= 1, "{key}: more dead letters than a random quarter of refusals makes likely: {dead:?}");
        // The sequence header: 1, 2, 3… one per event, the same on a retry.
        let sequences: Vec<u64> = arrivals.iter().map(|a| a.1).collect();
        assert!(arrivals.iter().all(|a| a.1 == a.0 + 1), "{key}: sequence numbers {sequences:?} for events {ns:?}");
        failures += arrivals.iter().filter(|a| !a.2).count();
    }
    assert!(failures > 100, "the receiver refused {failures} requests: the order held through retries");
    // Keys in parallel: many requests at once, never over the endpoint's cap.
    let most = receiver.most_at_once("/ordered");
    assert!((5..=50).contains(&most), "{most} requests at once");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_head_lets_its_key_move_on_and_its_replay_joins_the_keys_tail() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().circuit_off()).await?;
    let tenant = stack.tenant("ordered-dead").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/ordered", Reply::Flaky(Flaky::new(Behaviour::FailFate("doomed"))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    ordered_endpoint(&rest, &receiver, "/ordered", json!({})).await?;

    // The doomed head, two events queued behind it, and another key.
    publish_keyed(&rest, "a", json!({"fate": "doomed", "n": 1})).await?;
    publish_keyed(&rest, "a", json!({"n": 2})).await?;
    publish_keyed(&rest, "a", json!({"n": 3})).await?;
    publish_keyed(&rest, "b", json!({"n": 1})).await?;
    let got = receiver.wait_at("/ordered", 7 + 3, Duration::from_secs(60)).await;
    let seen: Vec<(String, u64, String)> = got
        .iter()
        .map(|r| {
            (r.header("relay-webhook-ordering-key"), r.json()["payload"]["n"].as_u64().unwrap_or(0), r.header("relay-webhook-sequence"))
        })
        .collect();
    let a: Vec<(u64, &str)> = seen.iter().filter(|s| s.0 == "a").map(|s| (s.1, s.2.as_str())).collect();
    let mut want = vec![(1, "1"); 7];
    want.extend([(2, "2"), (3, "3")]);
    assert_eq!(a, want, "key a: seven attempts of its head, then the rest in order");
    assert_eq!(seen.iter().filter(|s| s.0 == "b").count(), 1, "key b was not held up: {seen:?}");
    let first_b = seen.iter().position(|s| s.0 == "b").unwrap_or(usize::MAX);
    assert!(first_b < 7, "key b went while a's head was still failing: {seen:?}");

    // The dead letter, replayed once the receiver takes it: after what is
    // already queued, with the next number, before what comes later.
    // It says its key, and that two later deliveries of it went ahead (the
    // second counted once the first's outcome is recorded: it went out on
    // the first's 2xx, moments before).
    let mut letters = Vec::new();
    for _ in 0..50 {
        letters = rest.get("/v1/dead-letters").await?["dead_letters"].as_array().cloned().unwrap_or_default();
        if letters.first().is_some_and(|l| l["later_in_key"] == "2") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!((&letters[0]["ordering_key"], &letters[0]["later_in_key"]), (&json!("a"), &json!("2")), "{letters:?}");
    receiver.reply("/ordered", Reply::Status(200));
    let (status, replayed) =
        rest.post(&format!("/v1/dead-letters/{}/replay", letters[0]["id"].as_str().unwrap_or_default()), json!({})).await?;
    assert_eq!(status, 202, "{replayed}");
    publish_keyed(&rest, "a", json!({"n": 4})).await?;
    let got = receiver.wait_at("/ordered", 12, Duration::from_secs(30)).await;
    let tail: Vec<(u64, String)> =
        got[10..].iter().map(|r| (r.json()["payload"]["n"].as_u64().unwrap_or(0), r.header("relay-webhook-sequence"))).collect();
    assert_eq!(tail, vec![(1, "4".to_owned()), (4, "5".to_owned())], "the replay at the tail, then the later event");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_is_none_or_per_key_and_a_change_applies_to_later_deliveries() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("ordered-rules").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for bad in [json!("PER_KEY"), json!("fifo\n"), json!(""), json!(7), json!(["per_key"])] {
        let (status, body) =
            rest.post("/v1/webhooks", json!({"url": receiver.url("/x"), "event_types": ["o"], "ordering": bad.clone()})).await?;
        let empty = bad == json!("");
        if empty {
            assert_eq!((status, &body["endpoint"]["ordering"]), (201, &json!("none")), "empty is none: {body}");
            continue;
        }
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["message"].as_str().unwrap_or_default().contains("ordering"), "{bad}: the field named: {body}");
    }
    let (_, created) = rest.post("/v1/webhooks", json!({"url": receiver.url("/y"), "event_types": ["o"]})).await?;
    let id = created["endpoint"]["id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(created["endpoint"]["ordering"], "none");
    let (status, body) = rest.call(reqwest::Method::PATCH, &format!("/v1/webhooks/{id}"), Some(json!({"ordering": "sorted"}))).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_ordering")), "{body}");

    // A delivery is created when its event is expanded; those created before
    // the change keep theirs: unordered, pending. No dispatcher: the api
    // expands nothing, so the test asks for expansions as a dispatcher would.
    let mut seam = stack.seam().await?;
    let expand = |event: &str| relay_contracts::relay::dispatch::v1::ExpandRequest {
        event_id: event.to_owned(),
        environment_id: tenant.environment_id.clone(),
        r#type: "o".into(),
        ..Default::default()
    };
    let (before, _) = publish_keyed(&rest, "k", json!(1)).await?;
    seam.expand(expand(&before)).await?;
    let (status, body) = rest.call(reqwest::Method::PATCH, &format!("/v1/webhooks/{id}"), Some(json!({"ordering": "per_key"}))).await?;
    assert_eq!((status, &body["endpoint"]["ordering"]), (200, &json!("per_key")), "{body}");
    let (after, _) = publish_keyed(&rest, "k", json!(2)).await?;
    let unkeyed = rest.publish("o", json!(3)).await?;
    for event in [&after, &unkeyed] {
        seam.expand(expand(event)).await?;
    }
    // The deliveries at this endpoint (the first one, unordered, gets them too).
    let at_y = |rows: Vec<Value>| rows.into_iter().filter(|d| d["endpoint_id"] == json!(id)).collect::<Vec<_>>();
    let state = |d: &Vec<Value>| d.first().map(|d| d["state"].as_str().unwrap_or_default().to_owned()).unwrap_or_default();
    let before_rows = at_y(rest.deliveries(&before).await?);
    assert_eq!(state(&before_rows), "DELIVERY_STATE_PENDING", "created before the change");
    assert_eq!(before_rows[0]["ordering_key"], "", "created before the change: in no lane");
    assert_eq!(state(&at_y(rest.deliveries(&unkeyed).await?)), "DELIVERY_STATE_PENDING", "no key: unordered");
    let after_rows = at_y(rest.deliveries(&after).await?);
    assert_eq!(state(&after_rows), "DELIVERY_STATE_PENDING", "the lane's first row is its head");
    assert_eq!((&after_rows[0]["ordering_key"], &after_rows[0]["ordering_position"]), (&json!("k"), &json!("1")), "{after_rows:?}");
    stack.stop().await
}

/// A lane's next deliveries go out on its head's 2xx without waiting for
/// that outcome to be recorded (the head's followers), through two
/// dispatchers, from receivers that fail sometimes: at random, each
/// webhook's first request, and in bursts of 429s. Whatever breaks a run,
/// each key's events arrive in publish order, each delivered once, and the
/// runs did carry deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_run_goes_on_its_predecessors_2xx_and_keeps_order_through_every_kind_of_failure() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { endpoint_cap: 64, ..Options::default() }).await?;
    stack.start_dispatcher().await?;
    let tenant = stack.tenant("ordered-runs").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let behaviours = [
        ("random", Behaviour::FailRandomly(15)),
        ("first", Behaviour::FailFirst(503)),
        ("bursts", Behaviour::ThrottleInBursts { every: Duration::from_millis(100), burst: Duration::from_millis(50) }),
    ];
    let mut flakies = Vec::new();
    for (name, behaviour) in behaviours {
        let flaky = Flaky::new(behaviour);
        receiver.reply(&format!("/{name}"), Reply::Flaky(flaky.clone()));
        let mut body = json!({"url": receiver.url(&format!("/{name}")), "event_types": [name], "ordering": "per_key"});
        if name == "random" {
            body["max_in_flight"] = json!(4);
        }
        let (status, created) = rest.post("/v1/webhooks", body).await?;
        anyhow::ensure!(status == 201, "{created}");
        flakies.push((name, flaky));
    }
    // Published before anything is sent, so lanes have queues to run.
    const EACH: u64 = 40;
    fn keys(name: &'static str) -> Vec<&'static str> {
        if name == "random" { vec!["r0", "r1", "r2"] } else { vec![name] }
    }
    let mut publishes = Vec::new();
    for (name, _) in &flakies {
        for n in 0..EACH {
            for key in keys(name) {
                publishes.push(rest.post("/v1/events", json!({"type": name, "payload": {"key": key, "n": n}, "ordering_key": key})));
            }
        }
    }
    for publish in publishes {
        let (status, reply) = publish.await?;
        anyhow::ensure!(status == 202, "{reply}");
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    for (name, flaky) in &flakies {
        let want = EACH as usize * keys(name).len();
        while flaky.log().iter().filter(|a| a.answer.status == 200).count() < want && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let answers: HashMap<(String, u32), u16> = flaky.log().into_iter().map(|a| ((a.id, a.nth), a.answer.status)).collect();
        let mut nth: HashMap<String, u32> = HashMap::new();
        let mut by_key: BTreeMap<String, Vec<(u64, u64, bool)>> = BTreeMap::new();
        for request in receiver.at(&format!("/{name}")) {
            let id = request.header("relay-webhook-id");
            let n = nth.entry(id.clone()).or_default();
            *n += 1;
            let ok = answers.get(&(id, *n)) == Some(&200);
            let body = request.json();
            let sequence: u64 = request.header("relay-webhook-sequence").parse()?;
            let key = body["payload"]["key"].as_str().unwrap_or_default().to_owned();
            by_key.entry(key).or_default().push((body["payload"]["n"].as_u64().unwrap_or(u64::MAX), sequence, ok));
        }
        assert_eq!(by_key.len(), keys(name).len(), "{name}: every key arrived");
        for (key, arrivals) in &by_key {
            // A key's first arrivals in publish order; anything else is a
            // copy of an event that had arrived before.
            let mut first_seen = Vec::new();
            for &(n, sequence, _) in arrivals {
                assert_eq!(sequence, n + 1, "{name}/{key}: event {n} numbered {sequence}");
                if !first_seen.contains(&n) {
                    first_seen.push(n);
                }
            }
            assert_eq!(first_seen, (0..EACH).collect::<Vec<_>>(), "{name}/{key}: first arrivals out of publish order");
            let delivered: Vec<u64> = arrivals.iter().filter(|a| a.2).map(|a| a.0).collect();
            let mut once = delivered.clone();
            once.dedup();
            assert_eq!(once, (0..EACH).collect::<Vec<_>>(), "{name}/{key}: each event delivered, in order: {delivered:?}");
        }
        let refused = flaky.log().iter().filter(|a| a.answer.status != 200).count();
        assert!(refused >= 3, "{name}: the receiver refused {refused} requests");
    }
    // The runs carried deliveries: recorded as followers, sent before their
    // predecessors' outcomes were.
    let followers = metric(&stack, "relay_lane_follower_attempts_total").await?;
    assert!(followers >= 50.0, "{followers} follower attempts recorded");
    stack.stop().await
}

/// A busy ordered endpoint: a key's next event finds its lane idle (its
/// last delivery ended) while the endpoint has as many attempts in flight
/// as its cap allows, so the new head waits for a slot, which an outcome
/// in flight frees and fills (no relay pass is woken for it). Every key's
/// events arrive once each, in order, numbered as published: none waits
/// behind a slot that no outcome fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_ordered_endpoints_idle_lanes_wait_for_slots_and_every_key_arrives_in_order() -> anyhow::Result<()> {
    const KEYS: usize = 64;
    const EACH: usize = 6;
    const PUBLISHERS: usize = 8;
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("busy-lanes").await?;
    let receiver = Receiver::start().await?;
    // Slow enough that the endpoint's four slots stay taken while events
    // keep coming; a key's next event comes KEYS events after its last.
    receiver.reply("/busy", Reply::Flaky(Flaky::new(Behaviour::Slow(Duration::from_millis(10)))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    ordered_endpoint(&rest, &receiver, "/busy", json!({})).await?;
    let relayed_before = metric(&stack, "relay_relayed_attempts_total").await?;
    // Each publisher its own keys, round robin over them, without pause.
    futures::future::try_join_all((0..PUBLISHERS).map(|p| {
        let rest = &rest;
        async move {
            for n in 0..EACH {
                for k in (p..KEYS).step_by(PUBLISHERS) {
                    let key = format!("k{k}");
                    let (_, sequence) = publish_keyed(rest, &key, json!({"key": key, "n": n})).await?;
                    anyhow::ensure!(sequence == n as u64 + 1, "{key}'s event {n} numbered {sequence}");
                }
            }
            anyhow::Ok(())
        }
    }))
    .await?;
    let arrived = receiver.wait_at("/busy", KEYS * EACH, Duration::from_secs(60)).await.len();
    assert_eq!(arrived, KEYS * EACH, "every event arrived");
    let mut by_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for request in receiver.at("/busy") {
        let body = request.json();
        let sequence: u64 = request.header("relay-webhook-sequence").parse()?;
        assert_eq!(Some(sequence), body["payload"]["n"].as_u64().map(|n| n + 1), "numbered as published: {body}");
        by_key.entry(body["payload"]["key"].as_str().unwrap_or_default().to_owned()).or_default().push(sequence);
    }
    assert_eq!(by_key.len(), KEYS);
    for (key, sequences) in &by_key {
        assert_eq!(sequences, &(1..=EACH as u64).collect::<Vec<_>>(), "{key}: each event once, in order");
    }
    // Counted for operators; how many went the relay's way depends on
    // timing (a lease that ran out, a refill that found the rows taken).
    let relayed = metric(&stack, "relay_relayed_attempts_total").await? - relayed_before;
    println!("{relayed} of {} deliveries went through the relay", KEYS * EACH);
    stack.stop().await
}

/// A key whose lane went idle (its last delivery ended, nothing queued)
/// gets its next event's delivery as the lane's head in the expansion's
/// own write, numbered after the last: no queued row and no promotion of
/// its own. Seen in the lane's row: while that head is on the wire, its
/// last writer is the transaction that expanded the event (a promotion
/// would have numbered it in a transaction of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_lane_went_idle_gets_its_next_event_as_its_head_at_once_numbered_after_its_last() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let pg = stack.pg().await?;
    let tenant = stack.tenant("idle-lanes").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/idle", Reply::Flaky(Flaky::new(Behaviour::Slow(Duration::from_millis(1500)))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let endpoint = ordered_endpoint(&rest, &receiver, "/idle", json!({})).await?;
    let lane = |key: &'static str| {
        let (pg, endpoint) = (pg.clone(), endpoint.clone());
        async move {
            let row: Option<(bool, i64, String)> = sqlx::query_as(
                "SELECT idle, last_position, xmin::text FROM ordering_lanes WHERE endpoint_id = $1::uuid AND ordering_key = $2",
            )
            .bind(&endpoint)
            .bind(key)
            .fetch_optional(&pg)
            .await?;
            anyhow::Ok(row)
        }
    };
    let expanded_by = |event: String| {
        let pg = pg.clone();
        async move {
            let xid: String =
                sqlx::query_scalar("SELECT xmin::text FROM consumed_events WHERE consumer = 'expand' AND event_id = $1::uuid")
                    .bind(&event)
                    .fetch_one(&pg)
                    .await?;
            anyhow::Ok(xid)
        }
    };
    for n in 1..=3u64 {
        let (event, sequence) = publish_keyed(&rest, "k", json!({"n": n})).await?;
        assert_eq!(sequence, n);
        // On the wire (the receiver holds it 1.5 s): numbered n, by whom.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let (idle, position, writer) = loop {
            if let Some(row) = lane("k").await?.filter(|r| r.1 == n as i64) {
                break row;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "event {n} was not numbered in 10 s: {:?}", lane("k").await?);
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(!idle, "event {n}: the lane has a head, and is not idle");
        assert_eq!(position, n as i64);
        if n > 1 {
            assert_eq!(writer, expanded_by(event).await?, "event {n}: its lane was taken by its expansion, not a promotion");
        }
        let got = receiver.wait_at("/idle", n as usize, Duration::from_secs(10)).await;
        assert_eq!(got.len(), n as usize, "event {n} arrived");
        assert_eq!(got[n as usize - 1].header("relay-webhook-sequence"), n.to_string());
        // Its outcome recorded, the lane's promotion finds nothing queued.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !lane("k").await?.is_some_and(|r| r.0) {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "the lane did not go idle after event {n}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    stack.stop().await
}

/// A counter's value on the api's metrics port.
async fn metric(stack: &Stack, name: &str) -> anyhow::Result<f64> {
    stack.metric(name).await?.ok_or_else(|| anyhow::anyhow!("no {name} on the metrics port"))
}
