//! The portal's bounds (issue 25): a hostile query value is named on a 400
//! page and never reaches Postgres.

use relay_tests::{Options, PortalVisitor, Rest, Stack};
use reqwest::header;

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
    ep: String,
    portal: PortalVisitor,
}

async fn visit(tenant: &str) -> anyhow::Result<Visit> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let api_key = stack.tenant(tenant).await?.api_key;
    let rest = Rest::new(&stack.rest_url, Some(&api_key));
    let (ep, _) = rest.endpoint("http://127.0.0.1:9/q", &["q.x"]).await?;
    let portal = PortalVisitor::enter(&stack.rest_url, &api_key).await?;
    Ok(Visit { stack, api_key, ep, portal })
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
