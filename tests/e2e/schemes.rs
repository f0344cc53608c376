//! Signature schemes (issue 13): deliveries of the two Standard Webhooks
//! schemes, captured at a loopback receiver, are verified by other people's
//! code — the PyPI packages `standardwebhooks` and `svix`, the npm package
//! `standardwebhooks`, and for ed25519 a check written from the
//! specification with Python's `cryptography` (tests/verifiers/) — including
//! during a rotation, and a scheme change signs the next attempt.

use std::{path::PathBuf, process::Command, time::Duration};

use anyhow::{Context, Result, ensure};
use base64::{Engine, engine::general_purpose::STANDARD};
use relay_tests::{Options, Received, Receiver, Reply, Rest, Stack, contract_signature, eventually};
use reqwest::Method;
use serde_json::{Value, json};

fn verifiers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("verifiers")
}

/// One captured delivery as the verifier scripts read it.
fn capture(name: &str, scheme: &str, r: &Received, secrets: &[&str], public_keys: &[&str], entries: usize) -> Value {
    let headers: serde_json::Map<String, Value> =
        ["webhook-id", "webhook-timestamp", "webhook-signature"].into_iter().map(|h| (h.to_owned(), Value::String(r.header(h)))).collect();
    json!({
        "name": name, "scheme": scheme, "headers": headers, "body_b64": STANDARD.encode(&r.body),
        "secrets": secrets, "public_keys": public_keys, "entries": entries,
    })
}

/// Runs both verifier scripts over the captures; fails with their output
/// unless every check passed. Returns their output.
fn verify_with_other_libraries(deliveries: Vec<Value>) -> Result<String> {
    let dir = tempfile_dir()?;
    let path = dir.join("capture.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&json!({ "deliveries": deliveries }))?)?;
    let python = relay_tests::verifiers_python()?;
    ensure!(
        verifiers_dir().join("node_modules/standardwebhooks").exists(),
        "tests/verifiers/node_modules is not installed: deploy/local/test installs it (deploy/local/services.sh ensure_verifiers)"
    );
    let mut said = String::new();
    for (program, script) in [(python.as_os_str().to_owned(), "verify.py"), ("node".into(), "verify.mjs")] {
        let out =
            Command::new(&program).arg(verifiers_dir().join(script)).arg(&path).output().with_context(|| format!("running {script}"))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        ensure!(out.status.success(), "{script} failed:\n{text}");
        said.push_str(&text);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(said)
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("relay-schemes-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn create(rest: &Rest, url: &str, scheme: Option<&str>) -> Result<Value> {
    let mut body = json!({"url": url, "event_types": ["s"]});
    if let Some(s) = scheme {
        body["signature_scheme"] = json!(s);
    }
    let (status, body) = rest.post("/v1/webhooks", body).await?;
    ensure!(status == 201, "creating an endpoint answered {status}: {body}");
    Ok(body)
}

async fn patch(rest: &Rest, id: &str, body: Value) -> Result<(u16, Value)> {
    rest.call(Method::PATCH, &format!("/v1/webhooks/{id}"), Some(body)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_webhooks_deliveries_verify_with_the_published_libraries_during_a_rotation_too() -> Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("schemes").await?;
    let receiver = Receiver::start_https().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));

    let hmac = create(&rest, &receiver.url("/hmac"), Some("standard-webhooks")).await?;
    let ed = create(&rest, &receiver.url("/ed"), Some("standard-webhooks-ed25519")).await?;
    let v1 = create(&rest, &receiver.url("/v1"), None).await?;
    let secret = hmac["secret"].as_str().unwrap().to_owned();
    let decoded = STANDARD.decode(secret.strip_prefix("whsec_").context("whsec_ prefix")?)?;
    assert_eq!(decoded.len(), 32, "a secret is whsec_ + standard base64 of 32 bytes: {secret}");
    assert_eq!(hmac["endpoint"]["signature_scheme"], "standard-webhooks");
    assert_eq!(ed["secret"], "", "an ed25519 endpoint shows no secret: {ed}");
    let public = ed["endpoint"]["public_key"].as_str().context("an ed25519 endpoint shows its public key")?.to_owned();
    assert!(public.starts_with("whpk_") && STANDARD.decode(&public[5..])?.len() == 32, "{public}");
    assert_eq!(v1["endpoint"]["signature_scheme"], "relay-v1", "relay-v1 is the default");
    assert!(v1["endpoint"].get("public_key").is_none(), "{v1}");

    let event = rest.publish("s", json!({"n": 1, "text": "grüße"})).await?;
    let first_hmac = receiver.wait_at("/hmac", 1, Duration::from_secs(20)).await.remove(0);
    let first_ed = receiver.wait_at("/ed", 1, Duration::from_secs(20)).await.remove(0);
    let first_v1 = receiver.wait_at("/v1", 1, Duration::from_secs(20)).await.remove(0);
    for r in [&first_hmac, &first_ed] {
        assert_eq!(r.header("webhook-id"), event, "webhook-id is the event id");
        assert!(r.header("relay-webhook-signature").is_empty(), "one scheme's headers only");
    }
    let v1_secret = v1["secret"].as_str().unwrap();
    let ts = first_v1.header("relay-webhook-timestamp");
    assert_eq!(first_v1.header("relay-webhook-signature"), contract_signature(v1_secret, &ts, &first_v1.body), "relay-v1 unchanged");
    assert!(first_v1.header("webhook-signature").is_empty());

    // A rotation: both sign, the new one first.
    let (status, rotated) =
        rest.post(&format!("/v1/webhooks/{}/rotate-secret", hmac["endpoint"]["id"].as_str().unwrap()), json!({})).await?;
    assert_eq!(status, 200, "{rotated}");
    let new_secret = rotated["secret"].as_str().unwrap().to_owned();
    let (status, rotated_ed) =
        rest.post(&format!("/v1/webhooks/{}/rotate-secret", ed["endpoint"]["id"].as_str().unwrap()), json!({})).await?;
    assert_eq!(status, 200, "{rotated_ed}");
    assert_eq!(rotated_ed["secret"], "", "a key pair's rotation shows no secret");
    let new_public = rotated_ed["endpoint"]["public_key"].as_str().unwrap().to_owned();
    assert_ne!(new_public, public);
    assert_eq!(rotated_ed["endpoint"]["previous_public_key"], public.as_str(), "the previous key is shown while it signs");

    rest.publish("s", json!({"n": 2})).await?;
    let second_hmac = receiver.wait_at("/hmac", 2, Duration::from_secs(20)).await.remove(1);
    let second_ed = receiver.wait_at("/ed", 2, Duration::from_secs(20)).await.remove(1);

    let said = verify_with_other_libraries(vec![
        capture("first (hmac)", "standard-webhooks", &first_hmac, &[&secret], &[], 1),
        capture("first (ed25519)", "standard-webhooks-ed25519", &first_ed, &[], &[&public], 1),
        capture("rotating (hmac)", "standard-webhooks", &second_hmac, &[&new_secret, &secret], &[], 2),
        capture("rotating (ed25519)", "standard-webhooks-ed25519", &second_ed, &[], &[&new_public, &public], 2),
    ])?;
    println!("{said}");
    // The scripts count what they checked; an empty capture would pass vacuously.
    assert!(said.contains("python verifiers: 35 of 35 checks passed"), "{said}");
    assert!(said.contains("node verifiers: 9 of 9 checks passed"), "{said}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheme_change_signs_the_next_attempt_and_crossing_to_a_key_pair_and_back_mints_material() -> Result<()> {
    let stack = Stack::start(Options::default().tiers("0,300,300,300,300,300,300")).await?;
    let tenant = stack.tenant("switch").await?;
    let receiver = Receiver::start_https().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let created = create(&rest, &receiver.url("/r"), None).await?;
    let id = created["endpoint"]["id"].as_str().unwrap().to_owned();
    let secret = created["secret"].as_str().unwrap().to_owned();

    // Bad input names the mistake.
    let (status, body) = patch(&rest, &id, json!({"signature_scheme": "hmac"})).await?;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("relay-v1, standard-webhooks, standard-webhooks-ed25519"), "{body}");
    let (status, body) = patch(&rest, &uuid::Uuid::now_v7().to_string(), json!({"signature_scheme": "relay-v1"})).await?;
    assert_eq!(status, 404, "{body}");

    // First attempt under relay-v1 fails; the scheme changes; the retry is
    // signed the new way with the same secret.
    receiver.reply("/r", Reply::Status(500));
    let retried_event = rest.publish("s", json!({"retry": true})).await?;
    let failed = receiver.wait_at("/r", 1, Duration::from_secs(20)).await.remove(0);
    assert!(!failed.header("relay-webhook-signature").is_empty());
    let (status, switched) = patch(&rest, &id, json!({"signature_scheme": "standard-webhooks"})).await?;
    assert_eq!(status, 200, "{switched}");
    assert_eq!(switched["secret"], "", "a symmetric switch keeps the secret");
    assert_eq!(switched["endpoint"]["signature_scheme"], "standard-webhooks");
    assert!(switched["endpoint"]["signature_scheme_changed_at"].is_string(), "the change is recorded: {switched}");
    receiver.reply("/r", Reply::Status(200));
    let retried = receiver.wait_at("/r", 2, Duration::from_secs(20)).await.remove(1);
    assert_eq!(retried.header("webhook-id"), failed.header("relay-webhook-id"), "the same message id across attempts");
    assert!(retried.header("relay-webhook-signature").is_empty());
    // The attempt log records which scheme signed each attempt.
    let logged = eventually(Duration::from_secs(10), || async {
        let d = rest.deliveries(&retried_event).await.ok()?;
        let attempts = d.first()?["attempts"].as_array()?.clone();
        (attempts.len() == 2).then_some(attempts)
    })
    .await
    .context("both attempts logged")?;
    let schemes: Vec<&str> = logged.iter().map(|a| a["signature_scheme"].as_str().unwrap_or("")).collect();
    assert_eq!(schemes, ["relay-v1", "standard-webhooks"], "{logged:?}");

    // To a key pair: the secret is replaced, the public key shown.
    let (status, to_ed) = patch(&rest, &id, json!({"signature_scheme": "standard-webhooks-ed25519"})).await?;
    assert_eq!(status, 200, "{to_ed}");
    assert_eq!(to_ed["secret"], "");
    let public = to_ed["endpoint"]["public_key"].as_str().context("public key")?.to_owned();
    rest.publish("s", json!({"n": 3})).await?;
    let signed_ed = receiver.wait_at("/r", 3, Duration::from_secs(20)).await.remove(2);

    // And back: a new secret, shown once; the url and event types change too.
    let (status, back) =
        patch(&rest, &id, json!({"signature_scheme": "standard-webhooks", "url": receiver.url("/back"), "event_types": ["t"]})).await?;
    assert_eq!(status, 200, "{back}");
    let minted = back["secret"].as_str().unwrap().to_owned();
    assert!(minted.starts_with("whsec_") && minted != secret, "{back}");
    assert!(back["endpoint"].get("public_key").is_none(), "{back}");
    assert_eq!(back["endpoint"]["event_types"], json!(["t"]));
    let read = rest.get(&format!("/v1/webhooks/{id}")).await?;
    assert!(!read.to_string().contains(&minted), "a read never shows the secret");
    rest.publish("t", json!({"n": 4})).await?;
    let signed_back = receiver.wait_at("/back", 1, Duration::from_secs(20)).await.remove(0);

    let said = verify_with_other_libraries(vec![
        capture("retry after the switch", "standard-webhooks", &retried, &[&secret], &[], 1),
        capture("after the switch to ed25519", "standard-webhooks-ed25519", &signed_ed, &[], &[&public], 1),
        capture("back to hmac", "standard-webhooks", &signed_back, &[&minted], &[], 1),
    ])?;
    assert!(said.contains("python verifiers: 20 of 20 checks passed"), "{said}");
    assert!(said.contains("node verifiers: 6 of 6 checks passed"), "two hmac captures, three checks each: {said}");
    stack.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_minted_before_standard_webhooks_must_be_rotated_before_the_switch() -> Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let tenant = stack.tenant("legacy").await?;
    let receiver = Receiver::start_https().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let created = create(&rest, &receiver.url("/r"), None).await?;
    let id = created["endpoint"]["id"].as_str().unwrap().to_owned();

    // What Relay minted until now: URL-safe base64 without padding, which
    // the Standard Webhooks libraries would misread as another key.
    let legacy = "whsec_Ab-cd_EfGhIjKlMnOpQrStUvWxYz0123456789abcd";
    let (key_id, ciphertext) = relay_api::secrets::Keyring::development().encrypt(&relay_signing::SigningSecret::new(legacy));
    sqlx::query("UPDATE webhook_endpoints SET secret_key_id = $2, secret_ciphertext = $3 WHERE id = $1::uuid")
        .bind(&id)
        .bind(key_id)
        .bind(ciphertext)
        .execute(&stack.pg().await?)
        .await?;
    let (status, body) = patch(&rest, &id, json!({"signature_scheme": "standard-webhooks"})).await?;
    assert_eq!((status, body["reason"].as_str()), (400, Some("secret_not_standard_webhooks")), "{body}");
    assert!(body.to_string().contains("rotate-secret"), "the answer says what to do: {body}");

    // Rotated, it switches; the legacy secret, still in its window, is left
    // out of the Standard Webhooks header rather than misused.
    let (status, rotated) = rest.post(&format!("/v1/webhooks/{id}/rotate-secret"), json!({})).await?;
    assert_eq!(status, 200, "{rotated}");
    let new_secret = rotated["secret"].as_str().unwrap().to_owned();
    let (status, body) = patch(&rest, &id, json!({"signature_scheme": "standard-webhooks"})).await?;
    assert_eq!(status, 200, "{body}");
    rest.publish("s", json!({})).await?;
    let r = receiver.wait_at("/r", 1, Duration::from_secs(20)).await.remove(0);
    let said = verify_with_other_libraries(vec![capture("legacy left out", "standard-webhooks", &r, &[&new_secret], &[], 1)])?;
    assert!(said.contains("python verifiers: 7 of 7 checks passed"), "{said}");
    assert!(said.contains("node verifiers: 3 of 3 checks passed"), "{said}");
    stack.stop().await
}
