//! A minimal Relay webhook receiver in Rust (axum + `relay-webhook-verify`):
//! verifies the endpoint's scheme, deduplicates on the event id, answers at
//! once and processes later.
//!
//!     RELAY_SECRET=whsec_... PORT=8000 cargo run -p relay-webhook-verify --example receiver
//!     RELAY_PUBLIC_KEY=whpk_... for a standard-webhooks-ed25519 endpoint
//!
//! docs/receiving/rust.md walks through it.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

use axum::{Router, extract::FromRef, http::StatusCode, routing::post};
use relay_webhook_verify::{VerifiedWebhook, Verifier};
use tokio::sync::mpsc;

#[derive(Clone)]
struct State {
    verifier: Verifier,
    /// In production: a table with a unique key on the event id.
    seen: Arc<Mutex<HashSet<String>>>,
    work: mpsc::UnboundedSender<VerifiedWebhook>,
}

impl FromRef<State> for Verifier {
    fn from_ref(state: &State) -> Verifier {
        state.verifier.clone()
    }
}

/// Runs only for a verified webhook (the extractor answers 400/401 itself).
async fn receive(axum::extract::State(state): axum::extract::State<State>, webhook: VerifiedWebhook) -> StatusCode {
    let fresh = state.seen.lock().expect("not poisoned").insert(webhook.id.clone());
    if fresh {
        let _ = state.work.send(webhook);
    } else {
        println!("duplicate {}", webhook.id);
    }
    // Answer fast: Relay counts anything slower than its timeout as a failure.
    StatusCode::NO_CONTENT
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let verifier = match (std::env::var("RELAY_SECRET"), std::env::var("RELAY_PUBLIC_KEY")) {
        // A secret verifies relay-v1 and, being Standard Webhooks base64,
        // standard-webhooks too.
        (Ok(secret), _) => Verifier::relay_v1(&secret).or(Verifier::standard(&secret)?),
        (_, Ok(public_key)) => Verifier::ed25519(&public_key)?,
        _ => return Err("set RELAY_SECRET or RELAY_PUBLIC_KEY".into()),
    };
    let (work, mut queued) = mpsc::unbounded_channel::<VerifiedWebhook>();
    tokio::spawn(async move {
        while let Some(webhook) = queued.recv().await {
            let event: serde_json::Value = serde_json::from_slice(&webhook.body).unwrap_or_default();
            println!("processed {} {}", webhook.id, event["type"].as_str().unwrap_or("?"));
        }
    });
    let state = State { verifier, seen: Arc::default(), work };
    let app = Router::new().route("/", post(receive)).with_state(state);
    let port: u16 = std::env::var("PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(8000);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on {}", listener.local_addr()?.port());
    axum::serve(listener, app).await?;
    Ok(())
}
