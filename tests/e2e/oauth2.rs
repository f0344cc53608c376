//! Issue 27.4: OAuth2 client credentials towards a receiver, against a real
//! token server on loopback. Attempts carry a bearer token fetched with the
//! endpoint's credentials (HTTP Basic, the form RFC 6749 §4.4 asks for),
//! one token serves many attempts until shortly before it expires, a token
//! the receiver refuses (401) is fetched anew once before the attempt
//! counts as failed, and a token server that answers garbage or an error
//! fails the attempt with the reason in the attempt log. The secret is
//! stored sealed and never shown; the token URL is held to endpoint URL rules.

use std::time::Duration;

use relay_tests::{Options, Receiver, Reply, Rest, Stack, TokenMode, TokenServer};
use serde_json::{Value, json};

/// The delivery of `event`, once its attempts number `n` or more.
async fn attempts_of(rest: &Rest, event: &str, n: usize) -> anyhow::Result<Vec<Value>> {
    for _ in 0..300 {
        if let Some(d) = rest.deliveries(event).await?.first() {
            let attempts = d["attempts"].as_array().cloned().unwrap_or_default();
            if attempts.len() >= n {
                return Ok(attempts);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("event {event} never had {n} attempts")
}

fn bearer_of(r: &relay_tests::Received) -> String {
    r.header("authorization").strip_prefix("Bearer ").unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_carry_a_cached_bearer_token_refetched_on_expiry_and_on_401() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,1000,1000,1000,1000,1000,1000")).await?;
    let tenant = stack.tenant("oauth2").await?;
    let tokens = TokenServer::start().await?;
    tokens.set_mode(TokenMode::Issue(3));
    let receiver = Receiver::start().await?;
    receiver.reply("/oauth", Reply::Bearer(tokens.valid.clone()));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let oauth2 = json!({"token_url": tokens.url(), "client_id": "relay client", "client_secret": "s3cret:with/odd&chars",
                        "scope": "webhooks.write", "audience": "https://acme.example"});
    let (status, created) =
        rest.post("/v1/webhooks", json!({"url": receiver.url("/oauth"), "event_types": ["o"], "oauth2": oauth2})).await?;
    assert_eq!(status, 201, "{created}");
    let shown = &created["endpoint"]["oauth2"];
    assert_eq!((shown["client_id"].as_str(), shown["client_secret"].as_str()), (Some("relay client"), Some("")), "{created}");
    assert!(!rest.get("/v1/webhooks").await?.to_string().contains("s3cret"), "the secret is never shown");

    // Three events: one token serves them all.
    for n in 0..3 {
        rest.publish("o", json!({"n": n})).await?;
    }
    let got = receiver.wait_at("/oauth", 3, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 3);
    assert!(got.iter().all(|r| bearer_of(r) == "tok-1"), "{:?}", got.iter().map(bearer_of).collect::<Vec<_>>());
    let asked = tokens.requests();
    assert_eq!(asked.len(), 1, "one token request for three attempts");
    // RFC 6749 §2.3.1: id and secret form-encoded, then HTTP Basic.
    assert_eq!(asked[0].basic, "relay+client:s3cret%3Awith%2Fodd%26chars");
    let form: std::collections::HashMap<_, _> = asked[0].form.iter().cloned().collect();
    assert_eq!(form.get("grant_type").map(String::as_str), Some("client_credentials"));
    assert_eq!(form.get("scope").map(String::as_str), Some("webhooks.write"));
    assert_eq!(form.get("audience").map(String::as_str), Some("https://acme.example"));

    // Past its lifetime (3 s, renewed a fifth before): a new token.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    rest.publish("o", json!({"n": 3})).await?;
    let got = receiver.wait_at("/oauth", 4, Duration::from_secs(20)).await;
    assert_eq!(bearer_of(&got[3]), "tok-2", "fetched anew before it expired");

    // Revoked early: the receiver answers 401, the dispatcher fetches once
    // more and the same attempt succeeds.
    tokens.set_mode(TokenMode::Issue(3600));
    tokens.revoke("tok-2");
    let revoked = rest.publish("o", json!({"n": 4})).await?;
    let got = receiver.wait_at("/oauth", 6, Duration::from_secs(20)).await;
    assert_eq!((bearer_of(&got[4]), bearer_of(&got[5])), ("tok-2".into(), "tok-3".into()));
    let attempts = attempts_of(&rest, &revoked, 1).await?;
    assert_eq!((attempts.len(), attempts[0]["http_status"].as_u64()), (1, Some(200)), "one attempt: {attempts:?}");

    // A token server that answers garbage, then one that fails: the attempt
    // fails with the reason, and the retry succeeds once it recovers.
    tokens.set_mode(TokenMode::Garbage);
    tokens.revoke("tok-3");
    let garbled = rest.publish("o", json!({"n": 5})).await?;
    let attempts = attempts_of(&rest, &garbled, 1).await?;
    let error = attempts[0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("oauth2") && error.contains("not a token"), "{error:?}");
    tokens.set_mode(TokenMode::Status(503));
    let attempts = attempts_of(&rest, &garbled, 2).await?;
    let error = attempts[1]["error"].as_str().unwrap_or_default();
    assert!(error.contains("token endpoint answered 503"), "{error:?}");
    tokens.set_mode(TokenMode::Issue(3600));
    let attempts = attempts_of(&rest, &garbled, 3).await?;
    assert_eq!(attempts.last().unwrap()["http_status"].as_u64(), Some(200), "{attempts:?}");
    assert!(!serde_json::to_string(&attempts)?.contains("tok-"), "no token in the attempt log");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauth2_credentials_are_checked_and_the_token_url_held_to_endpoint_rules() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("oauth2-rules").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let url = "http://127.0.0.1:9/o";
    let good = json!({"token_url": "http://127.0.0.1:9/token", "client_id": "c", "client_secret": "s"});
    let with = |patch: Value| {
        let mut o = good.clone();
        o.as_object_mut().unwrap().extend(patch.as_object().unwrap().clone());
        json!({"url": url, "event_types": ["o"], "oauth2": o})
    };
    for (body, words) in [
        (with(json!({"token_url": "ftp://127.0.0.1/token"})), "oauth2.token_url"),
        (with(json!({"token_url": "http://169.254.169.254/latest/token"})), "oauth2.token_url"),
        (with(json!({"token_url": ""})), "oauth2.token_url is required"),
        (with(json!({"client_secret": ""})), "oauth2.client_secret is required"),
        (with(json!({"client_id": "x".repeat(257)})), "at most 256 characters; this one is 257"),
        (with(json!({"scope": "a\r\nInjected: 1"})), "oauth2.scope may not hold control characters"),
    ] {
        let (status, reply) = rest.post("/v1/webhooks", body).await?;
        assert_eq!((status, reply["reason"].as_str()), (400, Some("invalid_oauth_credentials")), "{reply}");
        assert!(reply["message"].as_str().unwrap_or_default().contains(words), "{reply} should say {words}");
    }
    let (status, created) = rest.post("/v1/webhooks", with(json!({}))).await?;
    assert_eq!(status, 201, "{created}");
    let path = format!("/v1/webhooks/{}", created["endpoint"]["id"].as_str().unwrap());
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"oauth2": good, "clear_oauth2": true}))).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_oauth_credentials")), "{body}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"clear_oauth2": true}))).await?;
    assert_eq!((status, &body["endpoint"]["oauth2"]), (200, &Value::Null), "{body}");
    Ok(())
}

/// The token URL is checked again at every fetch, as an endpoint URL is at
/// every send: a name that resolved to a permitted address at registration
/// and resolves to a private one later is refused, and the token server is
/// never asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_url_that_later_resolves_to_a_blocked_address_is_never_called() -> anyhow::Result<()> {
    use relay_netguard::StaticResolver;
    let tokens = TokenServer::start().await?;
    let (at_registration, at_send) = (std::sync::Arc::new(StaticResolver::default()), std::sync::Arc::new(StaticResolver::default()));
    at_registration.set("tokens.test", &["127.0.0.1".parse()?]);
    at_send.set("tokens.test", &["10.0.0.9".parse()?]);
    let stack =
        Stack::start(Options { api_resolver: Some(at_registration), dispatcher_resolver: Some(at_send), ..Options::default().tiers("0") })
            .await?;
    let tenant = stack.tenant("oauth2-rebind").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/o", Reply::Bearer(tokens.valid.clone()));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let token_url = format!("http://tokens.test:{}/token", tokens.addr.port());
    let oauth2 = json!({"token_url": token_url, "client_id": "c", "client_secret": "s"});
    let (status, created) = rest.post("/v1/webhooks", json!({"url": receiver.url("/o"), "event_types": ["o"], "oauth2": oauth2})).await?;
    assert_eq!(status, 201, "permitted at registration: {created}");
    let event = rest.publish("o", json!({"n": 1})).await?;
    let attempts = attempts_of(&rest, &event, 1).await?;
    let error = attempts[0]["error"].as_str().unwrap_or_default();
    // Refused by the guarded resolver at connect time (one lookup, checked,
    // then connected to), as an endpoint's host is.
    assert!(error.starts_with("oauth2:") && error.contains("10.0.0.9") && error.contains("may not target"), "{error:?}");
    assert!(tokens.requests().is_empty(), "the token server was never asked");
    assert!(receiver.at("/o").is_empty(), "nothing was sent without a token");
    stack.stop().await
}
