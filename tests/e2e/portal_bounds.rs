//! The portal's bounds (issue 25): a hostile query value is named on a 400
//! page and never reaches Postgres; a form's session is checked before a
//! byte of its body is read, its declared length is judged from the header,
//! its body is bounded in size and in time; answers the framework makes on
//! its own under `/portal/` are the portal's pages, with its headers.

use std::time::{Duration, Instant};

use relay_api::portal::{FORM_READ_TIMEOUT, MAX_FORM_BYTES};
use relay_tests::{Options, PortalVisitor, Rest, Stack};
use reqwest::header;
use uuid::Uuid;

use crate::edges::{raw_exchange_paced, raw_exchange_within};

const CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// A portal page: HTML, with the portal's security headers. `head` is
/// lowercase, as the raw exchanges return it.
fn assert_portal_page(what: &str, status: u16, head: &str, want: u16) {
    assert_eq!(status, want, "{what}: {head}");
    for h in [
        "content-type: text/html; charset=utf-8".to_owned(),
        format!("content-security-policy: {}", CSP.to_ascii_lowercase()),
        "x-frame-options: deny".to_owned(),
        "x-content-type-options: nosniff".to_owned(),
        "referrer-policy: no-referrer".to_owned(),
        "cache-control: no-store".to_owned(),
    ] {
        assert!(head.lines().any(|l| l == h), "{what}: no `{h}` in\n{head}");
    }
}

fn request(method: &str, path: &str, headers: &str) -> String {
    format!("{method} {path} HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n{headers}\r\n")
}

/// A GET of a portal page through a browser's client: status, head
/// (lowercase, one `name: value` a line) and body.
async fn get(portal: &PortalVisitor, path: &str) -> anyhow::Result<(u16, String, String)> {
    let resp =
        portal.http.get(format!("{}{path}", portal.base)).header(header::COOKIE, format!("relay_portal={}", portal.cookie)).send().await?;
    let status = resp.status().as_u16();
    let head: String = resp
        .headers()
        .iter()
        .map(|(k, v)| format!("\n{}: {}", k.as_str(), String::from_utf8_lossy(v.as_bytes()).to_ascii_lowercase()))
        .collect();
    Ok((status, head, resp.text().await?))
}

/// A stack (no dispatcher: nothing is delivered), a tenant with one
/// endpoint subscribed to `q.x`, and a session of that tenant's portal.
struct Visit {
    stack: Stack,
    api_key: String,
    rest: Rest,
    ep: String,
    portal: PortalVisitor,
}

async fn visit(tenant: &str) -> anyhow::Result<Visit> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let api_key = stack.tenant(tenant).await?.api_key;
    let rest = Rest::new(&stack.rest_url, Some(&api_key));
    let (ep, _) = rest.endpoint("http://127.0.0.1:9/q", &["q.x"]).await?;
    let portal = PortalVisitor::enter(&stack.rest_url, &api_key).await?;
    Ok(Visit { stack, api_key, rest, ep, portal })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_portal_queries_are_named_on_a_400_page_and_never_reach_postgres() -> anyhow::Result<()> {
    let Visit { stack, api_key, ep, portal, .. } = visit("portal-queries").await?;

    let long_type = "t".repeat(200);
    for (path, want) in [
        // A NUL cannot be stored in Postgres text: before, a 500.
        ("/portal/events?type=%00".to_owned(), r#"event type "\0" must be 1 to 128 characters"#),
        ("/portal/events?type=a%01b".to_owned(), "no spaces or control characters"),
        (format!("/portal/events?type={long_type}"), "must be 1 to 128 characters"),
        // Years Postgres cannot store: before, a 500.
        ("/portal/events?since=-5000-01-01T00:00".to_owned(), "since is out of range: times from 4713 BC to 294276 AD are accepted"),
        ("/portal/events?until=-5000-01-01T00:00".to_owned(), "until is out of range"),
        // A minute before Postgres's first instant (4714-11-24 BC, 00:00 UTC).
        ("/portal/events?since=-4713-11-23T23:59".to_owned(), "since is out of range"),
        ("/portal/events?since=2026-01-01T00:00%00".to_owned(), "since must be a time like"),
        ("/portal/events?before=99999999999999999999~2026-01-01T00:00:00Z".to_owned(), "the page cursor is not one this portal wrote"),
        ("/portal/events?id=%00".to_owned(), "an event id is a UUID"),
    ] {
        let (status, head, page) = get(&portal, &path).await?;
        assert_portal_page(&path, status, &head, 400);
        assert!(page.replace("&#34;", "\"").contains(want), "{path}: {want:?} not in {page}");
    }
    // The edges of what can be stored are accepted: Postgres's first instant,
    // and the last time the portal parses (Postgres's range goes further).
    for path in ["/portal/events?since=-4713-11-24T00:00", "/portal/events?until=%2B262142-12-31T23:59", "/portal/events?type=q.x"] {
        let (status, head, page) = get(&portal, path).await?;
        assert_portal_page(path, status, &head, 200);
        assert!(page.contains("No events match these filters"), "{path}: {page}");
    }
    // A repeated parameter is no error on a page that reads one.
    let (status, head, page) = get(&portal, &format!("/portal/endpoints/{ep}?done=saved&done=x")).await?;
    assert_portal_page("a repeated done", status, &head, 200);
    assert!(page.contains("Saved."), "{page}");
    let (status, head, _) = get(&portal, "/portal/endpoints/%00").await?;
    assert_portal_page("a NUL for an id", status, &head, 404);

    // The same rule over gRPC (and so REST): a recovery from a year Postgres
    // cannot store is the caller's mistake, not a 500.
    use relay_contracts::relay::tenant::v1::{
        RecoverWebhookEndpointRequest, webhook_endpoint_service_client::WebhookEndpointServiceClient,
    };
    let mut grpc = WebhookEndpointServiceClient::connect(stack.grpc_url.clone()).await?;
    let mut req = tonic::Request::new(RecoverWebhookEndpointRequest {
        id: ep.clone(),
        since: Some(prost_types::Timestamp { seconds: -220_000_000_000, nanos: 0 }),
        until: Some(prost_types::Timestamp { seconds: 1_800_000_000, nanos: 0 }),
        dry_run: true,
    });
    req.metadata_mut().insert("authorization", format!("Bearer {api_key}").parse()?);
    let refused = grpc.recover_webhook_endpoint(req).await.expect_err("out of range");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("since is out of range"), "{refused:?}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portal_form_is_read_only_after_its_session_and_within_its_size_and_time() -> anyhow::Result<()> {
    let Visit { stack, rest, ep, portal, .. } = visit("portal-forms-bounds").await?;
    let addr = stack.addrs.rest;
    let cookie = format!("cookie: relay_portal={}\r\n", portal.cookie);
    let form = "content-type: application/x-www-form-urlencoded\r\n";
    let forms = [
        "/portal/logout".to_owned(),
        "/portal/endpoints".to_owned(),
        format!("/portal/endpoints/{ep}"),
        format!("/portal/endpoints/{ep}/rotate"),
        format!("/portal/endpoints/{ep}/enable"),
        format!("/portal/endpoints/{ep}/disable"),
        format!("/portal/endpoints/{ep}/delete"),
        format!("/portal/endpoints/{ep}/recover"),
        format!("/portal/dead-letters/{}/replay", Uuid::new_v4()),
    ];

    // Without a session, nothing is read: a declared 10 GB, or a body left
    // unfinished, is answered at once (before, held open past 320 s).
    for path in &forms {
        for (what, declared, sent) in [("10 GB declared", "10000000000", ""), ("an unfinished body", "100", "csrf=abc")] {
            let started = Instant::now();
            let head = request("POST", path, &format!("{form}content-length: {declared}\r\n")) + sent;
            let (status, h, _) = raw_exchange_within(addr, head.as_bytes(), Duration::from_secs(1)).await?;
            assert_portal_page(&format!("POST {path}, {what}, no session"), status, &h, 401);
            assert!(started.elapsed() < Duration::from_secs(1), "{path}: {:?}", started.elapsed());
        }
    }
    // With one: the declared length is judged from the header (413 at once).
    for path in &forms {
        let started = Instant::now();
        let head = request("POST", path, &format!("{cookie}{form}content-length: 10000000000\r\n"));
        let (status, h, page) = raw_exchange_within(addr, head.as_bytes(), Duration::from_secs(1)).await?;
        assert_portal_page(&format!("POST {path}, 10 GB declared"), status, &h, 413);
        assert!(page.contains(&format!("at most {MAX_FORM_BYTES} bytes; this one declares 10000000000")), "{page}");
        assert!(started.elapsed() < Duration::from_secs(1), "{path}: {:?}", started.elapsed());
    }
    // An unfinished body, and one that trickles, are given up on at the
    // time limit: 408, well before anything else would end them.
    let unfinished = vec![(
        Duration::ZERO,
        (request("POST", "/portal/logout", &format!("{cookie}{form}content-length: 100\r\n")) + "csrf=").into_bytes(),
    )];
    let mut trickle =
        vec![(Duration::ZERO, request("POST", "/portal/logout", &format!("{cookie}{form}content-length: 60\r\n")).into_bytes())];
    trickle.extend((0..60).map(|_| (Duration::from_millis(500), b"x".to_vec())));
    for (what, parts) in [("an unfinished body", unfinished), ("a body trickling 2 bytes a second", trickle)] {
        let started = Instant::now();
        let (status, h, page) = raw_exchange_paced(addr, parts, FORM_READ_TIMEOUT + Duration::from_secs(2)).await?;
        let took = started.elapsed();
        assert_portal_page(what, status, &h, 408);
        assert!(page.contains(&format!("did not arrive within {} s", FORM_READ_TIMEOUT.as_secs())), "{what}: {page}");
        assert!(took >= FORM_READ_TIMEOUT - Duration::from_millis(500), "{what}: answered after {took:?}, before the time limit");
    }
    // A body longer than it may be, streamed (no length declared): 413.
    let chunked = request("POST", "/portal/logout", &format!("{cookie}{form}transfer-encoding: chunked\r\n"))
        + &format!("{:x}\r\ncsrf={}\r\n0\r\n\r\n", MAX_FORM_BYTES + 5, "x".repeat(MAX_FORM_BYTES));
    let (status, h, _) = raw_exchange_within(addr, chunked.as_bytes(), Duration::from_secs(5)).await?;
    assert_portal_page("a streamed body over the limit", status, &h, 413);
    // Not a form (415); a form that cannot be read (400); without its CSRF token (403).
    for (what, content_type, body, want) in [
        ("a JSON body", "application/json", format!(r#"{{"csrf": "{}"}}"#, portal.csrf), 415),
        ("a duplicated field", "application/x-www-form-urlencoded", format!("csrf={0}&csrf={0}", portal.csrf), 400),
        ("a forged token", "application/x-www-form-urlencoded", "csrf=forged".to_owned(), 403),
    ] {
        let req = request(
            "POST",
            &format!("/portal/endpoints/{ep}/disable"),
            &format!("{cookie}content-type: {content_type}\r\ncontent-length: {}\r\n", body.len()),
        ) + &body;
        let (status, h, _) = raw_exchange_within(addr, req.as_bytes(), Duration::from_secs(5)).await?;
        assert_portal_page(what, status, &h, want);
    }
    assert_eq!(rest.get(&format!("/v1/webhooks/{ep}")).await?["enabled"].as_bool(), Some(true), "no refused form changed anything");
    // A form within its bounds still works, chunked too; and the session
    // lived through all of the above.
    let body = format!("csrf={}", portal.csrf);
    let chunked = request("POST", &format!("/portal/endpoints/{ep}/disable"), &format!("{cookie}{form}transfer-encoding: chunked\r\n"))
        + &format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let (status, h, _) = raw_exchange_within(addr, chunked.as_bytes(), Duration::from_secs(5)).await?;
    assert!(status == 303 && h.contains(&format!("location: /portal/endpoints/{ep}?done=disabled")), "{status} {h}");
    assert_eq!(rest.get(&format!("/v1/webhooks/{ep}")).await?["enabled"].as_bool(), Some(false));
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_the_framework_makes_under_the_portal_are_the_portals_pages() -> anyhow::Result<()> {
    let Visit { stack, portal, .. } = visit("portal-framework").await?;
    let addr = stack.addrs.rest;
    let cookie = format!("cookie: relay_portal={}\r\n", portal.cookie);
    let cases: Vec<(&str, String, u16)> = vec![
        // Before, the REST facade's JSON 404.
        ("an unknown page", request("GET", "/portal/nothing/here", ""), 404),
        ("a form to an unknown page", request("POST", "/portal/nothing", "content-length: 10000000000\r\n"), 404),
        ("a trailing slash", request("GET", "/portal/events/", &cookie), 404),
        // Before, axum's empty 405.
        ("GET of a form", request("GET", "/portal/logout", &cookie), 405),
        ("PUT of a page", request("PUT", "/portal/", &cookie), 405),
        ("DELETE of a form", request("DELETE", "/portal/endpoints", &cookie), 405),
        // Before, axum's plain-text 400.
        ("invalid UTF-8 in a path id", request("GET", "/portal/endpoints/%FF%FE", &cookie), 400),
        // Before, the facade's JSON 414 and 431.
        ("a 9 KB target", request("GET", &format!("/portal/events?type={}", "a".repeat(9_000)), &cookie), 414),
        ("100 header fields", request("GET", "/portal/", &(0..100).map(|i| format!("x-h{i}: v\r\n")).collect::<String>()), 431),
    ];
    for (what, req, want) in cases {
        let (status, head, page) = raw_exchange_within(addr, req.as_bytes(), Duration::from_secs(5)).await?;
        assert_portal_page(what, status, &head, want);
        assert!(page.contains("<h1>") && page.contains("/portal/assets/portal.css"), "{what}: not the portal's page: {page}");
        if want == 405 {
            assert!(head.lines().any(|l| l.starts_with("allow: ")), "{what}: a 405 says what is allowed: {head}");
        }
    }
    // The REST facade's answers stay its own.
    let (status, head, _) = raw_exchange_within(addr, request("GET", "/v2/nothing", "").as_bytes(), Duration::from_secs(5)).await?;
    assert!(status == 404 && head.contains("content-type: application/json"), "{status} {head}");
    stack.stop().await
}
