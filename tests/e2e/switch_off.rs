//! Issue 25: an endpoint switched off (deleted, or disabled by its tenant)
//! while a dispatcher holds its first attempts, handed over with their
//! material and queued on the endpoint's lane, receives no request that
//! starts after the switch-off was answered.

use std::time::{Duration, Instant};

use relay_tests::{Options, Receiver, Reply, Rest, Stack};
use reqwest::Method;
use serde_json::json;

/// Rounds of "burst, then switch off mid-burst"; before the fix, nearly every
/// round saw requests start after the answer (the lane's queue of attempts
/// in hand kept being sent).
const ROUNDS: u64 = 12;
/// Events per burst: many more than the endpoint's in-flight cap, so the
/// lane always has attempts queued behind the one on the wire.
const BURST: u64 = 60;
/// How long the receiver takes to answer each request.
const SLOW: Duration = Duration::from_millis(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_starts_after_an_endpoint_switched_off_mid_burst_was_answered() -> anyhow::Result<()> {
    // A cap of 16: up to 16 first attempts are in the dispatcher's hands at
    // once, one on the wire and the rest queued on the lane.
    let stack = Stack::start(Options { endpoint_cap: 16, ..Options::default() }).await?;
    let tenant = stack.tenant("switch-off-mid-burst").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let mut answered: Vec<(String, Instant, &str)> = Vec::new();
    let mut took: Vec<Duration> = Vec::new();
    for round in 0..ROUNDS {
        let path = format!("/burst{round}");
        receiver.reply(&path, Reply::Hang(SLOW));
        let (endpoint, _) = rest.endpoint(&receiver.url(&path), &[&format!("b{round}")]).await?;
        let burst: Vec<_> = (0..BURST)
            .map(|i| {
                let (url, key, event_type) = (stack.rest_url.clone(), tenant.api_key.clone(), format!("b{round}"));
                tokio::spawn(async move { Rest::new(&url, Some(&key)).publish(&event_type, json!({"round": round, "i": i})).await })
            })
            .collect();
        // Switch off while the lane is busy: a few requests in, and at a
        // different point of an attempt's 30 ms each round.
        let started = receiver.wait_at(&path, 3, Duration::from_secs(20)).await;
        assert!(started.len() >= 3, "round {round}: the burst's first requests arrive");
        tokio::time::sleep(Duration::from_millis(round * 7 % 30)).await;
        let (method, endpoint_path, how) = if round % 3 == 2 {
            (Method::POST, format!("/v1/webhooks/{endpoint}/disable"), "disabled")
        } else {
            (Method::DELETE, format!("/v1/webhooks/{endpoint}"), "deleted")
        };
        let asked = Instant::now();
        let (status, body) = rest.call(method, &endpoint_path, None).await?;
        let at = Instant::now();
        took.push(at - asked);
        assert!(status == 200 || status == 204, "round {round}: {status} {body}");
        answered.push((path, at, how));
        for published in burst {
            published.await??;
        }
    }
    // Longer than any material stays fresh in a lane (2 s) and the test's
    // attempt timeout (2 s): whatever was still to come has come by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut late = Vec::new();
    let mut before = 0;
    for (path, at, how) in &answered {
        let got = receiver.at(path);
        before += got.iter().filter(|r| r.at <= *at).count();
        let after: Vec<Duration> = got.iter().filter(|r| r.at > *at).map(|r| r.at - *at).collect();
        if !after.is_empty() {
            late.push(format!("{path} ({how}): {} request(s) started after the answer, the first {:?} after", after.len(), after[0]));
        }
    }
    eprintln!("switch-offs answered in {took:?}; {before} requests before them");
    assert!(late.is_empty(), "requests started after the switch-off was answered:\n{}", late.join("\n"));
    assert!(before >= 3 * ROUNDS as usize, "each burst reached its endpoint before the switch-off");
    stack.stop().await
}
