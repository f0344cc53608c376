//! Issue 27.5: the egress proxy through a real forwarding proxy (Debian's
//! tinyproxy). A plain request is forwarded, an HTTPS receiver is reached
//! through a CONNECT tunnel with the endpoint's pinned CA and client
//! certificate intact end to end, and the URL rules still apply to the final
//! target: a name that resolves to a blocked address at send time is refused
//! before the proxy is ever asked.

use std::{net::IpAddr, sync::Arc, time::Duration};

use relay_netguard::StaticResolver;
use relay_tests::{Options, Receiver, Rest, Stack, TestPki, Tinyproxy, eventually};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_go_through_a_real_proxy_https_by_connect_and_blocked_targets_never_reach_it() -> anyhow::Result<()> {
    let proxy = Tinyproxy::start().await?;
    let pki = TestPki::new()?;
    let tls = Receiver::start_tls(pki.server_config(true)?).await?;
    let plain = Receiver::start().await?;
    let public: IpAddr = "93.184.215.14".parse()?;
    let (at_registration, at_send) = (Arc::new(StaticResolver::default()), Arc::new(StaticResolver::default()));
    at_registration.set("sneaky.test", &[public]);
    at_send.set("sneaky.test", &["10.0.0.9".parse()?]);
    let stack = Stack::start(Options {
        api_resolver: Some(at_registration),
        dispatcher_resolver: Some(at_send),
        egress_proxy: Some(proxy.url()),
        ..Options::default().tiers("0")
    })
    .await?;
    let tenant = stack.tenant("tinyproxy").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let mtls = json!({"url": tls.url("/tunnel"), "event_types": ["p"], "ca_bundle": pki.ca,
                      "client_certificate": pki.client.cert, "client_key": pki.client.key});
    assert_eq!(rest.post("/v1/webhooks", mtls).await?.0, 201);
    rest.endpoint(&plain.url("/forwarded"), &["p"]).await?;
    let (sneaky, _) = rest.endpoint("http://sneaky.test/s", &["p"]).await?;
    let event = rest.publish("p", json!({"through": "tinyproxy"})).await?;

    assert_eq!(tls.wait_at("/tunnel", 1, Duration::from_secs(20)).await.len(), 1, "HTTPS with a client certificate, tunnelled");
    let forwarded = plain.wait_at("/forwarded", 1, Duration::from_secs(20)).await;
    assert_eq!(forwarded.len(), 1, "plain HTTP, forwarded");
    assert_eq!(forwarded[0].header("relay-webhook-id"), event);
    assert!(!forwarded[0].header("via").is_empty(), "it came through the proxy (tinyproxy adds Via)");
    let dead = eventually(Duration::from_secs(20), || async {
        let d = rest.deliveries(&event).await.ok()?;
        d.into_iter().find(|d| d["endpoint_id"] == sneaky && d["state"] == "DELIVERY_STATE_DEAD")
    })
    .await
    .expect("the blocked target's delivery ends");
    let error = dead["attempts"][0]["error"].as_str().unwrap_or_default().to_owned();
    assert!(error.starts_with("blocked") && error.contains("10.0.0.9"), "{error}");

    let log = proxy.log();
    assert!(log.contains(&format!("CONNECT 127.0.0.1:{}", tls.addr.port())), "the tunnel is in tinyproxy's log: {log}");
    assert!(log.contains(&format!("127.0.0.1:{}/forwarded", plain.addr.port())), "the forwarded request is in its log: {log}");
    assert!(!log.contains("sneaky") && !log.contains("10.0.0.9"), "the proxy was never asked for the blocked target: {log}");
    stack.stop().await?;
    proxy.stop().await
}
