//! `relay-dev`: what a developer runs beside a local stack — the dev
//! certificates, an environment and key to start with, and a receiver on
//! 127.0.0.1 that verifies each webhook's signature with
//! `relay-webhook-verify` (the receiver-side crate customers use) under
//! whichever scheme it came signed with, and prints it.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, Result};
use axum::{Router, body::Bytes, http::HeaderMap, routing::post};
use clap::{Parser, Subcommand};
use relay_webhook_verify::Verifier;

mod listen;

/// Tools for a local Relay: certificates, a first environment, a receiver.
#[derive(Parser)]
#[command(name = "relay-dev", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a dev CA and the internal port's certificates into a directory.
    Certs {
        /// Where the PEM files go (created if missing).
        dir: PathBuf,
    },
    /// Listen on 127.0.0.1 and print each webhook with its signature's verdict.
    Receive {
        /// The port to listen on.
        #[arg(long, default_value_t = 9000)]
        port: u16,
        /// The endpoint's signing secret (relay-v1 or standard-webhooks);
        /// without it or a public key, webhooks are printed unverified.
        #[arg(long, env = "RELAY_RECEIVER_SECRET", hide_env_values = true)]
        secret: Option<String>,
        /// The `whpk_` public key (standard-webhooks-ed25519).
        #[arg(long, env = "RELAY_RECEIVER_PUBLIC_KEY")]
        public_key: Option<String>,
    },
    /// Create an environment and an API key through the AdminService, as an
    /// operator, and print `RELAY_ENVIRONMENT_ID=…` and `RELAY_API_KEY=…`.
    Bootstrap {
        /// The api's internal port, e.g. https://127.0.0.1:50051.
        internal_url: String,
        /// The directory `relay-dev certs` wrote (ca.pem, operator.pem, operator-key.pem).
        certs_dir: PathBuf,
        /// The new environment's name.
        name: String,
    },
    /// Receive this environment's webhooks on this machine: a temporary
    /// endpoint over a call to the api, each delivery forwarded to a local
    /// URL exactly as a webhook, its answer reported as the attempt's
    /// outcome. The endpoint goes when this stops.
    Listen {
        /// The environment's API key.
        #[arg(long, env = "RELAY_API_KEY", hide_env_values = true)]
        api_key: String,
        /// The api's tenant gRPC address.
        #[arg(long, env = "RELAY_GRPC_URL", default_value = "http://127.0.0.1:50051")]
        api: String,
        /// The event types to receive, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        events: Vec<String>,
        /// Where to send each webhook, e.g. http://localhost:3000/webhooks.
        #[arg(long)]
        forward_to: String,
    },
    /// Print a completion script for a shell (bash, zsh, fish, …) and exit.
    Completions(relay_config::cli::Completions),
}

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Certs { dir } => {
            relay_devkit::generate_pki()?.write(&dir)?;
            println!("wrote dev certificates to {}", dir.display());
            Ok(())
        }
        Command::Receive { port, secret, public_key } => {
            let given = |v: Option<String>| v.filter(|s| !s.is_empty());
            receive(port, given(secret), given(public_key)).await
        }
        Command::Bootstrap { internal_url, certs_dir, name } => bootstrap(&internal_url, certs_dir, &name).await,
        Command::Listen { api_key, api, events, forward_to } => {
            let api = if api.contains("://") { api } else { format!("http://{api}") };
            listen::listen(listen::Args { api_key, api, events, forward_to }).await
        }
        Command::Completions(c) => {
            c.print::<Cli>("relay-dev")?;
            Ok(())
        }
    }
}

/// Creates an environment and an API key through the AdminService, as an
/// operator, and prints `RELAY_ENVIRONMENT_ID=…` and `RELAY_API_KEY=…` lines.
async fn bootstrap(url: &str, dir: PathBuf, name: &str) -> Result<()> {
    use relay_contracts::relay::admin::v1::{CreateApiKeyRequest, CreateEnvironmentRequest, admin_service_client::AdminServiceClient};
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let read = |f: &str| std::fs::read(dir.join(f)).with_context(|| format!("reading {f}"));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")?))
        .identity(Identity::from_pem(read("operator.pem")?, read("operator-key.pem")?))
        .domain_name(relay_devkit::API_TLS_NAME);
    let channel =
        Channel::from_shared(url.to_owned())?.tls_config(tls)?.connect().await.context("connecting to the api's internal port")?;
    let mut admin = AdminServiceClient::new(channel);
    let env = admin
        .create_environment(CreateEnvironmentRequest { name: name.to_owned(), endpoint_quota: 0 })
        .await?
        .into_inner()
        .environment
        .context("no environment returned")?;
    let key = admin.create_api_key(CreateApiKeyRequest { environment_id: env.id.clone(), name: "local".into() }).await?.into_inner();
    println!("RELAY_ENVIRONMENT_ID={}", env.id);
    println!("RELAY_API_KEY={}", key.key);
    Ok(())
}

async fn receive(port: u16, secret: Option<String>, public_key: Option<String>) -> Result<()> {
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
