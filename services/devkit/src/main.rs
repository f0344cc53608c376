//! `relay-dev certs <dir>`: write a dev CA and the internal port's certificates.
//! `relay-dev receive [--port N] [--secret S] [--public-key K]`: listen on
//! 127.0.0.1, verify each webhook's signature with `relay-webhook-verify` (the
//! receiver-side crate customers use) under whichever scheme it came signed
//! with, and print it. The secret (relay-v1 or standard-webhooks) may also
//! come from `RELAY_RECEIVER_SECRET`, the `whpk_` public key
//! (standard-webhooks-ed25519) from `RELAY_RECEIVER_PUBLIC_KEY`; without
//! either, webhooks are printed unverified.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, Result, bail};
use axum::{Router, body::Bytes, http::HeaderMap, routing::post};
use relay_webhook_verify::Verifier;

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("certs") => {
            let dir = PathBuf::from(args.get(1).context("usage: relay-dev certs <dir>")?);
            relay_devkit::generate_pki()?.write(&dir)?;
            println!("wrote dev certificates to {}", dir.display());
            Ok(())
        }
        Some("receive") => receive(&args[1..]).await,
        Some("bootstrap") => bootstrap(&args[1..]).await,
        _ => bail!(
            "usage: relay-dev certs <dir> | relay-dev receive [--port N] [--secret S] | relay-dev bootstrap <internal-url> <certs-dir> <name>"
        ),
    }
}

/// Creates an environment and an API key through the AdminService, as an
/// operator, and prints `RELAY_ENVIRONMENT_ID=…` and `RELAY_API_KEY=…` lines.
async fn bootstrap(args: &[String]) -> Result<()> {
    use relay_contracts::relay::admin::v1::{CreateApiKeyRequest, CreateEnvironmentRequest, admin_service_client::AdminServiceClient};
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let [url, dir, name] = args else { bail!("usage: relay-dev bootstrap <internal-url> <certs-dir> <name>") };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = PathBuf::from(dir);
    let read = |f: &str| std::fs::read(dir.join(f)).with_context(|| format!("reading {f}"));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")?))
        .identity(Identity::from_pem(read("operator.pem")?, read("operator-key.pem")?))
        .domain_name(relay_devkit::API_TLS_NAME);
    let channel = Channel::from_shared(url.clone())?.tls_config(tls)?.connect().await.context("connecting to the api's internal port")?;
    let mut admin = AdminServiceClient::new(channel);
    let env = admin
        .create_environment(CreateEnvironmentRequest { name: name.clone(), endpoint_quota: 0 })
        .await?
        .into_inner()
        .environment
        .context("no environment returned")?;
    let key = admin.create_api_key(CreateApiKeyRequest { environment_id: env.id.clone(), name: "local".into() }).await?.into_inner();
    println!("RELAY_ENVIRONMENT_ID={}", env.id);
    println!("RELAY_API_KEY={}", key.key);
    Ok(())
}

async fn receive(args: &[String]) -> Result<()> {
    let mut port = 9000u16;
    let from_env = |name: &str| std::env::var(name).ok().filter(|s| !s.is_empty());
    let mut secret = from_env("RELAY_RECEIVER_SECRET");
    let mut public_key = from_env("RELAY_RECEIVER_PUBLIC_KEY");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--port" => port = it.next().context("--port needs a value")?.parse().context("--port")?,
            "--secret" => secret = Some(it.next().context("--secret needs a value")?.clone()),
            "--public-key" => public_key = Some(it.next().context("--public-key needs a value")?.clone()),
            other => bail!("unknown argument {other:?}"),
        }
    }
    // A secret verifies relay-v1 and, when it is Standard Webhooks base64
    // (every secret Relay mints now), standard-webhooks too.
    let mut verifier: Option<Verifier> = None;
    let mut add = |v: Verifier| {
        verifier = Some(match verifier.take() {
            Some(all) => all.or(v),
            None => v,
        })
    };
    if let Some(s) = &secret {
        add(Verifier::relay_v1(s));
        if let Ok(v) = Verifier::standard(s) {
            add(v);
        }
    }
    if let Some(k) = &public_key {
        add(Verifier::ed25519(k).context("--public-key")?);
    }
    let app = Router::new().fallback(post(move |headers: HeaderMap, body: Bytes| {
        let verifier = verifier.clone();
        async move {
            let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let (id, ts) = match h("relay-webhook-id") {
                id if !id.is_empty() => (id, h("relay-webhook-timestamp")),
                _ => (h("webhook-id"), h("webhook-timestamp")),
            };
            let verdict = match &verifier {
                None => "unverified (no secret or public key given)".to_owned(),
                Some(v) => match v.verify(&headers, &body) {
                    Ok(_) => "signature OK".to_owned(),
                    Err(e) => format!("signature REJECTED: {e}"),
                },
            };
            println!("webhook {id} at {ts} — {verdict}\n  {}", String::from_utf8_lossy(&body));
            "ok"
        }
    }));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    println!("relay-dev receiver listening on http://{addr}/ (any path)");
    axum::serve(listener, app).await?;
    Ok(())
}
