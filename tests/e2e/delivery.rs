//! The delivery guarantees: schedule, idempotent outcomes, dead letters and
//! replay, retention, rotation, disabled and deleted endpoints, isolation.

use std::time::Duration;

use relay_contracts::relay::dispatch::v1::{ExpandRequest, MaterialRequest, OutcomeDecision, OutcomeRequest};
use relay_tests::{Options, Receiver, Reply, Rest, Stack, contract_signature as sign, eventually};
use serde_json::json;

/// The signature entries of a request, in order.
fn entries(r: &relay_tests::Received) -> Vec<String> {
    r.header("relay-webhook-signature").split(',').map(|s| s.trim().to_owned()).collect()
}

pub(crate) async fn delivery_state(rest: &Rest, event_id: &str, want: &str, within: Duration) -> serde_json::Value {
    eventually(within, || async {
        let d = rest.deliveries(event_id).await.ok()?;
        d.first().filter(|d| d["state"] == want).cloned()
    })
    .await
    .unwrap_or_else(|| panic!("delivery of {event_id} never reached {want}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seven_attempts_on_the_tiers_then_a_dead_letter_then_replay_delivers_the_same_event() -> anyhow::Result<()> {
    // Test tiers: 0, 150, 200, 250, 300, 350, 400 ms.
    let stack = Stack::start(Options::default().tiers("0,150,200,250,300,350,400")).await?;
    let tenant = stack.tenant("schedule").await?;
    let receiver = Receiver::start_https().await?;
    receiver.reply("/fail", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, secret) = rest.endpoint(&receiver.url("/fail"), &["order.created"]).await?;
    let event_id = rest.publish("order.created", json!({"n": 1})).await?;

    let got = receiver.wait_at("/fail", 7, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 7, "seven requests");
    let tiers = [150u64, 200, 250, 300, 350, 400];
    for (i, pair) in got.windows(2).enumerate() {
        let gap = pair[1].at - pair[0].at;
        assert!(
            gap >= Duration::from_millis(tiers[i]),
            "attempt {} came {gap:?} after the previous, before its {} ms tier",
            i + 2,
            tiers[i]
        );
        assert_eq!(pair[1].body, pair[0].body, "the body is byte-identical on every attempt");
        assert_eq!(pair[1].header("relay-webhook-id"), event_id);
    }
    let dead = delivery_state(&rest, &event_id, "DELIVERY_STATE_DEAD", Duration::from_secs(5)).await;
    assert_eq!(dead["attempt"], 7);
    let attempts = dead["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 7, "the attempt log has every attempt: {dead}");
    for (i, a) in attempts.iter().enumerate() {
        assert_eq!(a["attempt"], i as u64 + 1);
        assert_eq!(a["http_status"], 500);
        assert_eq!(a["response_body"], "answer", "the response body is kept");
        assert!(a["latency_ms"].as_u64().is_some());
    }
    assert!(attempts[6]["next_attempt_at"].is_null(), "the last attempt schedules nothing");
    // A full retry cycle after the dead letter (a witness refused once, then
    // retried): an eighth request, had one been scheduled, came first.
    receiver.reply("/witness", Reply::Flaky(relay_tests::flaky::Flaky::new(relay_tests::flaky::Behaviour::FailFirst(503))));
    rest.endpoint(&receiver.url("/witness"), &["witness"]).await?;
    rest.publish("witness", json!({})).await?;
    assert_eq!(receiver.wait_at("/witness", 2, Duration::from_secs(20)).await.len(), 2, "the witness is retried");
    assert_eq!(receiver.at("/fail").len(), 7, "no eighth request");

    let list = rest.get("/v1/dead-letters").await?;
    let letters = list["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 1, "{list}");
    let letter = &letters[0];
    assert_eq!(letter["event_id"], event_id.as_str());
    assert_eq!(letter["endpoint_id"], endpoint_id.as_str());
    assert_eq!((letter["attempts"].as_u64(), letter["last_status"].as_u64()), (Some(7), Some(500)));
    assert_eq!(letter["reason"], "attempts_exhausted");

    // The customer fixes their side; the tenant replays.
    receiver.reply("/fail", Reply::Status(200));
    let (status, replayed) = rest.post(&format!("/v1/dead-letters/{}/replay", letter["id"].as_str().unwrap()), json!({})).await?;
    assert_eq!(status, 202, "{replayed}");
    let got = receiver.wait_at("/fail", 8, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 8);
    let again = &got[7];
    assert_eq!(again.header("relay-webhook-id"), event_id, "a replay keeps the event id");
    assert_eq!(again.body, got[0].body);
    assert!(entries(again).contains(&sign(&secret, &again.header("relay-webhook-timestamp"), &again.body)));
    let delivered = delivery_state(&rest, &event_id, "DELIVERY_STATE_DELIVERED", Duration::from_secs(5)).await;
    assert_eq!((delivered["attempt"].as_u64(), delivered["generation"].as_u64()), (Some(1), Some(1)));
    assert_eq!(delivered["attempts"].as_array().unwrap().len(), 8, "both runs stay in the log");
    assert_eq!(rest.get("/v1/dead-letters").await?["dead_letters"].as_array().unwrap().len(), 1, "the dead-letter record is kept");
    let (status, body) = rest.post(&format!("/v1/dead-letters/{}/replay", letter["id"].as_str().unwrap()), json!({})).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("already_replayed")), "{body}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_are_idempotent_and_a_late_dispatcher_drains_the_backlog() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { dispatcher: false, ..Options::default().tiers("0,100,100,100,100,100,100") }).await?;
    let tenant = stack.tenant("late").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/late"), &["a"]).await?;

    // With no dispatcher at all, the api serves tenants and accepts events.
    let event_id = rest.publish("a", json!({"backlog": true})).await?;
    assert_eq!(rest.get("/v1/webhooks").await?["endpoints"].as_array().unwrap().len(), 1);

    // Expand exactly once, however often it is asked.
    let mut seam = stack.seam().await?;
    let expand = ExpandRequest {
        event_id: event_id.clone(),
        environment_id: tenant.environment_id.clone(),
        r#type: "a".into(),
        ..Default::default()
    };
    let first = seam.expand(expand.clone()).await?.into_inner();
    let second = seam.expand(expand).await?.into_inner();
    assert_eq!((first.created, first.duplicate), (1, false));
    assert_eq!((second.created, second.duplicate), (0, true));
    let delivery = rest.deliveries(&event_id).await?;
    assert_eq!(delivery.len(), 1);
    let delivery_id = delivery[0]["id"].as_str().unwrap().to_owned();

    // A repeated outcome returns the first decision and advances nothing.
    let report =
        OutcomeRequest { delivery_id: delivery_id.clone(), attempt: 1, http_status: Some(503), latency_ms: 7, ..Default::default() };
    let a = seam.outcome(report.clone()).await?.into_inner();
    let b = seam.outcome(report.clone()).await?.into_inner();
    assert_eq!(a.decision, OutcomeDecision::Rescheduled as i32);
    assert_eq!(a, b, "the repeat answers with the first decision");
    let after = rest.deliveries(&event_id).await?;
    assert_eq!(after[0]["attempt"], 2, "the schedule advanced once");
    assert_eq!(after[0]["attempts"].as_array().unwrap().len(), 1, "one attempt recorded");
    let stale = seam
        .material(MaterialRequest { delivery_id: delivery_id.clone(), attempt: 1, generation: 0, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition, "a finished attempt has no material");
    assert!(receiver.received().is_empty(), "nothing is sent without a dispatcher");

    // A dispatcher started now drains it: attempt 2 is sent, once; the
    // EVENTS message it finds is a duplicate expansion and sends nothing.
    stack.start_dispatcher().await?;
    assert_eq!(receiver.wait_for(1, Duration::from_secs(20)).await.len(), 1);
    let done = delivery_state(&rest, &event_id, "DELIVERY_STATE_DELIVERED", Duration::from_secs(5)).await;
    assert_eq!(done["attempt"], 2);
    // The next event comes after the backlog's EVENTS message in the stream:
    // once it has arrived, that message was taken, and sent nothing more.
    let next = rest.publish("a", json!({"after": true})).await?;
    let got = receiver.wait_for(2, Duration::from_secs(20)).await;
    let ids: Vec<String> = got.iter().map(|r| r.header("relay-webhook-id")).collect();
    assert_eq!(ids, vec![event_id.clone(), next], "exactly one request for the backlog, then the next event");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_expand_material_and_outcomes_answer_item_by_item_with_the_same_idempotency() -> anyhow::Result<()> {
    use relay_contracts::relay::dispatch::v1::{
        ExpandBatchRequest, MaterialBatchRequest, OutcomeBatchRequest, expand_result::Result as X, material_result::Result as M,
        outcome_result::Result as O,
    };
    let stack = Stack::start(Options { dispatcher: false, ..Options::default().tiers("0,100,100") }).await?;
    let tenant = stack.tenant("batches").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/b"), &["b"]).await?;
    let mut seam = stack.seam().await?;
    let mut events = Vec::new();
    for i in 0..3 {
        events.push(rest.publish("b", json!({"i": i})).await?);
    }
    // Expansion: three events, one of them twice, an unknown one and one
    // named with the wrong type, in one batch; then the same batch again.
    let item = |event_id: &str, t: &str| ExpandRequest {
        event_id: event_id.to_owned(),
        environment_id: tenant.environment_id.clone(),
        r#type: t.into(),
        ..Default::default()
    };
    let batch = ExpandBatchRequest {
        items: vec![
            item(&events[0], "b"),
            item(&events[1], "b"),
            item(&events[2], "b"),
            item(&events[0], "b"),
            item(&uuid::Uuid::now_v7().to_string(), "b"),
            item(&events[1], "other"),
        ],
        ..Default::default()
    };
    let expanded = |r: &Option<X>| match r {
        Some(X::Expanded(x)) => (x.created, x.duplicate),
        other => panic!("expected an expansion, got {other:?}"),
    };
    let first = seam.expand_batch(batch.clone()).await?.into_inner().items;
    assert_eq!(first[..4].iter().map(|r| expanded(&r.result)).collect::<Vec<_>>(), [(1, false), (1, false), (1, false), (0, true)]);
    assert!(matches!(&first[4].result, Some(X::Error(e)) if e.code == tonic::Code::NotFound as i32), "{:?}", first[4]);
    assert!(matches!(&first[5].result, Some(X::Error(e)) if e.code == tonic::Code::InvalidArgument as i32 && e.reason == "event_mismatch"));
    let again = seam.expand_batch(batch).await?.into_inner().items;
    assert_eq!(again[..4].iter().map(|r| expanded(&r.result)).collect::<Vec<_>>(), [(0, true); 4], "expanded exactly once");
    let mut ids = Vec::new();
    for event_id in &events {
        let d = rest.deliveries(event_id).await?;
        assert_eq!(d.len(), 1, "one delivery per event, however often it was expanded");
        ids.push(d[0]["id"].as_str().unwrap().to_owned());
    }
    let (d0, d1, d2) = (ids[0].clone(), ids[1].clone(), ids[2].clone());

    // Material: a current attempt, a wrong attempt, an unknown delivery, in order.
    let unknown = uuid::Uuid::now_v7().to_string();
    let m = seam
        .material_batch(MaterialBatchRequest {
            items: vec![
                MaterialRequest { delivery_id: d0.clone(), attempt: 1, generation: 0, ..Default::default() },
                MaterialRequest { delivery_id: d1.clone(), attempt: 2, generation: 0, ..Default::default() },
                MaterialRequest { delivery_id: unknown.clone(), attempt: 1, generation: 0, ..Default::default() },
            ],
        })
        .await?
        .into_inner()
        .items;
    assert_eq!(m.len(), 3);
    assert!(matches!(&m[0].result, Some(M::Material(x)) if x.delivery_id == d0 && x.secrets.len() == 1 && !x.payload.is_empty()));
    assert!(
        matches!(&m[1].result, Some(M::Error(e)) if e.code == tonic::Code::FailedPrecondition as i32 && e.reason == "stale_attempt"),
        "{:?}",
        m[1]
    );
    assert!(matches!(&m[2].result, Some(M::Error(e)) if e.code == tonic::Code::NotFound as i32), "{:?}", m[2]);

    // Outcomes: a success, a failure reported twice in the same batch, a
    // report for an attempt that is not current, and an unknown delivery.
    let report = |id: &str, attempt: u32, status: u32| OutcomeRequest {
        delivery_id: id.to_owned(),
        attempt,
        http_status: Some(status),
        latency_ms: 3,
        ..Default::default()
    };
    let batch = OutcomeBatchRequest {
        items: vec![report(&d0, 1, 200), report(&d1, 1, 503), report(&d1, 1, 503), report(&d2, 3, 500), report(&unknown, 1, 200)],
        ..Default::default()
    };
    let first = seam.outcome_batch(batch.clone()).await?.into_inner().items;
    let decision = |r: &Option<O>| match r {
        Some(O::Outcome(o)) => o.decision,
        other => panic!("expected a decision, got {other:?}"),
    };
    assert_eq!(decision(&first[0].result), OutcomeDecision::Delivered as i32);
    assert_eq!(decision(&first[1].result), OutcomeDecision::Rescheduled as i32);
    assert_eq!(first[1], first[2], "a report repeated inside the batch gets the first decision");
    assert_eq!(decision(&first[3].result), OutcomeDecision::Rescheduled as i32, "a stale report answers where the delivery stands");
    assert!(matches!(&first[4].result, Some(O::Error(e)) if e.code == tonic::Code::NotFound as i32));

    // The whole batch again changes nothing and answers the same.
    let again = seam.outcome_batch(batch).await?.into_inner().items;
    assert_eq!(&first[..3], &again[..3], "a repeated batch returns the first decisions");
    assert_eq!(decision(&again[3].result), OutcomeDecision::Rescheduled as i32);
    let pg = stack.pg().await?;
    let rows: Vec<(String, i32, i64)> = sqlx::query_as(
        "SELECT d.state, d.attempt, (SELECT count(*) FROM delivery_attempts a WHERE a.delivery_id = d.id)
         FROM webhook_deliveries d WHERE d.id = ANY ($1) ORDER BY array_position($1, d.id)",
    )
    .bind(ids.iter().map(|i| uuid::Uuid::parse_str(i).unwrap()).collect::<Vec<_>>())
    .fetch_all(&pg)
    .await?;
    assert_eq!(
        rows,
        vec![("delivered".into(), 1, 1), ("pending".into(), 2, 1), ("pending".into(), 1, 0)],
        "each delivery advanced at most once; the stale report recorded nothing"
    );

    // Oversized batches are refused with the limit and the count.
    let items = vec![MaterialRequest { delivery_id: d0.clone(), attempt: 1, generation: 0, ..Default::default() }; 1001];
    let refused = seam.material_batch(MaterialBatchRequest { items }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("at most 1000") && refused.message().contains("1001"), "{}", refused.message());
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_kept_seven_days_and_pruned_after() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0")).await?;
    let tenant = stack.tenant("retention").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/down", Reply::Status(502));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&receiver.url("/down"), &["x"]).await?;
    let old = rest.publish("x", json!(1)).await?;
    let recent = rest.publish("x", json!(2)).await?;
    let letters = eventually(Duration::from_secs(20), || async {
        let l = rest.get("/v1/dead-letters").await.ok()?;
        (l["dead_letters"].as_array()?.len() == 2).then_some(l)
    })
    .await
    .expect("both events dead-lettered after their single attempt");
    assert_eq!(letters["dead_letters"].as_array().unwrap().len(), 2);

    let pg = stack.pg().await?;
    let age = |event: &str, days: i32| {
        sqlx::query("UPDATE webhook_dead_letters SET dead_lettered_at = now() - make_interval(days => $2) WHERE event_id = $1::uuid")
            .bind(event.to_owned())
            .bind(days)
    };
    // Newest first.
    age(&old, 5).execute(&pg).await?;
    age(&recent, 4).execute(&pg).await?;
    let listed: Vec<String> = rest.get("/v1/dead-letters").await?["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, vec![recent.clone(), old.clone()], "dead letters are listed newest first");

    sqlx::query("UPDATE webhook_dead_letters SET dead_lettered_at = now() - interval '8 days' WHERE event_id = $1::uuid")
        .bind(&old)
        .execute(&pg)
        .await?;
    sqlx::query("UPDATE webhook_dead_letters SET dead_lettered_at = now() - interval '6 days' WHERE event_id = $1::uuid")
        .bind(&recent)
        .execute(&pg)
        .await?;
    let left = eventually(Duration::from_secs(5), || async {
        let l = rest.get("/v1/dead-letters").await.ok()?;
        let ids: Vec<String> = l["dead_letters"].as_array()?.iter().map(|d| d["event_id"].as_str().unwrap().to_owned()).collect();
        (ids.len() == 1).then_some(ids)
    })
    .await
    .expect("the day-8 dead letter is pruned by the api's timer");
    assert_eq!(left, vec![recent.clone()], "day 6 is kept, day 8 is gone");
    // And it stays so across further prune passes: a witness aged past the
    // window afterwards is pruned by a later pass, which keeps day 6.
    let witness = rest.publish("x", json!(3)).await?;
    let dead_witness = eventually(Duration::from_secs(20), || async {
        let l = rest.get("/v1/dead-letters").await.ok()?;
        (l["dead_letters"].as_array()?.len() == 2).then_some(())
    })
    .await;
    assert!(dead_witness.is_some(), "the witness is dead-lettered");
    age(&witness, 9).execute(&pg).await?;
    let after = eventually(Duration::from_secs(5), || async {
        let l = rest.get("/v1/dead-letters").await.ok()?;
        let ids: Vec<String> = l["dead_letters"].as_array()?.iter().map(|d| d["event_id"].as_str().unwrap().to_owned()).collect();
        (!ids.contains(&witness)).then_some(ids)
    })
    .await
    .expect("a later pass prunes the witness");
    assert_eq!(after, vec![recent.clone()], "day 6 is still kept");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_signs_beside_the_new_one_for_24_hours_then_stops() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("rotation").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (id, old_secret) = rest.endpoint(&receiver.url("/r"), &["r"]).await?;

    rest.publish("r", json!("before")).await?;
    let before = receiver.wait_for(1, Duration::from_secs(20)).await;
    let r = &before[0];
    assert_eq!(entries(r), vec![sign(&old_secret, &r.header("relay-webhook-timestamp"), &r.body)]);

    let (status, rotated) = rest.post(&format!("/v1/webhooks/{id}/rotate-secret"), json!({})).await?;
    assert_eq!(status, 200, "{rotated}");
    let new_secret = rotated["secret"].as_str().unwrap().to_owned();
    assert_ne!(new_secret, old_secret);
    assert!(rotated["endpoint"]["secret_rotated_at"].is_string());
    for body in [rest.get(&format!("/v1/webhooks/{id}")).await?, rest.get("/v1/webhooks").await?] {
        let text = body.to_string();
        assert!(!text.contains(&new_secret) && !text.contains(&old_secret), "a read showed a secret: {text}");
    }

    rest.publish("r", json!("during")).await?;
    let during = receiver.wait_for(2, Duration::from_secs(20)).await;
    let r = &during[1];
    let ts = r.header("relay-webhook-timestamp");
    assert_eq!(entries(r), vec![sign(&new_secret, &ts, &r.body), sign(&old_secret, &ts, &r.body)], "both sign, the current one first");

    // 24 hours later (moved back in the database): only the current secret signs.
    let pg = stack.pg().await?;
    sqlx::query("UPDATE webhook_endpoints SET secret_rotated_at = now() - interval '24 hours 1 second' WHERE id = $1::uuid")
        .bind(&id)
        .execute(&pg)
        .await?;
    rest.publish("r", json!("after")).await?;
    let after = receiver.wait_for(3, Duration::from_secs(20)).await;
    let r = &after[2];
    let ts = r.header("relay-webhook-timestamp");
    assert_eq!(entries(r), vec![sign(&new_secret, &ts, &r.body)], "the old secret no longer signs");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_and_deleted_endpoints_get_nothing_more_and_their_deliveries_end_visibly() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,400,400,400,400,400,400")).await?;
    let tenant = stack.tenant("switch-off").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/paused", Reply::Status(500));
    receiver.reply("/gone", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (paused, _) = rest.endpoint(&receiver.url("/paused"), &["p"]).await?;
    let (gone, _) = rest.endpoint(&receiver.url("/gone"), &["p"]).await?;
    // Refused every time: its retries of the same event fall due beside the
    // ones the switched-off endpoints would have had.
    receiver.reply("/retried", Reply::Status(500));
    let (retried, _) = rest.endpoint(&receiver.url("/retried"), &["p"]).await?;
    let event_id = rest.publish("p", json!({})).await?;
    receiver.wait_at("/paused", 1, Duration::from_secs(20)).await;
    receiver.wait_at("/gone", 1, Duration::from_secs(20)).await;

    let (status, body) = rest.post(&format!("/v1/webhooks/{paused}/disable"), json!({})).await?;
    assert_eq!((status, body["enabled"].as_bool()), (200, Some(false)), "{body}");
    let (status, _) = rest.call(reqwest::Method::DELETE, &format!("/v1/webhooks/{gone}"), None).await?;
    assert_eq!(status, 204);
    let (paused_before, gone_before) = (receiver.at("/paused").len(), receiver.at("/gone").len());
    let retried_before = receiver.at("/retried").len();
    let two_more = receiver.wait_at("/retried", retried_before + 2, Duration::from_secs(20)).await.len();
    assert_eq!(two_more, retried_before + 2, "the live endpoint's next two retries came");
    assert_eq!(rest.call(reqwest::Method::DELETE, &format!("/v1/webhooks/{retried}"), None).await?.0, 204);
    assert_eq!(receiver.at("/paused").len(), paused_before, "a disabled endpoint gets no scheduled retry");
    assert_eq!(receiver.at("/gone").len(), gone_before, "a deleted endpoint gets no scheduled retry");

    let deliveries = rest.deliveries(&event_id).await?;
    assert!(deliveries.len() == 3 && deliveries.iter().all(|d| d["state"] == "DELIVERY_STATE_DEAD"), "{deliveries:?}");
    let letters = rest.get("/v1/dead-letters").await?;
    let reason_of = |endpoint: &str| {
        letters["dead_letters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["endpoint_id"] == endpoint)
            .map(|l| l["reason"].as_str().unwrap().to_owned())
    };
    assert_eq!(reason_of(&paused).as_deref(), Some("endpoint_disabled"));
    assert_eq!(reason_of(&gone).as_deref(), Some("endpoint_deleted"), "a deleted endpoint's dead letters are kept");
    let (status, _) = rest.call(reqwest::Method::GET, &format!("/v1/webhooks/{gone}"), None).await?;
    assert_eq!(status, 404, "a deleted endpoint is gone from reads");

    // New events skip the disabled endpoint entirely: once a live endpoint
    // registered now has the next event, its expansion has committed, and
    // it made no delivery for the disabled one.
    let (witness, _) = rest.endpoint(&receiver.url("/witness"), &["p"]).await?;
    let later = rest.publish("p", json!({"later": true})).await?;
    assert_eq!(receiver.wait_at("/witness", 1, Duration::from_secs(20)).await.len(), 1, "the live endpoint gets the event");
    let expanded = rest.deliveries(&later).await?;
    assert_eq!(expanded.len(), 1, "one delivery, to the live endpoint only: {expanded:?}");
    assert_eq!(expanded[0]["endpoint_id"], witness.as_str(), "{expanded:?}");

    // Replay waits for the endpoint to be enabled, then delivers.
    let letter = letters["dead_letters"].as_array().unwrap().iter().find(|l| l["endpoint_id"] == paused.as_str()).unwrap().clone();
    let replay = format!("/v1/dead-letters/{}/replay", letter["id"].as_str().unwrap());
    let (status, body) = rest.post(&replay, json!({})).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("endpoint_inactive")), "{body}");
    receiver.reply("/paused", Reply::Status(204));
    assert_eq!(rest.post(&format!("/v1/webhooks/{paused}/enable"), json!({})).await?.0, 200);
    assert_eq!(rest.post(&replay, json!({})).await?.0, 202);
    assert_eq!(receiver.wait_at("/paused", paused_before + 1, Duration::from_secs(20)).await.len(), paused_before + 1);
    stack.stop().await
}
