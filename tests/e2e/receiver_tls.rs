//! Issue 27.4 and 27.5: receivers over HTTPS. A real TLS receiver (rustls)
//! that requires a client certificate signed by its CA: an endpoint that
//! pins that CA and presents its certificate is delivered to (the first
//! attempt and a retry), one without a certificate, one whose certificate
//! comes from a stranger CA and one that does not pin the receiver's CA are
//! not, and the attempt log says why. A new certificate overlaps the one it
//! replaced for 24 hours: a receiver that refuses the new one in the
//! handshake is presented the previous one, until the tenant ends the
//! overlap. Certificates and bundles are checked when they are uploaded; the
//! key is never shown.

use std::time::Duration;

use relay_tests::{Options, Receiver, Reply, Rest, Stack, TestPki, flaky};
use serde_json::{Value, json};

async fn create(rest: &Rest, body: Value) -> anyhow::Result<(u16, Value)> {
    rest.post("/v1/webhooks", body).await
}

/// The endpoint's attempts at its delivery of `event`, once one is recorded.
async fn attempts(rest: &Rest, event: &str, endpoint: &str) -> anyhow::Result<Vec<Value>> {
    for _ in 0..200 {
        let deliveries = rest.deliveries(event).await?;
        if let Some(a) =
            deliveries.iter().find(|d| d["endpoint_id"] == endpoint).and_then(|d| d["attempts"].as_array()).filter(|a| !a.is_empty())
        {
            return Ok(a.clone());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("no attempt of {endpoint} recorded for {event}")
}

/// The first attempt's error of the endpoint's delivery of `event`, once recorded.
async fn first_error(rest: &Rest, event: &str, endpoint: &str) -> anyhow::Result<String> {
    Ok(attempts(rest, event, endpoint).await?[0]["error"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_presented_to_a_receiver_that_requires_it() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("mtls").await?;
    let pki = TestPki::new()?;
    let receiver = Receiver::start_tls(pki.server_config(true)?).await?;
    // Refuses each webhook's first request: the retry (fetched as material)
    // must present the certificate as the first attempt did.
    receiver.reply("/mtls", Reply::Flaky(flaky::Flaky::new(flaky::Behaviour::FailFirst(503))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let endpoint = |path: &str, extra: Value| {
        let mut body = json!({"url": receiver.url(path), "event_types": ["tls"]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let (status, good) =
        create(&rest, endpoint("/mtls", json!({"ca_bundle": pki.ca, "client_certificate": pki.client.cert, "client_key": pki.client.key})))
            .await?;
    assert_eq!(status, 201, "{good}");
    let shown = &good["endpoint"]["client_certificate"];
    assert!(shown["subject"].as_str().unwrap_or_default().contains("acme-dispatch"), "{good}");
    assert_eq!(shown["fingerprint_sha256"].as_str().map(str::len), Some(64), "{good}");
    assert_eq!(good["endpoint"]["ca_bundle"].as_str().map(str::trim), Some(pki.ca.trim()));
    let (_, no_cert) = create(&rest, endpoint("/no-cert", json!({"ca_bundle": pki.ca}))).await?;
    let (_, stranger) = create(
        &rest,
        endpoint("/stranger", json!({"ca_bundle": pki.ca, "client_certificate": pki.stranger.cert, "client_key": pki.stranger.key})),
    )
    .await?;
    let (_, unpinned) =
        create(&rest, endpoint("/unpinned", json!({"client_certificate": pki.client.cert, "client_key": pki.client.key}))).await?;
    let listed = rest.get("/v1/webhooks").await?.to_string();
    assert!(!listed.contains("PRIVATE KEY"), "a client key is never shown: {listed}");

    let event = rest.publish("tls", json!({"n": 1})).await?;
    let got = receiver.wait_at("/mtls", 2, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 2, "the first attempt and its retry, both over mutual TLS");
    assert!(got.iter().all(|r| r.header("relay-webhook-id") == event && !r.header("relay-webhook-signature").is_empty()));
    for (who, body, words) in [
        ("no certificate", &no_cert, &["certificate"][..]),
        ("a stranger's certificate", &stranger, &["certificate", "ca"][..]),
        ("no pinned CA", &unpinned, &["certificate", "issuer"][..]),
    ] {
        let id = body["endpoint"]["id"].as_str().unwrap_or_default();
        let error = first_error(&rest, &event, id).await?.to_lowercase();
        assert!(words.iter().any(|w| error.contains(w)), "{who}: the attempt log should say why: {error:?}");
    }
    for path in ["/no-cert", "/stranger", "/unpinned"] {
        assert!(receiver.at(path).is_empty(), "{path}: no request without a handshake");
    }
    // Clearing the certificate: the next event's attempt has none to present.
    let path = format!("/v1/webhooks/{}", good["endpoint"]["id"].as_str().unwrap());
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"clear_client_certificate": true}))).await?;
    assert_eq!((status, &body["endpoint"]["client_certificate"]), (200, &Value::Null), "{body}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_client_certificate_overlaps_the_one_it_replaced_until_the_overlap_ends() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("mtls-rotation").await?;
    let pki = TestPki::new()?;
    // Trusts certificates of `pki.ca` only: `pki.stranger` plays a new
    // certificate the receiver's operators have not yet learnt to trust.
    let receiver = Receiver::start_tls(pki.server_config(true)?).await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let with = |pair: &relay_tests::PemPair| json!({"client_certificate": pair.cert, "client_key": pair.key});
    let mut body = json!({"url": receiver.url("/r"), "event_types": ["tls"], "ca_bundle": pki.ca});
    body.as_object_mut().unwrap().extend(with(&pki.client).as_object().unwrap().clone());
    let (status, created) = create(&rest, body).await?;
    assert_eq!(status, 201, "{created}");
    let trusted = created["endpoint"]["client_certificate"]["fingerprint_sha256"].as_str().unwrap_or_default().to_owned();
    assert!(created["endpoint"]["previous_client_certificate"].is_null(), "no overlap before a change: {created}");
    let path = format!("/v1/webhooks/{}", created["endpoint"]["id"].as_str().unwrap());
    let id = created["endpoint"]["id"].as_str().unwrap().to_owned();

    let asked_at = chrono::Utc::now();
    let (status, rotated) = rest.call(reqwest::Method::PATCH, &path, Some(with(&pki.stranger))).await?;
    assert_eq!(status, 200, "{rotated}");
    let (current, previous) = (&rotated["endpoint"]["client_certificate"], &rotated["endpoint"]["previous_client_certificate"]);
    assert!(current["subject"].as_str().unwrap_or_default().contains("not-acme"), "{rotated}");
    assert_eq!(previous["fingerprint_sha256"].as_str(), Some(trusted.as_str()), "the replaced one overlaps: {rotated}");
    let until = chrono::DateTime::parse_from_rfc3339(previous["presented_until"].as_str().unwrap_or_default())?;
    let window = until.signed_duration_since(asked_at);
    assert!(
        window > chrono::Duration::hours(24) - chrono::Duration::minutes(1)
            && window <= chrono::Duration::hours(24) + chrono::Duration::seconds(5),
        "the overlap lasts 24 h: {window}"
    );
    let read = rest.get(&path).await?;
    assert_eq!(read["previous_client_certificate"], *previous, "reads show it too: {read}");
    assert!(read["client_certificate"].get("presented_until").is_none(), "only the previous one has an end: {read}");

    // The receiver refuses the new certificate in the handshake: the same
    // attempt presents the previous one, and the webhook arrives once, at
    // its first attempt.
    let first = rest.publish("tls", json!({"n": 1})).await?;
    let got = receiver.wait_for_event(&first, Duration::from_secs(20)).await.expect("delivered with the previous certificate");
    assert_eq!(got.client_certificate.as_deref(), Some(trusted.as_str()));
    let recorded = attempts(&rest, &first, &id).await?;
    assert_eq!((recorded.len(), &recorded[0]["http_status"]), (1, &json!(200)), "{recorded:?}");
    assert_eq!(receiver.at("/r").len(), 1, "sent once: a refused handshake carries no request");

    // Ending the overlap: only the new certificate, which the receiver refuses.
    let (status, ended) = rest.call(reqwest::Method::PATCH, &path, Some(json!({"end_client_certificate_overlap": true}))).await?;
    assert_eq!(status, 200, "{ended}");
    assert!(ended["endpoint"]["previous_client_certificate"].is_null(), "{ended}");
    assert_eq!(ended["endpoint"]["client_certificate"], *current, "the current certificate stays");
    let second = rest.publish("tls", json!({"n": 2})).await?;
    let error = first_error(&rest, &second, &id).await?.to_lowercase();
    assert!(error.contains("certificate") && !error.contains("previous"), "refused, no fallback left: {error:?}");
    assert_eq!(receiver.at("/r").len(), 1, "nothing arrived without a certificate it trusts");

    // Back to a certificate the receiver trusts: the waiting retry and a new
    // event both arrive with it; the refused one is the fallback now.
    let (status, back) = rest.call(reqwest::Method::PATCH, &path, Some(with(&pki.client))).await?;
    assert_eq!(status, 200, "{back}");
    assert!(back["endpoint"]["previous_client_certificate"]["subject"].as_str().unwrap_or_default().contains("not-acme"), "{back}");
    let third = rest.publish("tls", json!({"n": 3})).await?;
    for event in [&second, &third] {
        let got = receiver.wait_for_event(event, Duration::from_secs(20)).await.expect("delivered with the trusted certificate");
        assert_eq!(got.client_certificate.as_deref(), Some(trusted.as_str()));
    }
    // A replacement that ends the overlap at once (a key that leaked).
    let outright = json!({"client_certificate": pki.stranger.cert, "client_key": pki.stranger.key, "end_client_certificate_overlap": true});
    let (status, replaced) = rest.call(reqwest::Method::PATCH, &path, Some(outright)).await?;
    assert_eq!(status, 200, "{replaced}");
    assert!(replaced["endpoint"]["previous_client_certificate"].is_null(), "{replaced}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_and_bundles_are_checked_when_uploaded() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("mtls-rules").await?;
    let pki = TestPki::new()?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let url = "https://127.0.0.1:9/tls";
    let garbage = "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n";
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"client_certificate": garbage, "client_key": pki.client.key}), "invalid_client_certificate", "not PEM"),
        (json!({"client_certificate": "hello", "client_key": pki.client.key}), "invalid_client_certificate", "no CERTIFICATE"),
        (json!({"client_certificate": pki.client.cert, "client_key": pki.stranger.key}), "invalid_client_certificate", "does not match"),
        (json!({"client_certificate": pki.expired.cert, "client_key": pki.expired.key}), "invalid_client_certificate", "expired at 2021"),
        (json!({"client_certificate": pki.client.cert}), "invalid_client_certificate", "needs its client_key"),
        (json!({"client_key": pki.client.key}), "invalid_client_certificate", "needs its client_certificate"),
        (json!({"client_certificate": pki.client.cert, "client_key": pki.client.cert}), "invalid_client_certificate", "private key"),
        (json!({"client_certificate": pki.client.cert.repeat(80), "client_key": pki.client.key}), "invalid_client_certificate", "32768"),
        (json!({"ca_bundle": garbage}), "invalid_ca_bundle", "not PEM"),
        (json!({"ca_bundle": "just text"}), "invalid_ca_bundle", "no CERTIFICATE"),
        (json!({"ca_bundle": pki.ca.repeat(17)}), "invalid_ca_bundle", "at most 16"),
        (json!({"client_certificate": pki.client.cert.repeat(9), "client_key": pki.client.key}), "invalid_client_certificate", "at most 8"),
        (json!({"ca_bundle": 5}), "", ""),
    ];
    for (extra, reason, words) in &cases {
        let mut body = json!({"url": url, "event_types": ["tls"]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, reply) = create(&rest, body).await?;
        assert_eq!(status, 400, "{reply}");
        if !reason.is_empty() {
            assert_eq!(reply["reason"].as_str(), Some(*reason), "{reply}");
            let message = reply["message"].as_str().unwrap_or_default();
            assert!(message.contains(words), "{message:?} should say {words:?}");
            assert!(!message.contains("PRIVATE KEY"), "no key echoed: {message}");
        }
    }
    // None of those was stored; a valid pair is, and replacing it changes the fingerprint.
    let (status, created) =
        create(&rest, json!({"url": url, "event_types": ["tls"], "client_certificate": pki.stranger.cert, "client_key": pki.stranger.key}))
            .await?;
    assert_eq!(status, 201, "{created}");
    let path = format!("/v1/webhooks/{}", created["endpoint"]["id"].as_str().unwrap());
    let change = json!({"client_certificate": pki.client.cert, "client_key": pki.client.key});
    let (status, changed) = rest.call(reqwest::Method::PATCH, &path, Some(change)).await?;
    assert_eq!(status, 200, "{changed}");
    assert_ne!(
        changed["endpoint"]["client_certificate"]["fingerprint_sha256"],
        created["endpoint"]["client_certificate"]["fingerprint_sha256"]
    );
    let both = json!({"client_certificate": pki.client.cert, "client_key": pki.client.key, "clear_client_certificate": true});
    let (status, body) = rest.call(reqwest::Method::PATCH, &path, Some(both)).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("invalid_client_certificate")), "{body}");
    assert_eq!(rest.get("/v1/webhooks").await?["endpoints"].as_array().map(Vec::len), Some(1));
    // Sealed at rest: the key's PEM is nowhere in the row.
    let pg = stack.pg().await?;
    let row: String = sqlx::query_scalar("SELECT row_to_json(e)::text FROM webhook_endpoints e").fetch_one(&pg).await?;
    assert!(!row.contains("PRIVATE KEY") && !row.contains("PRIVATE"), "stored sealed");
    pg.close().await;
    Ok(())
}
