//! The portal (issue 15), over HTTP: links minted with an API key, used
//! once, exchanged for a session cookie scoped to one environment; pages
//! under a CSP that allows no script, with every tenant string escaped.

use std::time::Duration;

use relay_tests::{Options, PortalVisitor, Receiver, Reply, Rest, Stack, eventually};
use reqwest::{Method, header};
use serde_json::json;

/// A client that follows no redirect and keeps no cookies: the test reads
/// and sends the session cookie itself.
pub(crate) fn browser() -> reqwest::Client {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("a client")
}

pub(crate) async fn mint(rest: &Rest) -> anyhow::Result<String> {
    let (status, body) = rest.post("/v1/portal-sessions", json!({})).await?;
    anyhow::ensure!(status == 201, "minting a portal link answered {status}: {body}");
    Ok(body["url"].as_str().expect("a url").to_owned())
}

/// Opens a link; the session cookie's value.
pub(crate) async fn enter(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let resp = http.get(url).send().await?;
    anyhow::ensure!(resp.status() == 200, "opening the link answered {}", resp.status());
    let cookie = resp.headers().get(header::SET_COOKIE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let value = cookie.split(';').next().and_then(|kv| kv.strip_prefix("relay_portal=")).unwrap_or_default().to_owned();
    anyhow::ensure!(!value.is_empty(), "no session cookie: {cookie:?}");
    Ok(value)
}

pub(crate) async fn page(http: &reqwest::Client, url: String, session: Option<&str>) -> anyhow::Result<(u16, header::HeaderMap, String)> {
    let mut req = http.get(url);
    if let Some(s) = session {
        req = req.header(header::COOKIE, format!("relay_portal={s}"));
    }
    let resp = req.send().await?;
    Ok((resp.status().as_u16(), resp.headers().clone(), resp.text().await?))
}

pub(crate) const CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

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
    // One script element: the portal's own file (the CSP allows no other).
    assert_eq!(body.matches("<script").count(), 1, "{body}");
    assert!(body.contains(r#"<script src="/portal/assets/portal.js" defer></script>"#));
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

/// Every form that changes something refuses a missing or wrong CSRF token
/// (and changes nothing); bad filters and ids get a page naming the
/// mistake; tenant strings on the event pages stay text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_portal_form_needs_its_csrf_token_and_bad_input_is_named_on_the_page() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0").circuit_off()).await?;
    let tenant = stack.tenant("portal-forms").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/fails", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let hostile_type = "<img/src=x/onerror=alert(1)>";
    let (ep, _) = rest.endpoint(&receiver.url("/fails"), &[hostile_type]).await?;
    let hostile_payload = json!({"note": "</pre><script>alert(1)</script>"});
    let ev = rest.publish(hostile_type, hostile_payload).await?;
    let portal = PortalVisitor::enter(&stack.rest_url, &tenant.api_key).await?;
    let dl = eventually(Duration::from_secs(20), || async {
        let l = rest.get("/v1/dead-letters").await.ok()?;
        l["dead_letters"][0]["id"].as_str().map(str::to_owned)
    })
    .await
    .expect("a dead letter");

    let url = receiver.url("/other");
    let forms = [
        "/portal/endpoints".to_owned(),
        format!("/portal/endpoints/{ep}"),
        format!("/portal/endpoints/{ep}/rotate"),
        format!("/portal/endpoints/{ep}/disable"),
        format!("/portal/endpoints/{ep}/enable"),
        format!("/portal/endpoints/{ep}/recover"),
        format!("/portal/endpoints/{ep}/delete"),
        format!("/portal/dead-letters/{dl}/replay"),
        "/portal/logout".to_owned(),
    ];
    for path in &forms {
        for csrf in [None, Some("forged")] {
            let mut form = vec![("url", url.as_str()), ("event_types", "x.y")];
            if let Some(c) = csrf {
                form.push(("csrf", c));
            }
            let (status, _, page) = portal.post(path, &form).await?;
            assert_eq!(status, 403, "POST {path} with csrf {csrf:?}: {page}");
        }
    }
    // Nothing changed: one endpoint, enabled, its URL and secret as before,
    // the dead letter still dead, the session alive.
    let endpoints = rest.get("/v1/webhooks").await?;
    let listed = endpoints["endpoints"].as_array().expect("a list");
    assert_eq!(listed.len(), 1, "{endpoints}");
    assert_eq!(listed[0]["enabled"].as_bool(), Some(true));
    assert!(listed[0]["url"].as_str().is_some_and(|u| u.ends_with("/fails")) && listed[0]["secret_rotated_at"].is_null(), "{endpoints}");
    assert_eq!(rest.deliveries(&ev).await?[0]["state"].as_str(), Some("DELIVERY_STATE_DEAD"));
    assert_eq!(portal.get("/portal/").await?.0, 200);

    // Bad input: a page that names the mistake and the value.
    for (path, want) in [
        ("/portal/events?since=yesterday", "since must be a time like 2026-12-01T14:30 (UTC), got \"yesterday\""),
        ("/portal/events?until=2026-13-01T00:00", "until must be a time"),
        ("/portal/events?id=not-an-id", "an event id is a UUID"),
        ("/portal/events?before=1~nope", "the page cursor is not one this portal wrote"),
    ] {
        let (status, page) = portal.get(path).await?;
        assert_eq!(status, 400, "{path}: {page}");
        assert!(page.replace("&#34;", "\"").contains(want), "{path}: {want} not in {page}");
    }
    let (status, _) = portal.get("/portal/events/not-a-uuid").await?;
    assert_eq!(status, 404);
    let (status, page) = portal.get(&format!("/portal/events/{}", uuid::Uuid::new_v4())).await?;
    assert_eq!(status, 404, "{page}");
    let (status, _, page) =
        portal.post("/portal/endpoints", &[("csrf", &portal.csrf), ("url", "ftp://example.com/x"), ("event_types", "a")]).await?;
    assert_eq!(status, 400, "{page}");
    assert!(page.contains("class=\"error\"") && page.contains("ftp"), "the rejection is on the form: {page}");
    let (status, _, page) =
        portal.post(&format!("/portal/endpoints/{ep}"), &[("csrf", &portal.csrf), ("url", &url), ("event_types", " , ")]).await?;
    assert_eq!(status, 400, "{page}");
    assert!(page.contains("at least one event type"), "{page}");
    // A search by id goes to the event; the event pages keep tenant strings as text.
    let (status, location, _) = portal.open(&format!("/portal/events?id={ev}")).await?;
    assert_eq!((status, location.as_deref()), (303, Some(format!("/portal/events/{ev}").as_str())));
    for path in
        [format!("/portal/events/{ev}"), "/portal/events".to_owned(), "/portal/dead-letters".to_owned(), format!("/portal/endpoints/{ep}")]
    {
        let (status, page) = portal.get(&path).await?;
        assert_eq!(status, 200, "{path}: {page}");
        assert!(!page.contains(hostile_type) && !page.contains("<script>alert"), "{path} carries a raw tenant string: {page}");
        assert_eq!(page.matches("<script").count(), 1, "{path}: only the portal's own script");
    }
    let (_, event_page) = portal.get(&format!("/portal/events/{ev}")).await?;
    assert!(event_page.contains("&#60;/pre&#62;&#60;script&#62;alert(1)&#60;/script&#62;"), "the payload is shown, escaped: {event_page}");
    assert!(event_page.contains("HTTP 500"), "the attempt timeline shows the failure: {event_page}");
    // The filter by type finds the event; another type finds nothing.
    let (_, found) = portal.get(&format!("/portal/events?type={}", url_escape(hostile_type))).await?;
    assert!(found.contains(&ev), "{found}");
    let (_, none) = portal.get("/portal/events?type=nothing.here").await?;
    assert!(!none.contains(&ev) && none.contains("No events match these filters"), "{none}");
    let since = (chrono::Utc::now() + chrono::TimeDelta::minutes(5)).format("%Y-%m-%dT%H:%M").to_string();
    let (_, later) = portal.get(&format!("/portal/events?since={since}")).await?;
    assert!(!later.contains(&ev), "an event before the range shows: {later}");
    stack.stop().await
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}
