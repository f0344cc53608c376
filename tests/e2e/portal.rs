//! The portal (issue 15), over HTTP: links minted with an API key, used
//! once, exchanged for a session cookie scoped to one environment; pages
//! under a CSP that allows no script, with every tenant string escaped.

use std::time::Duration;

use fantoccini::{Locator, elements::Element};
use relay_tests::{Browser, Options, PortalVisitor, Receiver, Reply, Rest, Stack, eventually};
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

const CSP: &str =
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

async fn text_of(el: &Element) -> anyhow::Result<String> {
    el.text().await.map_err(|e| anyhow::anyhow!("reading text: {e}"))
}

/// Reloads `path` until an element matches `css` (bounded); its text.
async fn wait_for_text(browser: &Browser, url: &str, css: &str, want: &str, within: Duration) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + within;
    let mut last = String::new();
    loop {
        browser.client.goto(url).await.map_err(|e| anyhow::anyhow!("goto {url}: {e}"))?;
        if let Ok(found) = browser.client.find_all(Locator::Css(css)).await {
            for el in found {
                last = text_of(&el).await?;
                if last.contains(want) {
                    return Ok(last);
                }
            }
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{css} on {url} never said {want:?} (last: {last:?})");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The issue's walk, in headless Chromium: a link opens the portal; an
/// endpoint is created in the page (its secret shown once, with a working
/// copy button); an event published through REST is seen delivered (200)
/// and its signature verifies with that secret; the receiver fails, the
/// dead letter shows, is replayed from the page and is delivered; the
/// charts draw the attempts; hostile strings render inert; signing out
/// ends the session. Screenshots of each page are saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_an_endpoint_is_created_a_delivery_seen_a_dead_letter_replayed_and_hostile_strings_stay_text() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0,50,50").circuit_off()).await?;
    let tenant = stack.tenant("portal-browser").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let browser = Browser::start().await?;
    let c = &browser.client;
    let e = |what: &'static str| move |err: fantoccini::error::CmdError| anyhow::anyhow!("{what}: {err}");

    // The link: the page moves on to the portal by itself, signed in.
    let link = mint(&rest).await?;
    c.goto(&link).await.map_err(e("opening the link"))?;
    let heading =
        c.wait().at_most(Duration::from_secs(10)).for_element(Locator::Css("a.button.primary")).await.map_err(e("the endpoints page"))?;
    assert_eq!(text_of(&heading).await?, "Add endpoint");
    assert_eq!(c.current_url().await.map_err(e("url"))?.path(), "/portal/");
    let cookie = c.get_named_cookie("relay_portal").await.map_err(e("the session cookie"))?;
    assert_eq!((cookie.http_only(), format!("{:?}", cookie.same_site())), (Some(true), "Some(Strict)".to_owned()));
    assert_eq!(cookie.path(), Some("/portal"));
    // The CSP as the browser got it, read with the browser's own cookie.
    let headers = browser_get(&stack.rest_url, "/portal/", cookie.value()).await?;
    assert_eq!(headers.get(header::CONTENT_SECURITY_POLICY).and_then(|v| v.to_str().ok()), Some(CSP));
    browser.screenshot("01-endpoints-empty").await?;

    // Create an endpoint with a hostile event type.
    let hostile_type = "<img/src=x/onerror=alert(1)>";
    heading.click().await.map_err(e("add endpoint"))?;
    let form = c.wait().for_element(Locator::Css("form#create-endpoint")).await.map_err(e("the form"))?;
    form.find(Locator::Css("input[name=url]")).await.map_err(e("url"))?.send_keys(&receiver.url("/hook")).await.map_err(e("typing"))?;
    form.find(Locator::Css("textarea[name=event_types]"))
        .await
        .map_err(e("types"))?
        .send_keys(&format!("order.paid\n{hostile_type}"))
        .await
        .map_err(e("typing"))?;
    browser.screenshot("02-endpoint-new").await?;
    form.find(Locator::Css("button[type=submit]")).await.map_err(e("submit"))?.click().await.map_err(e("submit"))?;
    let secret_field = c.wait().for_element(Locator::Css("input#secret")).await.map_err(e("the secret page"))?;
    let secret = secret_field.prop("value").await.map_err(e("secret"))?.unwrap_or_default();
    assert!(secret.starts_with("whsec_") && secret.len() > 40, "{secret:?}");
    // The copy button is the script's: shown only when the script ran.
    let copy = c.find(Locator::Css("button.copy")).await.map_err(e("copy"))?;
    assert!(copy.is_displayed().await.map_err(e("copy shown"))?, "the portal's script did not run under its CSP");
    copy.click().await.map_err(e("copy"))?;
    browser.screenshot("03-secret-shown-once").await?;
    c.find(Locator::Css("a.button")).await.map_err(e("continue"))?.click().await.map_err(e("continue"))?;
    c.wait().for_element(Locator::Css("form#edit-endpoint")).await.map_err(e("the endpoint page"))?;
    let endpoint_url = c.current_url().await.map_err(e("url"))?.to_string();
    let source = c.source().await.map_err(e("source"))?;
    assert!(!source.contains(&secret), "the secret is shown once only");
    // The hostile type is text: no image element anywhere, the tag shows it verbatim.
    assert!(c.find_all(Locator::Css("img")).await.map_err(e("img"))?.is_empty(), "a tenant string became markup");
    let tags: Vec<String> = futures::future::try_join_all(
        c.find_all(Locator::Css("dl.facts .tag")).await.map_err(e("tags"))?.iter().map(|t| async move { text_of(t).await }),
    )
    .await?;
    assert!(tags.contains(&hostile_type.to_owned()) && tags.contains(&"order.paid".to_owned()), "{tags:?}");
    let endpoint_id = endpoint_url.rsplit('/').next().unwrap_or_default().to_owned();
    let listed = rest.get(&format!("/v1/webhooks/{endpoint_id}")).await?;
    assert_eq!(listed["url"].as_str(), Some(receiver.url("/hook").as_str()), "created through the page: {listed}");

    // An event through REST, delivered with status 200, signed with that secret.
    let payload = json!({"order": 42, "note": "</pre><script>alert(1)</script>"});
    let first = rest.publish("order.paid", payload).await?;
    let event_url = format!("{}/portal/events/{first}", stack.rest_url);
    let state = wait_for_text(&browser, &event_url, ".delivery-state", "delivered", Duration::from_secs(20)).await?;
    assert_eq!(state, "delivered");
    assert_eq!(text_of(&c.find(Locator::Css(".attempt-outcome")).await.map_err(e("outcome"))?).await?, "HTTP 200");
    let got = receiver.wait_at("/hook", 1, Duration::from_secs(5)).await;
    let ts = got[0].header("relay-webhook-timestamp");
    assert!(got[0].header("relay-webhook-signature").contains(&relay_tests::contract_signature(&secret, &ts, &got[0].body)));
    // The payload shows as sent, its markup as text.
    let shown = text_of(&c.find(Locator::Css("pre.payload")).await.map_err(e("payload"))?).await?;
    assert!(shown.contains("</pre><script>alert(1)</script>") && shown.contains(&first), "{shown}");
    let scripts = c.find_all(Locator::Css("script")).await.map_err(e("scripts"))?;
    assert_eq!(scripts.len(), 1, "only the portal's own script element");
    browser.screenshot("04-event-delivered").await?;

    // The event log lists it; a filter by another type does not.
    c.goto(&format!("{}/portal/events", stack.rest_url)).await.map_err(e("events"))?;
    c.find(Locator::Css(&format!("tr[data-event-id='{first}']"))).await.map_err(e("the event's row"))?;
    browser.screenshot("05-events").await?;
    // A hostile endpoint URL (registered through REST) renders inert on the
    // list: no element made of it, its text as stored.
    let hostile_url = format!("{}?q='><img src=x onerror=alert(1)>&r=\"x\"", receiver.url("/odd"));
    let (status, odd) = rest.call(reqwest::Method::POST, "/v1/webhooks", Some(json!({"url": hostile_url, "event_types": ["odd"]}))).await?;
    assert_eq!(status, 201, "{odd}");
    let stored = odd["endpoint"]["url"].as_str().expect("a url").to_owned();
    c.goto(&format!("{}/portal/", stack.rest_url)).await.map_err(e("endpoints"))?;
    let odd_id = odd["endpoint"]["id"].as_str().expect("an id").to_owned();
    let cell = c.find(Locator::Css(&format!("tr[data-endpoint-id='{odd_id}'] td.url code"))).await.map_err(e("the odd row"))?;
    assert_eq!(text_of(&cell).await?, stored);
    assert!(c.find_all(Locator::Css("img")).await.map_err(e("img"))?.is_empty(), "a tenant URL became markup");
    assert!(c.get_alert_text().await.is_err(), "no script ran");
    let (status, _) = rest.call(reqwest::Method::DELETE, &format!("/v1/webhooks/{odd_id}"), None).await?;
    assert_eq!(status, 204);
    c.goto(&format!("{}/portal/events", stack.rest_url)).await.map_err(e("events"))?;
    let filters = c.find(Locator::Css("form#event-filters")).await.map_err(e("filters"))?;
    filters.find(Locator::Css("input[name=type]")).await.map_err(e("type"))?.send_keys("invoice.sent").await.map_err(e("typing"))?;
    filters.find(Locator::Css("button[type=submit]")).await.map_err(e("filter"))?.click().await.map_err(e("filter"))?;
    c.wait().for_element(Locator::Css("p.empty")).await.map_err(e("an empty, filtered log"))?;
    assert!(c.find_all(Locator::Css("tr[data-event-id]")).await.map_err(e("rows"))?.is_empty());

    // The receiver fails: the dead letter shows; replayed from the page once
    // it answers again, it is delivered.
    receiver.reply("/hook", Reply::Status(503));
    let second = rest.publish("order.paid", json!({"order": 43})).await?;
    let letters = format!("{}/portal/dead-letters", stack.rest_url);
    wait_for_text(&browser, &letters, &format!("tr[data-event-id='{second}']"), "HTTP 503", Duration::from_secs(20)).await?;
    browser.screenshot("06-dead-letters").await?;
    let failed =
        wait_for_text(&browser, &format!("{}/portal/events/{second}", stack.rest_url), ".delivery-state", "failed", Duration::from_secs(5))
            .await?;
    assert_eq!(failed, "failed: dead letter");
    assert_eq!(c.find_all(Locator::Css("li.attempt")).await.map_err(e("attempts"))?.len(), 3, "three attempts on the timeline");
    browser.screenshot("07-event-dead").await?;
    receiver.reply("/hook", Reply::Status(200));
    c.goto(&letters).await.map_err(e("dead letters"))?;
    c.find(Locator::Css(&format!("tr[data-event-id='{second}'] form.replay button")))
        .await
        .map_err(e("replay"))?
        .click()
        .await
        .map_err(e("replay"))?;
    c.wait().for_element(Locator::Css(".delivery-state")).await.map_err(e("the event page after a replay"))?;
    assert_eq!(c.current_url().await.map_err(e("url"))?.path(), format!("/portal/events/{second}"));
    let replayed = wait_for_text(
        &browser,
        &format!("{}/portal/events/{second}", stack.rest_url),
        ".delivery-state",
        "delivered",
        Duration::from_secs(20),
    )
    .await?;
    assert_eq!(replayed, "delivered");
    let newest = text_of(&c.find(Locator::Css("li.attempt")).await.map_err(e("newest attempt"))?).await?;
    assert!(newest.contains("replay 1") && newest.contains("HTTP 200"), "{newest}");
    assert_eq!(receiver.at("/hook").iter().filter(|r| r.json()["id"] == second.as_str()).count(), 4, "three failures and the replay");
    browser.screenshot("08-event-replayed").await?;

    // The charts: the attempts of the last minutes, drawn (sums are written every 5 s).
    let totals = wait_for_text(&browser, &endpoint_url, "p.totals", "5 attempts", Duration::from_secs(20)).await?;
    assert!(totals.starts_with("5 attempts · success 40.0 % · p50 "), "{totals}");
    assert!(!c.find_all(Locator::Css("svg rect.bucket")).await.map_err(e("bars"))?.is_empty(), "the success chart draws the attempts");
    assert_eq!(c.find_all(Locator::Css("svg path.p50")).await.map_err(e("p50"))?.len(), 1);
    assert_eq!(c.find_all(Locator::Css("svg path.p99")).await.map_err(e("p99"))?.len(), 1);
    browser.screenshot("09-endpoint-charts").await?;

    // The dead letter now says it was replayed, and offers no second replay.
    c.goto(&letters).await.map_err(e("dead letters"))?;
    let row = c.find(Locator::Css(&format!("tr[data-event-id='{second}']"))).await.map_err(e("the row"))?;
    assert_eq!(text_of(&row.find(Locator::Css(".replayed")).await.map_err(e("replayed"))?).await?, "replayed");
    assert!(row.find_all(Locator::Css("form.replay")).await.map_err(e("forms"))?.is_empty());

    // Edit, rotate, disable, enable, delete — each through its form.
    c.goto(&endpoint_url).await.map_err(e("the endpoint"))?;
    let types = c.find(Locator::Css("form#edit-endpoint textarea[name=event_types]")).await.map_err(e("types"))?;
    types.send_keys("\ninvoice.sent").await.map_err(e("typing"))?;
    c.find(Locator::Css("form#edit-endpoint button[type=submit]")).await.map_err(e("save"))?.click().await.map_err(e("save"))?;
    let notice = c.wait().for_element(Locator::Css("p.notice")).await.map_err(e("saved"))?;
    assert_eq!(text_of(&notice).await?, "Saved.");
    let after = rest.get(&format!("/v1/webhooks/{endpoint_id}")).await?;
    assert_eq!(after["event_types"], json!(["order.paid", hostile_type, "invoice.sent"]), "{after}");
    c.find(Locator::Css("form#rotate-secret button")).await.map_err(e("rotate"))?.click().await.map_err(e("rotate"))?;
    let rotated = c.wait().for_element(Locator::Css("input#secret")).await.map_err(e("the rotated secret"))?;
    let new_secret = rotated.prop("value").await.map_err(e("secret"))?.unwrap_or_default();
    assert!(new_secret.starts_with("whsec_") && new_secret != secret, "{new_secret:?}");
    c.goto(&endpoint_url).await.map_err(e("the endpoint"))?;
    assert!(!c.source().await.map_err(e("source"))?.contains(&new_secret), "a rotated secret is shown once only");
    c.find(Locator::Css("form#disable-endpoint button")).await.map_err(e("disable"))?.click().await.map_err(e("disable"))?;
    c.wait().for_element(Locator::Css("form#enable-endpoint")).await.map_err(e("disabled"))?;
    assert_eq!(text_of(&c.find(Locator::Css("#endpoint-status")).await.map_err(e("status"))?).await?, "disabled");
    c.find(Locator::Css("form#enable-endpoint button")).await.map_err(e("enable"))?.click().await.map_err(e("enable"))?;
    c.wait().for_element(Locator::Css("form#disable-endpoint")).await.map_err(e("enabled"))?;
    assert_eq!(text_of(&c.find(Locator::Css("#endpoint-status")).await.map_err(e("status"))?).await?, "active");
    // Deleting asks first (the portal's script): dismissed, nothing happens.
    c.find(Locator::Css("form#delete-endpoint button")).await.map_err(e("delete"))?.click().await.map_err(e("delete"))?;
    assert!(c.get_alert_text().await.map_err(e("the confirmation"))?.starts_with("Delete this endpoint?"));
    c.dismiss_alert().await.map_err(e("dismiss"))?;
    assert_eq!(rest.get(&format!("/v1/webhooks/{endpoint_id}")).await?["id"].as_str(), Some(endpoint_id.as_str()));
    c.find(Locator::Css("form#delete-endpoint button")).await.map_err(e("delete"))?.click().await.map_err(e("delete"))?;
    c.accept_alert().await.map_err(e("accept"))?;
    c.wait().for_element(Locator::Css("p.empty")).await.map_err(e("the list without it"))?;
    let (status, _) = rest.call(reqwest::Method::GET, &format!("/v1/webhooks/{endpoint_id}"), None).await?;
    assert_eq!(status, 404, "deleted through the page");

    // Signing out ends it.
    c.find(Locator::Css("form.inline button")).await.map_err(e("sign out"))?.click().await.map_err(e("sign out"))?;
    let h1 = c.wait().for_element(Locator::Css("h1")).await.map_err(e("signed out"))?;
    assert_eq!(text_of(&h1).await?, "Signed out");
    c.goto(&format!("{}/portal/", stack.rest_url)).await.map_err(e("after sign-out"))?;
    let h1 = c.find(Locator::Css("h1")).await.map_err(e("ended"))?;
    assert_eq!(text_of(&h1).await?, "Your session has ended");
    browser.close().await?;
    stack.stop().await
}

async fn browser_get(base: &str, path: &str, cookie: &str) -> anyhow::Result<header::HeaderMap> {
    let resp = reqwest::Client::new().get(format!("{base}{path}")).header(header::COOKIE, format!("relay_portal={cookie}")).send().await?;
    anyhow::ensure!(resp.status() == 200, "{path} answered {}", resp.status());
    Ok(resp.headers().clone())
}

/// The portal tells a receiver that fails sometimes (its retries get
/// through) from one that is down: only the second is shown as down, with
/// its deliveries held; the first is active, with its recent failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portal_tells_a_receiver_whose_retries_succeed_from_one_that_is_down() -> anyhow::Result<()> {
    use relay_tests::flaky::{Behaviour, Flaky};
    let stack = Stack::start(Options::default().probes(Duration::from_secs(30), Duration::from_secs(30))).await?;
    let tenant = stack.tenant("truth").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/not-ready", Reply::Flaky(Flaky::new(Behaviour::FailFirst(503))));
    receiver.reply("/down", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (not_ready, _) = rest.endpoint(&receiver.url("/not-ready"), &["t"]).await?;
    let (down, _) = rest.endpoint(&receiver.url("/down"), &["t"]).await?;
    let mut opened = false;
    for n in 0..200 {
        rest.publish("t", json!({"n": n})).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if rest.get(&format!("/v1/webhooks/{down}")).await?["health"]["state"] == "open" {
            opened = true;
            break;
        }
    }
    assert!(opened, "the endpoint that is down opened");
    let ep = rest.get(&format!("/v1/webhooks/{not_ready}")).await?;
    assert_eq!(ep["health"]["state"], "closed", "{ep}");

    let http = browser();
    let session = enter(&http, &mint(&rest).await?).await?;
    let (status, _, html) = page(&http, format!("{}/portal/endpoints/{not_ready}", stack.rest_url), Some(&session)).await?;
    assert_eq!(status, 200);
    assert!(html.contains(r#"id="endpoint-status">active<"#), "{html}");
    assert!(html.contains("Recent attempts") && html.contains("failed in the last 2 minutes"), "its failures are shown: {html}");
    assert!(!html.contains("Down since"), "{html}");
    let (_, _, html) = page(&http, format!("{}/portal/endpoints/{down}", stack.rest_url), Some(&session)).await?;
    assert!(html.contains(r#"id="endpoint-status">down: deliveries held<"#), "{html}");
    assert!(html.contains("Down since"), "{html}");
    let (_, _, list) = page(&http, format!("{}/portal/", stack.rest_url), Some(&session)).await?;
    assert_eq!(list.matches("down: deliveries held").count(), 1, "{list}");
    stack.stop().await
}
