//! Issue 27.1: custom headers per endpoint. Sent with every attempt (the
//! first, handed over at expansion, and a retry, fetched as material),
//! stored sealed, read back masked, replaced and cleared by an update, and
//! refused with the header named when they break a rule.

use std::time::Duration;

use relay_tests::{Options, Receiver, Reply, Rest, Stack, flaky};
use serde_json::{Value, json};

const CREDENTIAL: &str = "Bearer s3cr3t-partner-token";

async fn create(rest: &Rest, url: &str, headers: Value) -> anyhow::Result<(u16, Value)> {
    rest.post("/v1/webhooks", json!({"url": url, "event_types": ["h"], "headers": headers})).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_headers_go_with_every_attempt_are_stored_sealed_and_read_masked() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,100,100,100,100,100,100")).await?;
    let tenant = stack.tenant("headers").await?;
    let receiver = Receiver::start().await?;
    // Refuses each webhook's first request: every event is sent twice, so
    // both a first attempt and a retry carry the headers, whichever way the
    // api hands them out (at expansion, by refill, or as material).
    receiver.reply("/h", Reply::Flaky(flaky::Flaky::new(flaky::Behaviour::FailFirst(503))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (status, created) =
        create(&rest, &receiver.url("/h"), json!({"X-Partner-Id": "acme-partner", "Authorization": CREDENTIAL})).await?;
    assert_eq!(status, 201, "{created}");
    let id = created["endpoint"]["id"].as_str().unwrap().to_owned();
    let masked = json!({"X-Partner-Id": "acme…", "Authorization": "Bear…"});
    assert_eq!(created["endpoint"]["headers"], masked, "{created}");

    let first = rest.publish("h", json!({"n": 1})).await?;
    let got = receiver.wait_at("/h", 2, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 2, "the first attempt and its retry");
    for r in &got {
        assert_eq!((r.header("x-partner-id").as_str(), r.header("authorization").as_str()), ("acme-partner", CREDENTIAL));
        assert_eq!(r.headers.get_all("relay-webhook-signature").iter().count(), 1, "the signature is Relay's alone");
        assert_eq!(r.header("content-type"), "application/json");
    }

    // Read back masked; the value is nowhere in what the api returns or keeps in clear.
    let read = rest.get(&format!("/v1/webhooks/{id}")).await?;
    assert_eq!(read["headers"], masked, "{read}");
    let listed = rest.get("/v1/webhooks").await?;
    assert!(!listed.to_string().contains("s3cr3t"), "{listed}");
    let deliveries = rest.deliveries(&first).await?;
    assert!(!serde_json::to_string(&deliveries)?.contains("s3cr3t"), "the attempt log keeps no request header: {deliveries:?}");
    let pg = stack.pg().await?;
    let (key_id, sealed, shown): (String, Vec<u8>, Value) =
        sqlx::query_as("SELECT headers_key_id, headers_ciphertext, headers_shown FROM webhook_endpoints WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&pg)
            .await?;
    assert_eq!(key_id, "dev");
    assert!(!sealed.windows(6).any(|w| w == b"s3cr3t") && !shown.to_string().contains("s3cr3t"), "stored sealed");
    pg.close().await;
    // The portal's endpoint page shows them as reads do, escaped.
    let http = crate::portal::browser();
    let session = crate::portal::enter(&http, &crate::portal::mint(&rest).await?).await?;
    let (status, _, page) = crate::portal::page(&http, format!("{}/portal/endpoints/{id}", stack.rest_url), Some(&session)).await?;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("X-Partner-Id: acme…") && page.contains("Authorization: Bear…"), "{page}");
    assert!(!page.contains("s3cr3t") && !page.contains("acme-partner"), "no value beyond its mask");

    // An update replaces them all; clearing removes them; both at once is refused.
    let path = format!("/v1/webhooks/{id}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"headers": {"X-Partner-Id": "beta-partner"}}))).await?;
    assert_eq!((status, &body["endpoint"]["headers"]), (200, &json!({"X-Partner-Id": "beta…"})), "{body}");
    rest.publish("h", json!({"n": 2})).await?;
    let got = receiver.wait_at("/h", 4, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 4);
    assert!(got[2..].iter().all(|r| r.header("x-partner-id") == "beta-partner" && r.header("authorization").is_empty()));
    let both = json!({"headers": {"X-A": "1"}, "clear_headers": true});
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(both)).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_headers")), "{body}");
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"clear_headers": true}))).await?;
    assert_eq!((status, &body["endpoint"]["headers"]), (200, &json!({})), "{body}");
    // Cleared: the next event carries none.
    rest.publish("h", json!({"n": 3})).await?;
    let got = receiver.wait_at("/h", 6, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 6);
    assert!(got[4..].iter().all(|r| r.header("x-partner-id").is_empty()), "cleared");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_break_a_rule_are_refused_with_the_header_named() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("bad-headers").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let url = "http://127.0.0.1:9/h";
    let many: serde_json::Map<String, Value> = (0..21).map(|i| (format!("X-{i}"), json!("v"))).collect();
    let cases: Vec<(Value, &str)> = vec![
        (json!({"Host": "evil.example"}), "Host"),
        (json!({"Content-Length": "0"}), "Content-Length"),
        (json!({"Transfer-Encoding": "chunked"}), "Transfer-Encoding"),
        (json!({"relay-webhook-signature": "v1=forged"}), "relay-webhook-signature"),
        (json!({"Webhook-Id": "forged"}), "Webhook-Id"),
        (json!({"Content-Type": "text/plain"}), "Content-Type"),
        (json!({"X-Split": "a\r\nX-Injected: 1"}), "X-Split"),
        (json!({"X-Nul": "a\u{0}b"}), "X-Nul"),
        (json!({"X Space": "v"}), "X Space"),
        (json!({"X-Utf8": "caf\u{e9}"}), "X-Utf8"),
        (json!({"X-Big": "v".repeat(5000)}), "4096 bytes"),
        (Value::Object(many), "at most 20 pairs; got 21"),
    ];
    for (headers, named) in cases {
        let (status, body) = create(&rest, url, headers.clone()).await?;
        assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_headers")), "{headers}: {body}");
        assert!(body["message"].as_str().unwrap_or_default().contains(named), "{headers}: {body}");
    }
    let (status, body) = create(&rest, url, json!({"X-Number": 5})).await?;
    assert_eq!(status, 400, "a value that is not a string: {body}");
    assert!(rest.get("/v1/webhooks").await?["endpoints"].as_array().is_none_or(Vec::is_empty), "nothing was created");
    stack.stop().await
}

/// The portal's endpoint forms set custom headers and the in-flight cap;
/// an edit with the headers field left empty keeps them (their values are
/// never shown to copy back), "remove all" clears them, and a mistake is
/// named on the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portal_sets_keeps_and_clears_headers_and_the_in_flight_cap() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("portal-headers").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let portal = relay_tests::PortalVisitor::enter(&stack.rest_url, &tenant.api_key).await?;
    let url = "http://127.0.0.1:9/p";
    let create = |headers: &'static str, cap: &'static str| {
        [("csrf", portal.csrf.as_str()), ("url", url), ("event_types", "p"), ("headers", headers), ("max_in_flight", cap)]
    };
    let (status, _, page) = portal.post("/portal/endpoints", &create("no colon here", "")).await?;
    assert!(status == 400 && page.contains("line 1 has no"), "{status}: {page}");
    let (status, _, page) = portal.post("/portal/endpoints", &create("Host: evil", "")).await?;
    assert!(status == 400 && page.contains("header Host is set by Relay"), "{status}: {page}");
    let (status, _, page) = portal.post("/portal/endpoints", &create("X-Partner-Id: acme-partner", "2000")).await?;
    assert!(status == 400 && page.contains("max_in_flight must be 1–1000, got 2000"), "{status}: {page}");
    let (status, _, page) = portal.post("/portal/endpoints", &create("X-Partner-Id: acme-partner\nX-Team: payments", "1")).await?;
    assert_eq!(status, 200, "{page}");
    let listed = rest.get("/v1/webhooks").await?;
    let endpoint = &listed["endpoints"][0];
    assert_eq!(endpoint["headers"], json!({"X-Partner-Id": "acme…", "X-Team": "paym…"}), "{listed}");
    assert_eq!(endpoint["max_in_flight"], 1, "{listed}");
    let id = endpoint["id"].as_str().unwrap().to_owned();

    // Saved with the headers field empty and the cap emptied: headers kept,
    // the cap back to the platform's.
    let path = format!("/portal/endpoints/{id}");
    let edit = |headers: &'static str, clear: bool| {
        let mut f = vec![("csrf", portal.csrf.as_str()), ("url", url), ("event_types", "p"), ("headers", headers), ("max_in_flight", "")];
        if clear {
            f.push(("clear_headers", "on"));
        }
        f
    };
    let (status, to, page) = portal.post(&path, &edit("", false)).await?;
    assert_eq!((status, to.as_deref()), (303, Some(format!("{path}?done=saved").as_str())), "{page}");
    let read = rest.get(&format!("/v1/webhooks/{id}")).await?;
    assert_eq!((&read["headers"]["X-Team"], &read["max_in_flight"]), (&json!("paym…"), &Value::Null), "{read}");
    let (status, _, page) = portal.post(&path, &edit("X-A: 1", true)).await?;
    assert!(status == 400 && page.contains("not both"), "{status}: {page}");
    let (status, _, _) = portal.post(&path, &edit("", true)).await?;
    assert_eq!(status, 303);
    assert_eq!(rest.get(&format!("/v1/webhooks/{id}")).await?["headers"], json!({}), "removed");
    stack.stop().await
}
