//! Trust at the edges of the delivery pipeline: an api out of connections,
//! endpoints switched off mid-expansion or mid-attempt, one tenant's large
//! events beside another's small ones, out-of-range platform input, claims on
//! attempts and redelivered jobs, the broker away, bodies held open, and the
//! outbox marked without a look.

use std::time::Duration;

use relay_tests::{Options, Receiver, Rest, Stack};
use serde_json::json;
use uuid::Uuid;

/// Issue 9.4: overload is a 503 with `Retry-After` and the JSON error, never
/// a pool timeout surfacing as a generic failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_out_of_database_connections_answers_503_with_retry_after() -> anyhow::Result<()> {
    let stack =
        Stack::start(Options { dispatcher: false, db_pool_size: 2, db_acquire_timeout: Duration::from_secs(1), ..Options::default() })
            .await?;
    let tenant = stack.tenant("overload").await?;
    let pg = stack.pg().await?;
    // Every insert into events now waits, holding its connection.
    let mut lock = pg.begin().await?;
    sqlx::query("LOCK TABLE events IN EXCLUSIVE MODE").execute(&mut *lock).await?;
    let calls: Vec<_> = (0..12)
        .map(|i| {
            let (url, key) = (stack.rest_url.clone(), tenant.api_key.clone());
            tokio::spawn(async move {
                let resp = reqwest::Client::new()
                    .post(format!("{url}/v1/events"))
                    .bearer_auth(key)
                    .json(&json!({"type": "o", "payload": {"i": i}}))
                    .send()
                    .await?;
                let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap_or_default().to_owned());
                anyhow::Ok((resp.status().as_u16(), retry_after, resp.text().await?))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    lock.rollback().await?;
    let mut refused = 0;
    for c in calls {
        let (status, retry_after, body) = c.await??;
        match status {
            202 => {}
            503 => {
                refused += 1;
                assert_eq!(retry_after.as_deref(), Some("1"), "{body}");
                let v: serde_json::Value = serde_json::from_str(&body)?;
                assert_eq!(v["reason"], "unavailable", "{v}");
            }
            other => panic!("overload answered {other}: {body}"),
        }
    }
    assert!(refused > 0, "with both connections held, some calls must have been refused");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.2: an endpoint disabled or deleted 0–30 ms after an event it
/// subscribes to was published — on either side of the expansion — leaves no
/// delivery pending: each one is delivered, or a dead letter with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_delivery_strands_when_its_endpoint_is_switched_off_during_expansion() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant_with_quota("switch-off", 1000).await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let mut events = Vec::new();
    for round in 0..40u64 {
        let (endpoint, _) = rest.endpoint(&receiver.url(&format!("/s{round}")), &["s"]).await?;
        for i in 0..3 {
            events.push(rest.publish("s", json!({"round": round, "i": i})).await?);
        }
        tokio::time::sleep(Duration::from_millis((round * 7) % 31)).await;
        let (method, path) = if round % 2 == 0 {
            (reqwest::Method::POST, format!("/v1/webhooks/{endpoint}/disable"))
        } else {
            (reqwest::Method::DELETE, format!("/v1/webhooks/{endpoint}"))
        };
        let (status, body) = rest.call(method, &path, None).await?;
        assert!(status == 200 || status == 204, "{body}");
    }
    // Every delivery reaches a final state, well inside one lease.
    let pg = stack.pg().await?;
    let pending = relay_tests::eventually(Duration::from_secs(30), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'").fetch_one(&pg).await.ok()?;
        (n == 0).then_some(())
    })
    .await;
    let stuck: Vec<(Uuid, i32, bool)> =
        sqlx::query_as("SELECT d.id, d.attempt, d.dispatched_at IS NOT NULL FROM webhook_deliveries d WHERE d.state = 'pending' LIMIT 5")
            .fetch_all(&pg)
            .await?;
    assert!(pending.is_some(), "deliveries stranded pending (id, attempt, leased): {stuck:?}");
    let unexplained: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries d WHERE d.state = 'dead' AND NOT EXISTS (
           SELECT 1 FROM webhook_dead_letters l WHERE l.delivery_id = d.id AND l.reason IN ('endpoint_disabled', 'endpoint_deleted'))",
    )
    .fetch_one(&pg)
    .await?;
    assert_eq!(unexplained, 0, "every dead delivery has a dead letter saying why");
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries").fetch_one(&pg).await?;
    assert!(deliveries > 0, "some events reached their endpoint before it was switched off");
    pg.close().await;
    stack.stop().await
}

/// Issue 9.2: an attempt on the wire when its endpoint is disabled completes,
/// and a 2xx is recorded as delivered — not as a dead letter that a replay
/// would send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_answered_2xx_counts_as_delivered_even_if_the_endpoint_was_disabled_meanwhile() -> anyhow::Result<()> {
    let stack = Stack::start(Options { attempt_timeout: Duration::from_secs(5), ..Options::default() }).await?;
    let tenant = stack.tenant("in-flight").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/slow", relay_tests::Reply::Hang(Duration::from_millis(1500)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint, _) = rest.endpoint(&receiver.url("/slow"), &["i"]).await?;
    let event_id = rest.publish("i", json!({"on": "the wire"})).await?;
    assert_eq!(receiver.wait_at("/slow", 1, Duration::from_secs(20)).await.len(), 1, "the attempt is in the receiver's hands");
    let (status, body) = rest.post(&format!("/v1/webhooks/{endpoint}/disable"), json!({})).await?;
    assert_eq!(status, 200, "{body}");
    let done = relay_tests::eventually(Duration::from_secs(10), || async {
        let d = rest.deliveries(&event_id).await.ok()?.into_iter().next()?;
        (d["attempts"].as_array().is_some_and(|a| !a.is_empty())).then_some(d)
    })
    .await
    .expect("the attempt's result is recorded");
    assert_eq!(done["state"], "DELIVERY_STATE_DELIVERED", "{done}");
    assert_eq!(done["attempts"][0]["http_status"], 200, "{done}");
    let letters = rest.get("/v1/dead-letters").await?;
    assert_eq!(letters["dead_letters"].as_array().map(Vec::len), Some(0), "no dead letter to replay: {letters}");
    stack.stop().await
}

/// Issue 9.5: one tenant's burst of large events (200 × 250 KiB, more than a
/// seam message could carry at once) neither fails nor stalls, and another
/// tenant's small events keep their latency beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_large_events_do_not_stall_anothers_small_ones() -> anyhow::Result<()> {
    // The production in-flight cap: a lane then asks for 32 large payloads at once.
    let mut stack = Stack::start(Options { endpoint_cap: 64, ..Options::default() }).await?;
    let (big, small) = (stack.tenant("big").await?, stack.tenant("small").await?);
    let receiver = Receiver::start().await?;
    let big_rest = Rest::new(&stack.rest_url, Some(&big.api_key));
    let small_rest = Rest::new(&stack.rest_url, Some(&small.api_key));
    big_rest.endpoint(&receiver.url("/big"), &["b"]).await?;
    small_rest.endpoint(&receiver.url("/small"), &["s"]).await?;

    // Publish→arrival latency of small events, one every 100 ms.
    async fn small_latencies(rest: &Rest, receiver: &Receiver, n: usize) -> anyhow::Result<Vec<Duration>> {
        let mut sent = Vec::new();
        for i in 0..n {
            let at = std::time::Instant::now();
            sent.push((rest.publish("s", json!({"i": i})).await?, at));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut out = Vec::new();
        for (id, at) in sent {
            let arrived = relay_tests::eventually(Duration::from_secs(30), || async {
                receiver.at("/small").into_iter().find(|r| r.header("relay-webhook-id") == id).map(|r| r.at)
            })
            .await
            .unwrap_or_else(|| panic!("small event {id} never arrived"));
            out.push(arrived.saturating_duration_since(at));
        }
        out.sort();
        Ok(out)
    }
    let solo = small_latencies(&small_rest, &receiver, 10).await?;

    // The large events arrive together: published while no dispatcher runs,
    // they reach the next one as one backlog.
    stack.stop_dispatchers().await?;
    let payload = format!(r#"{{"blob": "{}"}}"#, "x".repeat(250 * 1024));
    let publishers: Vec<_> = (0..8)
        .map(|_| {
            let (url, key, payload) = (stack.rest_url.clone(), big.api_key.clone(), payload.clone());
            tokio::spawn(async move {
                let rest = Rest::new(&url, Some(&key));
                for _ in 0..25 {
                    let (status, body) =
                        rest.raw(reqwest::Method::POST, "/v1/events", format!(r#"{{"type": "b", "payload": {payload}}}"#)).await?;
                    anyhow::ensure!(status == 202, "a large publish answered {status}: {body}");
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for p in publishers {
        p.await??;
    }
    stack.start_dispatcher().await?;
    let beside = small_latencies(&small_rest, &receiver, 30).await?;
    let big_arrived = receiver.wait_at("/big", 200, Duration::from_secs(120)).await;
    assert_eq!(big_arrived.len(), 200, "every large event arrives");
    assert!(big_arrived.iter().all(|r| r.body.len() > 250 * 1024), "whole bodies");
    let p = |v: &[Duration], q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    println!(
        "small events: solo p50 {:?} max {:?}; beside 200 × 250 KiB: p50 {:?} p99 {:?}",
        p(&solo, 0.5),
        p(&solo, 1.0),
        p(&beside, 0.5),
        p(&beside, 0.99)
    );
    assert!(
        p(&beside, 0.99) <= Duration::from_secs(1).max(p(&solo, 1.0) * 5),
        "the small tenant's p99 {:?} beside the burst (solo max {:?})",
        p(&beside, 0.99),
        p(&solo, 1.0)
    );
    stack.stop().await
}

/// Issue 9.8: seam and admin fields out of range are INVALID_ARGUMENT naming
/// the field — item by item inside a batch — never a panic, a wrapped value
/// or an internal error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_inputs_out_of_range_are_invalid_argument_never_a_panic() -> anyhow::Result<()> {
    use relay_contracts::relay::{
        admin::v1::{CreateApiKeyRequest, CreateEnvironmentRequest},
        dispatch::v1::{
            ExpandBatchRequest, ExpandRequest, MaterialRequest, OutcomeBatchRequest, OutcomeRequest, expand_result, outcome_result,
        },
    };
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("inputs").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint("http://127.0.0.1:9/x", &["x"]).await?;
    let event_id = rest.publish("x", json!({})).await?;
    let mut seam = stack.seam().await?;
    let pg = stack.pg().await?;
    let delivery_id = relay_tests::eventually(Duration::from_secs(10), || async {
        // No dispatcher runs: expand it here.
        let _ = stack
            .seam()
            .await
            .ok()?
            .expand(ExpandRequest {
                event_id: event_id.clone(),
                environment_id: tenant.environment_id.clone(),
                r#type: "x".into(),
                ..Default::default()
            })
            .await;
        sqlx::query_scalar::<_, Uuid>("SELECT id FROM webhook_deliveries LIMIT 1").fetch_optional(&pg).await.ok()?
    })
    .await
    .expect("expanded")
    .to_string();

    fn invalid<T>(r: Result<tonic::Response<T>, tonic::Status>, what: &str) {
        match r {
            Err(st) if st.code() == tonic::Code::InvalidArgument => assert!(st.message().len() < 300, "{what}: {}", st.message()),
            Err(st) => panic!("{what}: {st:?}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    }
    let outcome = |attempt: u32, generation: u32, status: Option<u32>| OutcomeRequest {
        delivery_id: delivery_id.clone(),
        attempt,
        generation,
        http_status: status,
        latency_ms: 1,
        ..Default::default()
    };
    invalid(seam.outcome(outcome(u32::MAX, 0, Some(500))).await, "attempt 4294967295");
    invalid(seam.outcome(outcome(0, 0, Some(500))).await, "attempt 0");
    invalid(seam.outcome(outcome(1, u32::MAX, Some(500))).await, "generation 4294967295");
    invalid(seam.outcome(outcome(1, 0, Some(99_999))).await, "http_status 99999");
    invalid(
        seam.material(MaterialRequest { delivery_id: delivery_id.clone(), attempt: u32::MAX, generation: 0, ..Default::default() }).await,
        "material attempt",
    );
    invalid(
        seam.material(MaterialRequest { delivery_id: "not-a-uuid".into(), attempt: 1, generation: 0, ..Default::default() }).await,
        "material id",
    );

    // In a batch, the bad item fails alone and the good one is recorded.
    let items = seam
        .outcome_batch(OutcomeBatchRequest { items: vec![outcome(u32::MAX, 0, Some(500)), outcome(1, 0, Some(200))], ..Default::default() })
        .await?
        .into_inner()
        .items;
    assert!(
        matches!(&items[0].result, Some(outcome_result::Result::Error(e)) if e.code == tonic::Code::InvalidArgument as i32 && e.reason == "attempt_out_of_range"),
        "{items:?}"
    );
    assert!(matches!(&items[1].result, Some(outcome_result::Result::Outcome(_))), "{items:?}");
    let items = seam
        .expand_batch(ExpandBatchRequest {
            items: vec![
                ExpandRequest {
                    event_id: "nope".into(),
                    environment_id: tenant.environment_id.clone(),
                    r#type: "x".into(),
                    ..Default::default()
                },
                ExpandRequest {
                    event_id: event_id.clone(),
                    environment_id: tenant.environment_id.clone(),
                    r#type: "x".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await?
        .into_inner()
        .items;
    assert!(
        matches!(&items[0].result, Some(expand_result::Result::Error(e)) if e.code == tonic::Code::InvalidArgument as i32),
        "{items:?}"
    );
    assert!(matches!(&items[1].result, Some(expand_result::Result::Expanded(x)) if x.duplicate), "{items:?}");

    let mut admin = stack.admin().await?;
    invalid(admin.create_environment(CreateEnvironmentRequest { name: "nul\0name".into(), endpoint_quota: 0 }).await, "a NUL in a name");
    invalid(
        admin.create_environment(CreateEnvironmentRequest { name: "n".repeat(1_000_000), endpoint_quota: 0 }).await,
        "a million characters",
    );
    invalid(
        admin.create_environment(CreateEnvironmentRequest { name: "ok".into(), endpoint_quota: u32::MAX }).await,
        "a quota of 4294967295",
    );
    invalid(
        admin.create_api_key(CreateApiKeyRequest { environment_id: tenant.environment_id.clone(), name: "line\nbreak".into() }).await,
        "a newline in a key name",
    );
    // Still serving.
    rest.publish("x", json!({"after": "all that"})).await?;
    pg.close().await;
    stack.stop().await
}
