//! The portal (issue 15), over HTTP: links minted with an API key, used
//! once, exchanged for a session cookie scoped to one environment; pages
//! under a CSP that allows no script, with every tenant string escaped.

use relay_tests::{Options, Receiver, Rest, Stack};
use reqwest::{Method, header};
use serde_json::json;

/// A client that follows no redirect and keeps no cookies: the test reads
/// and sends the session cookie itself.
fn browser() -> reqwest::Client {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("a client")
}

async fn mint(rest: &Rest) -> anyhow::Result<String> {
    let (status, body) = rest.post("/v1/portal-sessions", json!({})).await?;
    anyhow::ensure!(status == 201, "minting a portal link answered {status}: {body}");
    Ok(body["url"].as_str().expect("a url").to_owned())
}

/// Opens a link; the session cookie's value.
async fn enter(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let resp = http.get(url).send().await?;
    anyhow::ensure!(resp.status() == 200, "opening the link answered {}", resp.status());
    let cookie = resp.headers().get(header::SET_COOKIE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let value = cookie.split(';').next().and_then(|kv| kv.strip_prefix("relay_portal=")).unwrap_or_default().to_owned();
    anyhow::ensure!(!value.is_empty(), "no session cookie: {cookie:?}");
    Ok(value)
}

async fn page(http: &reqwest::Client, url: String, session: Option<&str>) -> anyhow::Result<(u16, header::HeaderMap, String)> {
    let mut req = http.get(url);
    if let Some(s) = session {
        req = req.header(header::COOKIE, format!("relay_portal={s}"));
    }
    let resp = req.send().await?;
    Ok((resp.status().as_u16(), resp.headers().clone(), resp.text().await?))
}

const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portal_link_opens_once_into_its_own_environment_with_every_string_escaped_and_no_script_allowed() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let (a, b) = (stack.tenant("portal-a").await?, stack.tenant("portal-b").await?);
    let receiver = Receiver::start().await?;
    let rest_a = Rest::new(&stack.rest_url, Some(&a.api_key));
    let rest_b = Rest::new(&stack.rest_url, Some(&b.api_key));
    let hostile_type = "<img/src=x/onerror=alert(1)>";
    let hostile_url = format!("{}?a='b'&c=\"d\"", receiver.url("/a"));
    let (status, created) =
        rest_a.call(Method::POST, "/v1/webhooks", Some(json!({"url": hostile_url, "event_types": [hostile_type, "order.paid"]}))).await?;
    assert_eq!(status, 201, "{created}");
    let secret = created["secret"].as_str().expect("a secret").to_owned();
    rest_b.endpoint(&receiver.url("/b-only"), &["b.event"]).await?;

    // Minting: with an API key only, a link under the public address.
    let (status, _) = Rest::new(&stack.rest_url, None).post("/v1/portal-sessions", json!({})).await?;
    assert_eq!(status, 401, "a link needs an API key");
    let (status, body) = rest_a.post("/v1/portal-sessions", json!({})).await?;
    assert_eq!(status, 201, "{body}");
    let link = body["url"].as_str().expect("a url").to_owned();
    assert!(link.starts_with(&format!("{}/portal/enter?token=", stack.rest_url)), "{link}");
    let expires = chrono::DateTime::parse_from_rfc3339(body["expires_at"].as_str().expect("expires_at"))?;
    let left = expires.signed_duration_since(chrono::Utc::now()).num_seconds();
    assert!((540..=600).contains(&left), "a link lasts ten minutes: {left} s left");

    // No session yet: nothing to see, and the refusal has the portal's headers.
    let http = browser();
    let (status, headers, _) = page(&http, format!("{}/portal/", stack.rest_url), None).await?;
    assert_eq!(status, 401);
    assert_eq!(headers.get(header::CONTENT_SECURITY_POLICY).and_then(|v| v.to_str().ok()), Some(CSP));

    // The link: a session cookie, HttpOnly, SameSite=Strict, for /portal,
    // not Secure on the dev stack's http; then on to the portal.
    let resp = http.get(&link).send().await?;
    assert_eq!(resp.status(), 200);
    let h = resp.headers().clone();
    let cookie = h.get(header::SET_COOKIE).and_then(|v| v.to_str().ok()).expect("a cookie").to_owned();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/portal", "Max-Age="] {
        assert!(cookie.contains(attr), "{attr} missing from {cookie}");
    }
    assert!(!cookie.contains("Secure"), "an http dev stack cannot keep a Secure cookie: {cookie}");
    assert_eq!(h.get(header::REFRESH).and_then(|v| v.to_str().ok()), Some("0; url=/portal/"));
    for (name, want) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    ] {
        assert_eq!(h.get(&name).and_then(|v| v.to_str().ok()), Some(want), "{name}");
    }
    let session_a = cookie.split(';').next().and_then(|kv| kv.strip_prefix("relay_portal=")).expect("a value").to_owned();
    // Once only.
    let again = http.get(&link).send().await?;
    assert_eq!(again.status(), 403, "a link works once");
    assert!(again.headers().get(header::SET_COOKIE).is_none());

    // The page: A's endpoint, its hostile strings inert, no secret, no script.
    let (status, headers, body) = page(&http, format!("{}/portal/", stack.rest_url), Some(&session_a)).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers.get(header::CONTENT_SECURITY_POLICY).and_then(|v| v.to_str().ok()), Some(CSP));
    // Escaped as character references (the template engine writes &#60;).
    let escaped =
        |raw: &str| raw.replace('&', "&#38;").replace('<', "&#60;").replace('>', "&#62;").replace('"', "&#34;").replace('\'', "&#39;");
    assert!(body.contains(&escaped(hostile_type)), "the event type is escaped: {body}");
    assert!(!body.contains(hostile_type), "the raw event type reached the page");
    // The URL as stored (its quotes percent-encoded when it was parsed), its & escaped.
    let stored = created["endpoint"]["url"].as_str().expect("a url").to_owned();
    assert!(stored.contains('&') && body.contains(&escaped(&stored)), "the URL is escaped: {stored} in {body}");
    assert!(!body.contains(&stored), "the raw URL reached the page");
    assert!(!body.contains("<script"), "no script on a portal page");
    assert!(!body.contains(&secret) && !body.contains(&a.api_key), "no secret or key on the page");
    assert!(!body.contains("/b-only"), "another environment's endpoint shows");
    assert!(body.contains("order.paid"));
    let css = http.get(format!("{}/portal/assets/portal.css", stack.rest_url)).send().await?;
    assert_eq!(
        (css.status().as_u16(), css.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok())),
        (200, Some("text/css; charset=utf-8"))
    );

    // B's session sees B's endpoint only, whatever it is pointed at.
    let session_b = enter(&http, &mint(&rest_b).await?).await?;
    let (_, _, body_b) = page(&http, format!("{}/portal/", stack.rest_url), Some(&session_b)).await?;
    assert!(body_b.contains("/b-only") && !body_b.contains("order.paid"), "{body_b}");
    // A forged or altered cookie is no session.
    let (status, _, _) = page(&http, format!("{}/portal/", stack.rest_url), Some(&format!("{}x", &session_a[..42]))).await?;
    assert_eq!(status, 401);

    // Signing out needs the form's CSRF token; then the session is gone.
    let csrf = body.split("name=\"csrf\" value=\"").nth(1).and_then(|r| r.split('"').next()).expect("a csrf field").to_owned();
    let logout = |form: Vec<(&'static str, String)>| {
        http.post(format!("{}/portal/logout", stack.rest_url))
            .header(header::COOKIE, format!("relay_portal={session_a}"))
            .form(&form)
            .send()
    };
    assert_eq!(logout(vec![]).await?.status(), 403, "no CSRF token");
    assert_eq!(logout(vec![("csrf", "forged".into())]).await?.status(), 403, "a wrong CSRF token");
    let out = logout(vec![("csrf", csrf)]).await?;
    assert_eq!(out.status(), 200);
    assert!(out.headers().get(header::SET_COOKIE).and_then(|v| v.to_str().ok()).is_some_and(|c| c.contains("Max-Age=0")));
    let (status, _, _) = page(&http, format!("{}/portal/", stack.rest_url), Some(&session_a)).await?;
    assert_eq!(status, 401, "signed out");

    // Expiry: a link past its ten minutes, a session past its hour.
    let pg = stack.pg().await?;
    let stale_link = mint(&rest_a).await?;
    sqlx::query("UPDATE portal_links SET expires_at = now() - interval '1 second' WHERE used_at IS NULL").execute(&pg).await?;
    assert_eq!(http.get(&stale_link).send().await?.status(), 403, "an expired link");
    sqlx::query("UPDATE portal_sessions SET expires_at = now() - interval '1 second'").execute(&pg).await?;
    let (status, _, _) = page(&http, format!("{}/portal/", stack.rest_url), Some(&session_b)).await?;
    assert_eq!(status, 401, "an expired session");
    // Only hashes are stored.
    let stored: Vec<Vec<u8>> = sqlx::query_scalar("SELECT token_hash FROM portal_sessions").fetch_all(&pg).await?;
    assert!(stored.iter().all(|h| h.len() == 32 && !String::from_utf8_lossy(h).contains(&session_b)));
    pg.close().await;
    stack.stop().await
}

/// The same mint over gRPC, the way a tenant's backend may call it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portal_link_is_minted_over_grpc_too() -> anyhow::Result<()> {
    use relay_contracts::relay::tenant::v1::{CreatePortalSessionRequest, portal_service_client::PortalServiceClient};
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("portal-grpc").await?;
    let mut grpc = PortalServiceClient::connect(stack.grpc_url.clone()).await?;
    let unauthenticated = grpc.create_portal_session(CreatePortalSessionRequest {}).await.expect_err("needs a key");
    assert_eq!(unauthenticated.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(CreatePortalSessionRequest {});
    req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
    let link = grpc.create_portal_session(req).await?.into_inner();
    assert!(link.url.contains("/portal/enter?token=") && link.expires_at.is_some(), "{:?}", link.expires_at);
    assert!(!format!("{link:?}").contains("token="), "Debug hides the link: {link:?}");
    enter(&browser(), &link.url).await?;
    stack.stop().await
}
