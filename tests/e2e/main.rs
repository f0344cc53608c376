//! End to end: REST facade → outbox → NATS EVENTS → dispatcher → Expand →
//! delivery relay → NATS DELIVERIES → dispatcher → Material → signed POST →
//! Outcome, against real Postgres, NATS and a receiver on loopback.

mod admission;
mod at_publish;
mod broker_loss;
mod catalogue;
mod claims;
mod cli;
mod custom_headers;
mod delivery;
mod deploy;
mod edges;
mod egress_proxy;
mod failover;
mod fairness;
mod faults;
mod filters;
mod health;
mod in_flight;
mod listen;
mod oauth2;
mod operations;
mod ordered_delivery;
mod ordering;
mod pipeline_edges;
mod portal;
mod portal_bounds;
mod portal_browser;
mod portal_catalogue;
mod portal_receiver_auth;
mod rate_limit;
mod receiver_tls;
mod receiving;
mod retention;
mod schemes;
mod security;
mod sending;
mod ssrf;
mod statistics;
mod switch_off;
mod traces;

use std::time::Duration;

use relay_tests::{Options, Receiver, Rest, Stack, contract_signature};
use reqwest::Method;
use serde_json::json;

/// A recipient's check: any `v1=` entry matches the contract's signature.
fn verifies(secret: &str, timestamp: &str, body: &[u8], header: &str) -> bool {
    let expected = contract_signature(secret, timestamp, body);
    header.split(',').any(|entry| entry.trim() == expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_signed_webhook_travels_through_every_component() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("e2e").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));

    let (status, created) =
        rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": receiver.url("/hook"), "event_types": ["invoice.paid"]}))).await?;
    assert_eq!(status, 201, "{created}");
    let secret = created["secret"].as_str().expect("the secret is returned at creation").to_owned();
    let endpoint_id = created["endpoint"]["id"].as_str().unwrap().to_owned();
    assert_eq!(created["endpoint"]["event_types"], json!(["invoice.paid"]));

    // A read never shows the secret.
    let (status, got) = rest.call(Method::GET, &format!("/v1/webhooks/{endpoint_id}"), None).await?;
    assert_eq!(status, 200);
    assert_eq!(got["id"], endpoint_id.as_str());
    assert!(!got.to_string().contains(&secret), "GET leaked the secret: {got}");

    let payload = json!({"invoice": "in_123", "amount": 4200, "lines": [{"sku": "a", "qty": 2}], "note": "café ✓"});
    let (status, published) = rest.call(Method::POST, "/v1/events", Some(json!({"type": "invoice.paid", "payload": payload}))).await?;
    assert_eq!(status, 202, "{published}");
    let event_id = published["event_id"].as_str().unwrap().to_owned();
    // Not subscribed: must produce no request at all.
    let (status, other) = rest.call(Method::POST, "/v1/events", Some(json!({"type": "user.created", "payload": {"u": 1}}))).await?;
    assert_eq!(status, 202, "{other}");
    let other_id = other["event_id"].as_str().unwrap().to_owned();

    let got = receiver.wait_for(1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "the subscribed event should arrive");
    // Give a duplicate or the unsubscribed event time to (wrongly) show up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let got = receiver.received();
    assert_eq!(
        got.len(),
        1,
        "exactly one POST: {:?}",
        got.iter().map(|r| String::from_utf8_lossy(&r.body).into_owned()).collect::<Vec<_>>()
    );

    let req = &got[0];
    assert_eq!(req.path, "/hook");
    let header = |n: &str| req.headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    assert_eq!(header("relay-webhook-id"), event_id);
    assert_eq!(header("content-type"), "application/json");
    let ts = header("relay-webhook-timestamp");
    let sent: i64 = ts.parse().expect("whole seconds");
    assert!((chrono_now() - sent).abs() < 60, "timestamp {ts} is not now");
    assert!(verifies(&secret, &ts, &req.body, &header("relay-webhook-signature")), "signature does not verify");
    assert!(!verifies("whsec_wrong", &ts, &req.body, &header("relay-webhook-signature")));

    let envelope: serde_json::Value = serde_json::from_slice(&req.body)?;
    assert_eq!(envelope["id"], event_id.as_str());
    assert_eq!(envelope["type"], "invoice.paid");
    assert_eq!(envelope["environment_id"], tenant.environment_id.as_str());
    assert_eq!(envelope["payload"], payload);
    assert!(envelope["occurred_at"].as_str().is_some_and(|t| t.ends_with('Z')), "{envelope}");
    let keys: Vec<&str> = envelope.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys.len(), 5, "envelope has exactly id, type, environment_id, occurred_at, payload: {keys:?}");

    // The outcome was recorded: the delivery is delivered at attempt 1.
    let mut state = String::new();
    for _ in 0..40 {
        let (status, list) = rest.call(Method::GET, &format!("/v1/events/{event_id}/deliveries"), None).await?;
        assert_eq!(status, 200, "{list}");
        state = list["deliveries"][0]["state"].as_str().unwrap_or_default().to_owned();
        if state == "DELIVERY_STATE_DELIVERED" {
            assert_eq!(list["deliveries"][0]["attempt"], 1);
            assert_eq!(list["deliveries"][0]["last_status"], 200);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, "DELIVERY_STATE_DELIVERED");
    let (_, none) = rest.call(Method::GET, &format!("/v1/events/{other_id}/deliveries"), None).await?;
    assert_eq!(none["deliveries"], json!([]), "an unsubscribed type creates no delivery");

    // The operator's metrics saw the attempt, and label nothing secret.
    let metrics = reqwest::get(&stack.metrics_url).await?.text().await?;
    assert!(metrics.contains("relay_attempts_total{decision=\"delivered\"} 1"), "{metrics}");
    assert!(metrics.contains("relay_attempt_latency_seconds_count{decision=\"delivered\"} 1"), "{metrics}");
    assert!(metrics.contains("relay_queue_depth{queue=\"outbox_unpublished\"} 0"), "{metrics}");
    assert!(metrics.contains("relay_outbox_oldest_seconds 0"), "{metrics}");
    assert!(metrics.contains("relay_dependency_up{dependency=\"postgres\"} 1"), "{metrics}");
    assert!(metrics.contains("relay_dependency_up{dependency=\"nats\"} 1"), "{metrics}");
    assert!(metrics.contains("relay_endpoint_circuits{state=\"open\"} 0"), "{metrics}");
    assert!(!metrics.contains(&secret) && !metrics.contains(&tenant.api_key) && !metrics.contains("in_123"), "metrics leak: {metrics}");

    stack.stop().await
}

fn chrono_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_the_same_event_id_twice_creates_one_event_and_one_webhook() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("idempotent").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (status, _) = rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": receiver.url("/"), "event_types": ["a.b"]}))).await?;
    assert_eq!(status, 201);
    let id = uuid::Uuid::new_v4().to_string();
    let (s1, first) = rest.call(Method::POST, "/v1/events", Some(json!({"id": id, "type": "a.b", "payload": 1}))).await?;
    let (s2, second) = rest.call(Method::POST, "/v1/events", Some(json!({"id": id, "type": "a.b", "payload": 1}))).await?;
    assert_eq!((s1, s2), (202, 202));
    assert_eq!(first["event_id"], id.as_str());
    assert_eq!(first["duplicate"], false);
    assert_eq!(second["duplicate"], true);
    assert_eq!(receiver.wait_for(1, Duration::from_secs(20)).await.len(), 1);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(receiver.received().len(), 1, "one event id, one webhook");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_services_on_both_ports() -> anyhow::Result<()> {
    use relay_tests::reflection::list_services;
    let stack = Stack::start(Options::default()).await?;
    let public = tonic::transport::Channel::from_shared(stack.grpc_url.clone())?.connect().await?;
    for v1alpha in [false, true] {
        let services = list_services(public.clone(), v1alpha).await?;
        for s in [
            "relay.tenant.v1.WebhookEndpointService",
            "relay.tenant.v1.EventService",
            "relay.tenant.v1.DeadLetterService",
            "grpc.health.v1.Health",
        ] {
            assert!(services.iter().any(|x| x == s), "{s} missing from {services:?} (v1alpha={v1alpha})");
        }
        assert!(!services.iter().any(|x| x.contains("Admin") || x.contains("Dispatch")), "internal services leaked: {services:?}");
    }
    let internal = stack.internal_channel(Some("operator")).await?;
    let services = list_services(internal, true).await?;
    assert!(services.iter().any(|x| x == "relay.admin.v1.AdminService"), "{services:?}");
    assert!(services.iter().any(|x| x == "relay.dispatch.v1.DispatchService"), "{services:?}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_internal_seam_accepts_only_the_dispatcher_identity() -> anyhow::Result<()> {
    use relay_contracts::relay::{
        admin::v1::{GetQueueDepthsRequest, admin_service_client::AdminServiceClient},
        dispatch::v1::{MaterialRequest, dispatch_service_client::DispatchServiceClient},
    };
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("seam").await?;
    let probe = MaterialRequest { delivery_id: uuid::Uuid::new_v4().to_string(), attempt: 1, generation: 0, ..Default::default() };

    // The dispatcher passes the identity check (and learns the id is unknown).
    let mut as_dispatcher = DispatchServiceClient::new(stack.internal_channel(Some("dispatcher")).await?);
    assert_eq!(as_dispatcher.material(probe.clone()).await.unwrap_err().code(), tonic::Code::NotFound);
    // An operator may not call the seam, and the dispatcher may not administer.
    let mut as_operator = DispatchServiceClient::new(stack.internal_channel(Some("operator")).await?);
    assert_eq!(as_operator.material(probe.clone()).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    let mut admin_as_dispatcher = AdminServiceClient::new(stack.internal_channel(Some("dispatcher")).await?);
    assert_eq!(admin_as_dispatcher.get_queue_depths(GetQueueDepthsRequest {}).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    // A tenant API key without a client certificate does not get through TLS.
    let no_cert = stack.internal_channel(None).await;
    let refused = match no_cert {
        Err(_) => true,
        Ok(ch) => {
            let mut c = DispatchServiceClient::new(ch);
            let mut req = tonic::Request::new(probe);
            req.metadata_mut().insert("authorization", format!("Bearer {}", tenant.api_key).parse()?);
            c.material(req).await.is_err()
        }
    };
    assert!(refused, "a caller without the platform certificate reached the seam");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_errors_name_the_mistake_and_the_number() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("errors").await?;
    let anonymous = Rest::new(&stack.rest_url, None);
    let (status, body) = anonymous.call(Method::GET, "/v1/webhooks", None).await?;
    assert_eq!(status, 401, "{body}");
    assert!(body["message"].as_str().unwrap().contains("Bearer"), "{body}");
    let wrong = Rest::new(&stack.rest_url, Some("rk_abcdefghijkl_not-a-real-key"));
    let (status, body) = wrong.call(Method::GET, "/v1/webhooks", None).await?;
    assert_eq!(status, 401);
    assert!(!body.to_string().contains("not-a-real-key"), "the credential was quoted back: {body}");

    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (status, body) = rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": "ftp://example.com/", "event_types": ["x"]}))).await?;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["reason"], "endpoint_url_rejected");
    let (status, body) = rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": "http://127.0.0.1:1/", "event_types": []}))).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("missing_event_types")), "{body}");
    let (status, body) = rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": "http://127.0.0.1:1/", "event_typez": ["x"]}))).await?;
    assert_eq!(status, 400, "an unknown field is refused: {body}");
    for i in 0..5 {
        let (status, body) =
            rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": format!("http://127.0.0.1:1/{i}"), "event_types": ["x"]}))).await?;
        assert_eq!(status, 201, "{body}");
    }
    let (status, body) =
        rest.call(Method::POST, "/v1/webhooks", Some(json!({"url": "http://127.0.0.1:1/6", "event_types": ["x"]}))).await?;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["reason"], "endpoint_quota_exceeded");
    assert_eq!(body["message"], "an environment may have at most 5 webhook endpoints; this one already has 5");
    let (status, body) = rest.call(Method::GET, &format!("/v1/webhooks/{}", uuid::Uuid::new_v4()), None).await?;
    assert_eq!((status, body["code"].as_i64()), (404, Some(5)), "{body}");
    stack.stop().await
}
