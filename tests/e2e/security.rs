//! The tenant surface's security boundary: operators over grpcurl, credential
//! types, and the cross-tenant gauntlet.

use std::{process::Command, time::Duration};

use relay_contracts::relay::tenant::v1::{
    self as pb, dead_letter_service_client::DeadLetterServiceClient, event_service_client::EventServiceClient,
    webhook_endpoint_service_client::WebhookEndpointServiceClient,
};
use relay_tests::{Options, PortalVisitor, Receiver, Reply, Rest, Stack, TenantCreds, eventually};
use reqwest::Method;
use serde_json::{Value, json};
use tonic::{Code, Request, transport::Channel};

/// Runs grpcurl against the internal port with the named client certificate:
/// `flags` go before the address, `then` (verb, method, symbol) after it.
fn grpcurl(stack: &Stack, identity: &str, flags: &[&str], then: &[&str]) -> anyhow::Result<(bool, String, String)> {
    let certs = &stack.certs;
    let target = stack.internal_url.trim_start_matches("https://").to_owned();
    let out = Command::new("grpcurl")
        .arg("-cacert")
        .arg(certs.join("ca.pem"))
        .arg("-cert")
        .arg(certs.join(format!("{identity}.pem")))
        .arg("-key")
        .arg(certs.join(format!("{identity}-key.pem")))
        .args(["-authority", relay_devkit::API_TLS_NAME])
        .args(flags)
        .arg(&target)
        .args(then)
        .output()
        .map_err(|e| anyhow::anyhow!("running grpcurl (deploy/local/test installs it): {e}"))?;
    Ok((out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// A grpcurl call that must succeed; returns its JSON output.
fn call(stack: &Stack, method: &str, body: Value) -> anyhow::Result<Value> {
    let body = body.to_string();
    let (ok, out, err) = grpcurl(stack, "operator", &["-d", &body], &[&format!("relay.admin.v1.AdminService/{method}")])?;
    anyhow::ensure!(ok, "grpcurl {method} failed: {err}");
    Ok(serde_json::from_str(&out)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_runs_the_platform_with_grpcurl_through_reflection() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0")).await?;
    let (ok, listed, err) = grpcurl(&stack, "operator", &[], &["list"])?;
    assert!(ok, "{err}");
    assert!(listed.lines().any(|l| l == "relay.admin.v1.AdminService"), "{listed}");
    let (ok, described, err) = grpcurl(&stack, "operator", &[], &["describe", "relay.admin.v1.AdminService"])?;
    assert!(ok && described.contains("rpc CreateEnvironment"), "{described}{err}");

    let env = call(&stack, "CreateEnvironment", json!({"name": "grpcurl-co"}))?;
    let env_id = env["environment"]["id"].as_str().unwrap().to_owned();
    assert_eq!(env["environment"]["endpointQuota"], 5, "the default quota: {env}");
    let quota = call(&stack, "SetEndpointQuota", json!({"environment_id": env_id, "endpoint_quota": 7}))?;
    assert_eq!(quota["environment"]["endpointQuota"], 7);
    let issued = call(&stack, "CreateApiKey", json!({"environment_id": env_id, "name": "ci"}))?;
    let key = issued["key"].as_str().unwrap().to_owned();
    let key_id = issued["apiKey"]["id"].as_str().unwrap().to_owned();
    assert!(!issued["apiKey"].to_string().contains(&key), "the key record never carries the key");

    // The tenant uses the key; an endpoint that always fails dead-letters at once.
    let receiver = Receiver::start().await?;
    receiver.reply("/ops", Reply::Status(500));
    let rest = Rest::new(&stack.rest_url, Some(&key));
    let (endpoint_id, _) = rest.endpoint(&receiver.url("/ops"), &["ops"]).await?;
    let event_id = rest.publish("ops", json!({"op": 1})).await?;

    let endpoints = call(&stack, "ListEndpoints", json!({"environment_id": env_id}))?;
    assert_eq!(endpoints["endpoints"][0]["id"], endpoint_id.as_str());
    assert!(!endpoints.to_string().contains("whsec_"), "no secret in an operator's listing");
    let letters = eventually(Duration::from_secs(20), || async {
        let l = call(&stack, "ListDeadLetters", json!({"environment_id": env_id})).ok()?;
        l["deadLetters"].as_array().is_some_and(|a| a.len() == 1).then_some(l)
    })
    .await
    .expect("the failing delivery is dead-lettered");
    let deliveries = call(&stack, "ListDeliveries", json!({"environment_id": env_id, "event_id": event_id}))?;
    assert_eq!(deliveries["deliveries"][0]["state"], "DELIVERY_STATE_DEAD", "{deliveries}");
    receiver.reply("/ops", Reply::Status(200));
    let replay = call(&stack, "ReplayDeadLetter", json!({"id": letters["deadLetters"][0]["id"]}))?;
    assert_eq!(replay["deliveryId"], deliveries["deliveries"][0]["id"]);
    assert_eq!(receiver.wait_at("/ops", 2, Duration::from_secs(20)).await.len(), 2, "the replay is delivered");
    // Every field shown (-emit-defaults), once settled: nothing waits
    // anywhere, and the replayed dead letter is still kept.
    let depths = eventually(Duration::from_secs(10), || async {
        let method = ["relay.admin.v1.AdminService/GetQueueDepths"];
        let (ok, out, _) = grpcurl(&stack, "operator", &["-emit-defaults", "-d", "{}"], &method).ok()?;
        let d: Value = serde_json::from_str(&out).ok().filter(|_| ok)?;
        (d["deliveriesPending"] == "0").then_some(d)
    })
    .await
    .expect("the queues settle");
    assert_eq!(depths, json!({"outboxUnpublished": "0", "deliveriesPending": "0", "deliveriesDue": "0", "deadLetters": "1"}));
    let rewrap = call(&stack, "RewrapSecrets", json!({}))?;
    assert_eq!(rewrap["activeKeyId"], "dev", "{rewrap}");

    let revoked = call(&stack, "RevokeApiKey", json!({"id": key_id}))?;
    assert!(revoked["apiKey"]["revokedAt"].is_string(), "{revoked}");
    let (status, _) = rest.call(Method::GET, "/v1/webhooks", None).await?;
    assert_eq!(status, 401, "a revoked key stops at once");

    // The dispatcher's identity may not administer; an operator may not use the seam.
    let (ok, _, err) = grpcurl(&stack, "dispatcher", &["-d", "{\"name\":\"x\"}"], &["relay.admin.v1.AdminService/CreateEnvironment"])?;
    assert!(!ok && err.contains("PermissionDenied"), "{err}");
    let (ok, _, err) = grpcurl(&stack, "operator", &["-d", "{}"], &["relay.dispatch.v1.DispatchService/Material"])?;
    assert!(!ok && err.contains("PermissionDenied"), "{err}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_of_the_wrong_kind_or_place_are_refused_without_being_quoted() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let tenant = stack.tenant("credentials").await?;

    // A platform identity on a tenant route: 403 wrong_credential_type.
    for identity in ["operator", "dispatcher"] {
        let mut client = WebhookEndpointServiceClient::new(stack.internal_channel(Some(identity)).await?);
        let st = client.list_webhook_endpoints(pb::ListWebhookEndpointsRequest {}).await.unwrap_err();
        assert_eq!(st.code(), Code::PermissionDenied, "{identity}: {st:?}");
        assert_eq!(st.metadata().get("relay-error-reason").unwrap(), "wrong_credential_type");
    }

    // An API key in the URL is refused even when it is valid.
    let anonymous = Rest::new(&stack.rest_url, None);
    for param in ["api_key", "access_token", "key"] {
        let (status, body) = anonymous.call(Method::GET, &format!("/v1/webhooks?{param}={}", tenant.api_key), None).await?;
        assert_eq!((status, body["reason"].as_str()), (401, Some("credential_in_url")), "{body}");
        assert!(!body.to_string().contains(&tenant.api_key));
    }
    // Wrong scheme, unknown and malformed keys: 401 naming what is expected.
    let http = reqwest::Client::new();
    for header in [format!("Basic {}", tenant.api_key), "Bearer rk_aaaaaaaaaaaa_nope".into(), "Bearer garbage".into()] {
        let resp = http.get(format!("{}/v1/webhooks", stack.rest_url)).header("authorization", &header).send().await?;
        assert_eq!(resp.status(), 401);
        let body = resp.text().await?;
        assert!(body.contains("Bearer"), "{body}");
        assert!(!body.contains("nope") && !body.contains("garbage") && !body.contains(&tenant.api_key), "quoted: {body}");
    }
    stack.stop().await
}

fn with_key<T>(key: &str, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {key}").parse().expect("ascii"));
    r
}

struct Owned {
    endpoint: String,
    event: String,
    dead_letter: String,
}

/// Gives a tenant an endpoint, an event, a delivery and a dead letter.
async fn populate(stack: &Stack, receiver: &Receiver, t: &TenantCreds, path: &str) -> anyhow::Result<Owned> {
    let rest = Rest::new(&stack.rest_url, Some(&t.api_key));
    receiver.reply(path, Reply::Status(500));
    let (endpoint, _) = rest.endpoint(&receiver.url(path), &["g"]).await?;
    let event = rest.publish("g", json!({"owner": path})).await?;
    let dead_letter = eventually(Duration::from_secs(20), || async {
        let l = rest.get("/v1/dead-letters").await.ok()?;
        l["dead_letters"][0]["id"].as_str().map(str::to_owned)
    })
    .await
    .expect("a dead letter");
    Ok(Owned { endpoint, event, dead_letter })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cross_tenant_gauntlet_every_route_answers_404_or_an_empty_list() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default().tiers("0")).await?;
    let receiver = Receiver::start().await?;
    let (a, b) = (stack.tenant("tenant-a").await?, stack.tenant("tenant-b").await?);
    let owned_a = populate(&stack, &receiver, &a, "/a").await?;
    let owned_b = populate(&stack, &receiver, &b, "/b").await?;
    let a_ids = [owned_a.endpoint.as_str(), owned_a.event.as_str(), owned_a.dead_letter.as_str()];
    let leaks = |body: &Value| a_ids.iter().any(|id| body.to_string().contains(id));

    // REST, with B's key and A's ids.
    let rest = Rest::new(&stack.rest_url, Some(&b.api_key));
    let (ep, ev, dl) = (&owned_a.endpoint, &owned_a.event, &owned_a.dead_letter);
    for (method, path) in [
        (Method::GET, format!("/v1/webhooks/{ep}")),
        (Method::POST, format!("/v1/webhooks/{ep}/rotate-secret")),
        (Method::POST, format!("/v1/webhooks/{ep}/enable")),
        (Method::POST, format!("/v1/webhooks/{ep}/disable")),
        (Method::DELETE, format!("/v1/webhooks/{ep}")),
        (Method::GET, format!("/v1/events/{ev}/deliveries")),
        (Method::POST, format!("/v1/dead-letters/{dl}/replay")),
    ] {
        let body = if method == Method::POST { Some(json!({})) } else { None };
        let (status, reply) = rest.call(method.clone(), &path, body).await?;
        assert_eq!(status, 404, "{method} {path}: {reply}");
        assert!(!leaks(&reply), "{method} {path} leaked: {reply}");
    }
    for path in ["/v1/webhooks", "/v1/dead-letters"] {
        let reply = rest.get(path).await?;
        assert!(!leaks(&reply), "{path} leaked: {reply}");
        assert!(
            reply.to_string().contains(&owned_b.endpoint) || reply.to_string().contains(&owned_b.dead_letter),
            "B sees its own: {reply}"
        );
    }

    // gRPC, with B's key and A's ids.
    let channel = Channel::from_shared(stack.grpc_url.clone())?.connect().await?;
    let mut endpoints = WebhookEndpointServiceClient::new(channel.clone());
    let mut events = EventServiceClient::new(channel.clone());
    let mut letters = DeadLetterServiceClient::new(channel);
    let key = &b.api_key;
    let codes = [
        endpoints
            .get_webhook_endpoint(with_key(key, pb::GetWebhookEndpointRequest { id: ep.clone() }))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        endpoints
            .rotate_webhook_endpoint_secret(with_key(key, pb::RotateWebhookEndpointSecretRequest { id: ep.clone() }))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        endpoints
            .enable_webhook_endpoint(with_key(key, pb::EnableWebhookEndpointRequest { id: ep.clone() }))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        endpoints
            .disable_webhook_endpoint(with_key(key, pb::DisableWebhookEndpointRequest { id: ep.clone() }))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        endpoints
            .delete_webhook_endpoint(with_key(key, pb::DeleteWebhookEndpointRequest { id: ep.clone() }))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        events
            .list_event_deliveries(with_key(key, pb::ListEventDeliveriesRequest { event_id: ev.clone() }))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        letters.replay_dead_letter(with_key(key, pb::ReplayDeadLetterRequest { id: dl.clone() })).await.map(|_| ()).unwrap_err().code(),
    ];
    assert!(codes.iter().all(|c| *c == Code::NotFound), "{codes:?}");
    let listed = endpoints.list_webhook_endpoints(with_key(key, pb::ListWebhookEndpointsRequest {})).await?.into_inner();
    assert!(listed.endpoints.iter().all(|e| e.id != *ep));
    let dead = letters.list_dead_letters(with_key(key, pb::ListDeadLettersRequest {})).await?.into_inner();
    assert!(dead.dead_letters.iter().all(|d| d.id != *dl));

    // The portal, in a session of B's environment, with A's ids: every page
    // and form is 404 (with B's valid CSRF token), every list B's own.
    let portal = PortalVisitor::enter(&stack.rest_url, &b.api_key).await?;
    for path in [format!("/portal/endpoints/{ep}"), format!("/portal/events/{ev}")] {
        let (status, page) = portal.get(&path).await?;
        assert_eq!(status, 404, "GET {path}: {page}");
        assert!(!a_ids.iter().any(|id| page.contains(id)), "GET {path} leaked: {page}");
    }
    let a_receiver = receiver.url("/a");
    for path in [
        format!("/portal/endpoints/{ep}"),
        format!("/portal/endpoints/{ep}/rotate"),
        format!("/portal/endpoints/{ep}/enable"),
        format!("/portal/endpoints/{ep}/disable"),
        format!("/portal/endpoints/{ep}/recover"),
        format!("/portal/endpoints/{ep}/delete"),
        format!("/portal/dead-letters/{dl}/replay"),
    ] {
        let form = [("csrf", portal.csrf.as_str()), ("url", a_receiver.as_str()), ("event_types", "g"), ("event_id", ev.as_str())];
        let (status, _, page) = portal.post(&path, &form).await?;
        assert_eq!(status, 404, "POST {path}: {page}");
        assert!(!a_ids.iter().any(|id| page.contains(id)), "POST {path} leaked: {page}");
    }
    for path in ["/portal/", "/portal/events", "/portal/dead-letters"] {
        let (status, page) = portal.get(path).await?;
        assert_eq!(status, 200, "GET {path}");
        assert!(!a_ids.iter().any(|id| page.contains(id)), "GET {path} leaked: {page}");
        assert!(
            [&owned_b.endpoint, &owned_b.event, &owned_b.dead_letter].iter().any(|id| page.contains(id.as_str())),
            "B sees its own on {path}: {page}"
        );
    }

    // Publishing with A's event id creates B's own event, not a duplicate of
    // A's (ids are per environment); B sees only its own delivery of it.
    let (status, published) = rest.post("/v1/events", json!({"id": ev, "type": "g", "payload": {"by": "b"}})).await?;
    assert_eq!((status, published["duplicate"].as_bool()), (202, Some(false)), "{published}");
    let theirs = eventually(Duration::from_secs(20), || async { rest.deliveries(ev).await.ok().filter(|d| !d.is_empty()) })
        .await
        .expect("B's event is delivered");
    assert!(theirs.iter().all(|d| d["endpoint_id"] == owned_b.endpoint.as_str()), "{theirs:?}");

    // And A still has everything, unchanged.
    let a_rest = Rest::new(&stack.rest_url, Some(&a.api_key));
    let mine = a_rest.get(&format!("/v1/webhooks/{ep}")).await?;
    assert_eq!((mine["enabled"].as_bool(), mine["secret_rotated_at"].is_null()), (Some(true), true), "B changed A's endpoint: {mine}");
    assert_eq!(a_rest.deliveries(ev).await?.len(), 1);
    assert_eq!(a_rest.get("/v1/dead-letters").await?["dead_letters"].as_array().unwrap().len(), 1);
    stack.stop().await
}
