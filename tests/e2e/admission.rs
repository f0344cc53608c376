//! Issue 30, admission control: an operator limits how fast an environment
//! publishes (AdminService.SetPublishLimit); over the limit a publish is
//! answered 429 / RESOURCE_EXHAUSTED with Retry-After and nothing is
//! written; the limit is the environment's across apis, not per process;
//! other environments are untouched; bad limits are refused by name.

use std::time::{Duration, Instant};

use relay_contracts::relay::admin::v1::SetPublishLimitRequest;
use relay_tests::{Options, Rest, Stack};
use serde_json::json;

/// Publishes `n` events as fast as they are answered, alternating between
/// `rests`, 8 at a time; each answer's status and Retry-After.
async fn publish_burst(rests: &[Rest], n: usize) -> anyhow::Result<Vec<(u16, Option<u64>, String)>> {
    let calls = (0..n).map(|i| {
        let rest = &rests[i % rests.len()];
        async move {
            let resp = rest
                .http
                .post(format!("{}/v1/events", rest.base))
                .bearer_auth(rest.key.as_deref().unwrap_or_default())
                .json(&json!({"type": "order.paid", "payload": {"n": i}}))
                .send()
                .await?;
            let status = resp.status().as_u16();
            let retry = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
            let body: serde_json::Value = resp.json().await?;
            anyhow::Ok((status, retry, body["reason"].as_str().unwrap_or_default().to_owned()))
        }
    });
    let mut out = Vec::new();
    let mut stream = futures::stream::iter(calls).buffer_unordered(8);
    use futures::StreamExt as _;
    while let Some(r) = stream.next().await {
        out.push(r?);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_limit_holds_across_two_apis_and_refuses_with_retry_after() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let (replica_rest, _) = stack.start_api_replica().await?;
    let (limited, free) = (stack.tenant("admission-limited").await?, stack.tenant("admission-free").await?);
    let mut admin = stack.admin().await?;
    let set = admin
        .set_publish_limit(SetPublishLimitRequest { environment_id: limited.environment_id.clone(), per_second: 10, burst: 5 })
        .await?
        .into_inner();
    assert_eq!((set.per_second, set.burst), (10, 5));
    // The other api reads its environments' limits within a second.
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let limited_rests = [Rest::new(&stack.rest_url, Some(&limited.api_key)), Rest::new(&replica_rest, Some(&limited.api_key))];
    let started = Instant::now();
    let answers = publish_burst(&limited_rests, 80).await?;
    let window = started.elapsed().as_secs_f64();
    let accepted = answers.iter().filter(|a| a.0 == 202).count();
    let refused: Vec<&(u16, Option<u64>, String)> = answers.iter().filter(|a| a.0 != 202).collect();
    // At most the burst plus the rate over the window, whichever api took it.
    let bound = 5 + (10.0 * window).ceil() as usize;
    assert!(accepted <= bound, "{accepted} accepted in {window:.2} s across two apis; the limit allows {bound}");
    assert!(accepted >= 5, "the burst passes: {accepted}");
    assert!(!refused.is_empty());
    for (status, retry, reason) in &refused {
        assert_eq!((*status, reason.as_str()), (429, "publish_rate_limited"));
        assert!(retry.is_some_and(|s| (1..=2).contains(&s)), "Retry-After says when: {retry:?}");
    }
    // Nothing was written for a refusal.
    let pg = stack.pg().await?;
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE environment_id = $1::uuid")
        .bind(&limited.environment_id)
        .fetch_one(&pg)
        .await?;
    assert_eq!(written as usize, accepted, "an event per 202, none per 429");

    // Waiting as asked, a publish passes again.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    limited_rests[1].publish("order.paid", json!({"after": "waiting"})).await?;

    // Another environment is not limited by it.
    let free_rests = [Rest::new(&stack.rest_url, Some(&free.api_key)), Rest::new(&replica_rest, Some(&free.api_key))];
    let free_answers = publish_burst(&free_rests, 80).await?;
    assert!(free_answers.iter().all(|a| a.0 == 202), "{:?}", free_answers.iter().find(|a| a.0 != 202));

    // Removed, the limit is gone (this api at once).
    admin.set_publish_limit(SetPublishLimitRequest { environment_id: limited.environment_id.clone(), per_second: 0, burst: 0 }).await?;
    let again = publish_burst(&limited_rests[..1], 40).await?;
    assert!(again.iter().all(|a| a.0 == 202), "{:?}", again.iter().find(|a| a.0 != 202));

    // Bad limits are refused by name; an unknown environment is 404.
    for (per_second, burst) in [(10_001, 1), (5, 10_001)] {
        let err = admin
            .set_publish_limit(SetPublishLimitRequest { environment_id: limited.environment_id.clone(), per_second, burst })
            .await
            .expect_err("out of range");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(err.metadata().get("relay-error-reason").and_then(|v| v.to_str().ok()), Some("publish_limit_out_of_range"));
        assert!(err.message().contains("10001"), "{}", err.message());
    }
    let err = admin
        .set_publish_limit(SetPublishLimitRequest { environment_id: uuid::Uuid::new_v4().to_string(), per_second: 5, burst: 1 })
        .await
        .expect_err("no such environment");
    assert_eq!(err.code(), tonic::Code::NotFound);
    Ok(())
}
