//! Issue 27, point 6: the portal edits how Relay authenticates to the
//! receiver, in headless Chromium. A client certificate, its key and a
//! pinned CA pasted into the endpoint page reach a receiver that requires
//! them; a key that does not match is named on the page and never echoed; a
//! new certificate the receiver does not trust yet shows its overlap and
//! still delivers; OAuth2 changes ask for the secret again; removing
//! everything leaves the signature alone.

use std::time::Duration;

use fantoccini::{Locator, elements::Element};
use relay_tests::{Browser, Options, Receiver, Rest, Stack, TestPki};
use serde_json::json;

use crate::portal::mint;

/// Fills the authentication form's named fields (emptying each first) and
/// submits it; the page it lands on.
async fn submit_auth(browser: &Browser, fields: &[(&str, &str)], ticks: &[&str]) -> anyhow::Result<String> {
    let c = &browser.client;
    let e = |what: String| move |err: fantoccini::error::CmdError| anyhow::anyhow!("{what}: {err}");
    let form = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("form#receiver-auth-form"))
        .await
        .map_err(e("the form".into()))?;
    for (name, value) in fields {
        let field: Element = form.find(Locator::Css(&format!("[name={name}]"))).await.map_err(e(format!("field {name}")))?;
        field.clear().await.map_err(e(format!("clearing {name}")))?;
        if !value.is_empty() {
            field.send_keys(value).await.map_err(e(format!("typing {name}")))?;
        }
    }
    for name in ticks {
        form.find(Locator::Css(&format!("input[name={name}]")))
            .await
            .map_err(e(format!("box {name}")))?
            .click()
            .await
            .map_err(e(format!("ticking {name}")))?;
    }
    form.find(Locator::Css("button[type=submit]")).await.map_err(e("submit".into()))?.click().await.map_err(e("submit".into()))?;
    // The submitted page's form goes stale when the answer replaces it; only
    // then is the page read (the old page has the same elements).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while form.text().await.is_ok() {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the form was not answered within 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.wait().at_most(Duration::from_secs(10)).for_element(Locator::Css("dd#receiver-auth")).await.map_err(e("the page after".into()))?;
    c.source().await.map_err(e("source".into()))
}

async fn text(browser: &Browser, css: &str) -> anyhow::Result<String> {
    let el = browser.client.find(Locator::Css(css)).await.map_err(|e| anyhow::anyhow!("{css}: {e}"))?;
    el.text().await.map_err(|e| anyhow::anyhow!("{css}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_a_client_certificate_a_pinned_ca_and_oauth2_are_set_rotated_and_removed() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("portal-auth").await?;
    let pki = TestPki::new()?;
    let receiver = Receiver::start_tls(pki.server_config(true)?).await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (id, _) = rest.endpoint(&receiver.url("/m"), &["tls"]).await?;
    let browser = Browser::start().await?;
    let c = &browser.client;
    c.goto(&mint(&rest).await?).await.map_err(|e| anyhow::anyhow!("opening the link: {e}"))?;
    c.wait().at_most(Duration::from_secs(10)).for_element(Locator::Css("a.button.primary")).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let page = format!("{}/portal/endpoints/{id}", stack.rest_url);
    c.goto(&page).await.map_err(|e| anyhow::anyhow!("the endpoint page: {e}"))?;
    assert_eq!(text(&browser, "dd#receiver-auth").await?, "signature");

    // A key that is not the certificate's: named on the page, never echoed.
    let source = submit_auth(&browser, &[("client_certificate", &pki.client.cert), ("client_key", &pki.stranger.key)], &[]).await?;
    let error = text(&browser, "p.error").await?;
    assert!(error.contains("client_key does not match client_certificate"), "{error}");
    let key_body = pki.stranger.key.lines().nth(1).unwrap_or("unreachable");
    assert!(!source.contains(key_body), "a key typed in is not shown back");
    assert!(rest.get(&format!("/v1/webhooks/{id}")).await?["client_certificate"].is_null(), "nothing stored");

    // The right pair and the receiver's CA: delivered over mutual TLS.
    c.goto(&page).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    submit_auth(&browser, &[("client_certificate", &pki.client.cert), ("client_key", &pki.client.key), ("ca_bundle", &pki.ca)], &[])
        .await?;
    let summary = text(&browser, "dd#receiver-auth").await?;
    assert!(summary.contains("client certificate CN=acme-dispatch") && summary.contains("pinned CA"), "{summary}");
    browser.screenshot("auth-01-client-certificate").await?;
    let read = rest.get(&format!("/v1/webhooks/{id}")).await?;
    let trusted = read["client_certificate"]["fingerprint_sha256"].as_str().unwrap_or_default().to_owned();
    assert_eq!(read["ca_bundle"].as_str().map(str::trim), Some(pki.ca.trim()), "{read}");
    let first = rest.publish("tls", json!({"n": 1})).await?;
    let got = receiver.wait_for_event(&first, Duration::from_secs(20)).await.expect("delivered over mutual TLS");
    assert_eq!(got.client_certificate.as_deref(), Some(trusted.as_str()));

    // A certificate the receiver does not trust yet: the page shows the
    // overlap, and the previous certificate still gets the webhook through.
    submit_auth(&browser, &[("client_certificate", &pki.stranger.cert), ("client_key", &pki.stranger.key)], &[]).await?;
    let previous = text(&browser, "dd#previous-certificate").await?;
    assert!(previous.contains("CN=acme-dispatch") && previous.contains("presented when the new one is refused until"), "{previous}");
    let second = rest.publish("tls", json!({"n": 2})).await?;
    let got = receiver.wait_for_event(&second, Duration::from_secs(20)).await.expect("delivered with the previous certificate");
    assert_eq!(got.client_certificate.as_deref(), Some(trusted.as_str()));

    // OAuth2: a change without the secret is refused by name; with it, stored
    // (and shown without the secret).
    let refused = submit_auth(&browser, &[("token_url", "https://127.0.0.1:9/token"), ("client_id", "relay")], &[]).await?;
    assert!(text(&browser, "p.error").await?.contains("enter the client secret too"), "{refused}");
    c.goto(&page).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let secret = "s3cret-never-shown";
    let saved = submit_auth(
        &browser,
        &[("token_url", "https://127.0.0.1:9/token"), ("client_id", "relay"), ("client_secret", secret), ("scope", "hooks")],
        &[],
    )
    .await?;
    assert!(text(&browser, "dd#receiver-auth").await?.contains("OAuth2 client relay at https://127.0.0.1:9/token"));
    assert!(!saved.contains(secret), "the client secret is never shown");
    assert_eq!(rest.get(&format!("/v1/webhooks/{id}")).await?["oauth2"]["scope"], "hooks");

    // Everything removed: the signature alone, the bundle emptied.
    submit_auth(&browser, &[("ca_bundle", "")], &["clear_client_certificate", "clear_oauth2"]).await?;
    assert_eq!(text(&browser, "dd#receiver-auth").await?, "signature");
    let read = rest.get(&format!("/v1/webhooks/{id}")).await?;
    assert!(read["client_certificate"].is_null() && read["previous_client_certificate"].is_null() && read["oauth2"].is_null(), "{read}");
    assert!(read.get("ca_bundle").is_none_or(|b| b.as_str() == Some("")), "{read}");
    browser.screenshot("auth-02-removed").await?;
    stack.stop().await
}
