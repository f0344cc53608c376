//! Endpoint URL rules at registration, the send-time guard (rebinding,
//! proxies), and signing secrets at rest.

use std::{net::IpAddr, sync::Arc, time::Duration};

use relay_netguard::StaticResolver;
use relay_tests::{Options, Receiver, Rest, Stack, contract_signature, eventually};
use serde_json::json;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an address")
}

const PUBLIC: &str = "93.184.215.14";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_refuses_blocked_addresses_in_every_spelling_and_names_that_resolve_to_them() -> anyhow::Result<()> {
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("public.test", &[ip(PUBLIC)]);
    resolver.set("internal.test", &[ip("10.0.0.5")]);
    resolver.set("mixed.test", &[ip(PUBLIC), ip("169.254.169.254")]);
    resolver.set("v6private.test", &[ip("fd00::1")]);
    let stack = Stack::start(Options { strict_urls: true, dispatcher: false, api_resolver: Some(resolver), ..Options::default() }).await?;
    let tenant = stack.tenant("urls").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));

    let (status, body) = rest.post("/v1/webhooks", json!({"url": "http://public.test/hook", "event_types": ["x"]})).await?;
    assert_eq!(status, 400);
    assert!(body["message"].as_str().unwrap().contains("https"), "{body}");
    for (url, names) in [
        ("https://127.0.0.1/", "127.0.0.1"),
        ("https://2130706433/", "127.0.0.1"),
        ("https://0x7f.0.0.1/", "127.0.0.1"),
        ("https://0177.0.0.1/", "127.0.0.1"),
        ("https://[::1]/", "::1"),
        ("https://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1"),
        ("https://[::127.0.0.1]/", "IPv4-compatible"),
        ("https://10.1.2.3/", "10.1.2.3"),
        ("https://192.168.1.1/", "192.168.1.1"),
        ("https://169.254.169.254/latest/meta-data/", "169.254.169.254"),
        ("https://100.64.0.1/", "100.64.0.1"),
        ("https://0.0.0.0/", "0.0.0.0"),
        ("https://255.255.255.255/", "255.255.255.255"),
        ("https://224.0.0.1/", "224.0.0.1"),
        ("https://[fe80::1]/", "fe80::1"),
        ("https://[fc00::1]/", "fc00::1"),
        ("https://localhost/", "localhost"),
        ("https://internal.test/", "10.0.0.5"),
        ("https://mixed.test/", "169.254.169.254"),
        ("https://v6private.test/", "fd00::1"),
        ("https://unknown.test/", "unknown.test"),
    ] {
        let (status, body) = rest.post("/v1/webhooks", json!({"url": url, "event_types": ["x"]})).await?;
        assert_eq!((status, body["reason"].as_str()), (400, Some("endpoint_url_rejected")), "{url}: {body}");
        assert!(body["message"].as_str().unwrap().contains(names), "{url}: the message names {names}: {body}");
    }
    let (status, body) = rest.post("/v1/webhooks", json!({"url": "https://public.test/hook", "event_types": ["x"]})).await?;
    assert_eq!(status, 201, "a public https endpoint is accepted: {body}");
    assert!(rest.get("/v1/webhooks").await?["endpoints"].as_array().unwrap().len() == 1, "only the accepted one exists");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_rebinding_after_registration_is_refused_at_send_time_and_recorded() -> anyhow::Result<()> {
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("rebind.test", &[ip(PUBLIC)]);
    let stack = Stack::start(Options {
        strict_urls: true,
        api_resolver: Some(resolver.clone()),
        dispatcher_resolver: Some(resolver.clone()),
        ..Options::default().tiers("0")
    })
    .await?;
    let tenant = stack.tenant("rebind").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint("https://rebind.test/hook", &["r"]).await?;
    // The attacker's DNS now answers with loopback.
    resolver.set("rebind.test", &[ip("127.0.0.1")]);
    let event_id = rest.publish("r", json!({})).await?;
    let dead = eventually(Duration::from_secs(20), || async {
        rest.deliveries(&event_id).await.ok()?.into_iter().next().filter(|d| d["state"] == "DELIVERY_STATE_DEAD")
    })
    .await
    .expect("the attempt fails");
    let error = dead["attempts"][0]["error"].as_str().unwrap().to_owned();
    assert!(error.contains("resolves to 127.0.0.1"), "the refusal is the attempt's error: {error}");
    assert!(dead["attempts"][0]["http_status"].is_null());
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatcher_connects_to_the_address_it_checked_with_one_lookup() -> anyhow::Result<()> {
    let (at_registration, at_send) = (Arc::new(StaticResolver::default()), Arc::new(StaticResolver::default()));
    at_registration.set("hooks.test", &[ip("127.0.0.1")]);
    at_send.set("hooks.test", &[ip("127.0.0.1")]);
    let stack =
        Stack::start(Options { api_resolver: Some(at_registration), dispatcher_resolver: Some(at_send.clone()), ..Options::default() })
            .await?;
    let tenant = stack.tenant("one-lookup").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    rest.endpoint(&format!("http://hooks.test:{}/one", receiver.addr.port()), &["o"]).await?;
    rest.publish("o", json!({})).await?;
    assert_eq!(receiver.wait_at("/one", 1, Duration::from_secs(20)).await.len(), 1);
    assert_eq!(at_send.lookups("hooks.test"), 1, "one resolution, checked and then connected to");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_egress_proxy_does_not_bypass_the_guard() -> anyhow::Result<()> {
    let proxy = Receiver::start().await?; // records what the proxy is asked to fetch
    let (at_registration, at_send) = (Arc::new(StaticResolver::default()), Arc::new(StaticResolver::default()));
    at_registration.set("sneaky.test", &[ip(PUBLIC)]);
    at_registration.set("fine.test", &[ip(PUBLIC)]);
    at_send.set("sneaky.test", &[ip("10.0.0.9")]);
    at_send.set("fine.test", &[ip(PUBLIC)]);
    let stack = Stack::start(Options {
        api_resolver: Some(at_registration),
        dispatcher_resolver: Some(at_send),
        egress_proxy: Some(format!("http://{}", proxy.addr)),
        ..Options::default().tiers("0")
    })
    .await?;
    let tenant = stack.tenant("proxy").await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (sneaky, _) = rest.endpoint("http://sneaky.test/s", &["p"]).await?;
    let (fine, _) = rest.endpoint("http://fine.test/f", &["p"]).await?;
    let event_id = rest.publish("p", json!({})).await?;
    let done = eventually(Duration::from_secs(20), || async {
        let d = rest.deliveries(&event_id).await.ok()?;
        (d.len() == 2 && d.iter().all(|d| d["state"] != "DELIVERY_STATE_PENDING")).then_some(d)
    })
    .await
    .expect("both deliveries finish");
    let of = |id: &str| done.iter().find(|d| d["endpoint_id"] == id).unwrap().clone();
    assert_eq!(of(&fine)["state"], "DELIVERY_STATE_DELIVERED", "a permitted target goes through the proxy");
    assert_eq!(of(&sneaky)["state"], "DELIVERY_STATE_DEAD");
    let error = of(&sneaky)["attempts"][0]["error"].as_str().unwrap().to_owned();
    assert!(error.starts_with("blocked") && error.contains("10.0.0.9"), "{error}");
    let asked: Vec<String> = proxy.received().iter().map(|r| r.path.clone()).collect();
    assert_eq!(asked, vec!["/f".to_owned()], "the proxy was never asked for the blocked target");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_at_rest_survive_key_rotation_and_rewrap_to_the_active_key() -> anyhow::Result<()> {
    use base64::{Engine, engine::general_purpose::STANDARD};
    use relay_contracts::relay::admin::v1::RewrapSecretsRequest;
    let (k1, k2) = (STANDARD.encode([1u8; 32]), STANDARD.encode([2u8; 32]));
    let mut stack = Stack::start(Options { secret_keys: Some(format!("k1:{k1}")), ..Options::default() }).await?;
    let tenant = stack.tenant("keys").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (endpoint_id, secret) = rest.endpoint(&receiver.url("/k"), &["k"]).await?;
    // Custom headers are sealed under the same keys, and move with them.
    let with_headers = json!({"url": receiver.url("/kh"), "event_types": ["k"], "headers": {"X-Kept": "through-every-key"}});
    assert_eq!(rest.post("/v1/webhooks", with_headers).await?.0, 201);
    let pg = stack.pg().await?;
    let stored = || async {
        let (key_id, ct): (String, Vec<u8>) =
            sqlx::query_as("SELECT secret_key_id, secret_ciphertext FROM webhook_endpoints WHERE id = $1::uuid")
                .bind(&endpoint_id)
                .fetch_one(&pg)
                .await?;
        anyhow::Ok((key_id, ct))
    };
    let (key_id, ciphertext) = stored().await?;
    assert_eq!(key_id, "k1");
    assert!(!ciphertext.windows(secret.len()).any(|w| w == secret.as_bytes()), "the secret is not stored in clear");
    let verified = |n: usize| {
        let r = receiver.at("/k")[n].clone();
        r.header("relay-webhook-signature")
            .split(',')
            .any(|e| e == contract_signature(&secret, &r.header("relay-webhook-timestamp"), &r.body))
    };

    // A new active key: old ciphertexts still decrypt; rewrap moves them.
    stack.stop_api().await?;
    stack.set_secret_keys(&format!("k2:{k2},k1:{k1}"))?;
    stack.start_api().await?;
    rest.publish("k", json!(1)).await?;
    receiver.wait_at("/k", 1, Duration::from_secs(20)).await;
    assert!(verified(0), "signed with the secret stored under the old key");
    let rewrapped = stack.admin().await?.rewrap_secrets(RewrapSecretsRequest {}).await?.into_inner();
    assert_eq!((rewrapped.rewrapped, rewrapped.active_key_id.as_str()), (2, "k2"), "both endpoints");
    assert_eq!(stored().await?.0, "k2");
    let header_keys: Vec<Option<String>> =
        sqlx::query_scalar("SELECT headers_key_id FROM webhook_endpoints WHERE headers_key_id IS NOT NULL").fetch_all(&pg).await?;
    assert_eq!(header_keys, vec![Some("k2".to_owned())], "the headers moved to the active key too");

    // The old key retired: everything still signs.
    stack.stop_api().await?;
    stack.set_secret_keys(&format!("k2:{k2}"))?;
    stack.start_api().await?;
    rest.publish("k", json!(2)).await?;
    receiver.wait_at("/k", 2, Duration::from_secs(20)).await;
    assert!(verified(1), "signed after the old key was retired");
    let kept = receiver.wait_at("/kh", 2, Duration::from_secs(20)).await;
    assert!(kept.len() == 2 && kept.iter().all(|r| r.header("x-kept") == "through-every-key"), "headers sent under every key");
    pg.close().await;
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn production_refuses_to_start_without_a_proper_key_or_with_dev_allowances() -> anyhow::Result<()> {
    use base64::{Engine, engine::general_purpose::STANDARD};
    let certs = std::env::temp_dir().join(format!("relay-test-prod-{}", uuid::Uuid::new_v4().simple()));
    relay_devkit::generate_pki()?.write(&certs)?;
    let run = |extra: &[(&str, String)]| -> anyhow::Result<(bool, String)> {
        let out = std::process::Command::new(relay_tests::binary("relay-api")?)
            .env_clear()
            .env("RELAY_ENV", "production")
            .env("RELAY_TLS_CLIENT_CA", certs.join("ca.pem"))
            .env("RELAY_TLS_CERT", certs.join("api.pem"))
            .env("RELAY_TLS_KEY", certs.join("api-key.pem"))
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .envs(extra.iter().map(|(k, v)| (*k, v.as_str())))
            .output()?;
        Ok((out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned()))
    };
    let (ok, err) = run(&[])?;
    assert!(!ok && err.contains("RELAY_SECRET_KEYS is required in production"), "{err}");
    let (ok, err) = run(&[("RELAY_SECRET_KEYS", format!("k:{}", STANDARD.encode([9u8; 16])))])?;
    assert!(!ok && err.contains("RELAY_SECRET_KEYS") && err.contains("32 bytes, got 16"), "{err}");
    let good = ("RELAY_SECRET_KEYS", format!("k:{}", STANDARD.encode([9u8; 32])));
    let (ok, err) = run(&[good.clone(), ("RELAY_DEV_ALLOW_HTTP_ENDPOINTS", "true".into())])?;
    assert!(!ok && err.contains("RELAY_DEV_ALLOW_HTTP_ENDPOINTS"), "{err}");
    let (ok, err) = run(&[good.clone(), ("RELAY_DEV_ALLOWED_ENDPOINT_RANGES", "10.0.0.0/8".into())])?;
    assert!(!ok && err.contains("RELAY_DEV_ALLOWED_ENDPOINT_RANGES"), "{err}");
    let (ok, err) = run(&[good.clone(), ("RELAY_DEV_CIRCUIT_OFF", "true".into())])?;
    assert!(!ok && err.contains("RELAY_DEV_CIRCUIT_OFF"), "{err}");
    let (ok, err) = run(&[good.clone(), ("RELAY_RETRY_TIERS", "0,10".into())])?;
    assert!(!ok && err.contains("RELAY_RETRY_TIERS"), "{err}");
    // Portal links must be https: the public address is required, and an
    // http one is refused.
    let (ok, err) = run(std::slice::from_ref(&good))?;
    assert!(!ok && err.contains("RELAY_PUBLIC_URL must be the https://"), "{err}");
    let (ok, err) = run(&[good.clone(), ("RELAY_PUBLIC_URL", "http://webhooks.example.com".into())])?;
    assert!(!ok && err.contains("RELAY_PUBLIC_URL must be the https://"), "{err}");
    let good_url = ("RELAY_PUBLIC_URL", "https://webhooks.example.com".to_string());
    // Streams on one NATS node: refused unless said out loud; the override
    // taken, the next check (a server list with a hole) is the one that speaks.
    let (ok, err) = run(&[good.clone(), good_url.clone()])?;
    assert!(!ok && err.contains("RELAY_STREAM_REPLICAS is 1"), "{err}");
    let (ok, err) = run(&[
        good,
        good_url,
        ("RELAY_ALLOW_FEWER_STREAM_REPLICAS", "true".into()),
        ("RELAY_NATS_URL", "nats://127.0.0.1:4222,,nats://127.0.0.1:4223".into()),
    ])?;
    assert!(!ok && !err.contains("RELAY_STREAM_REPLICAS") && err.contains("server 2 of them is empty"), "{err}");
    let _ = std::fs::remove_dir_all(&certs);
    Ok(())
}
