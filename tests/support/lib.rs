//! Test harness: a fresh database per test, stream names per test, the real
//! api and dispatcher started in-process on port 0, and HTTP receivers on
//! loopback. Everything talks to the real Postgres and NATS on 127.0.0.1.
//!
//! One module per thing a test stands up (`stack`, `receiver`, `rest`,
//! `process`, `nats`, `postgres`, `browser`), each re-exported here; they
//! share this file's imports (`use super::*`). `load` and `flaky` are the
//! torture's and the matrix's load and receivers, `otlp` a trace collector.

pub mod flaky;
pub mod load;
pub mod otlp;

mod browser;
mod db;
mod nats;
mod options;
mod postgres;
mod process;
mod proxy;
mod receiver;
mod rest;
mod rng;
mod stack;
mod tls;
mod token_server;
pub use browser::*;
pub use db::*;
pub use nats::*;
pub use options::*;
pub use postgres::*;
pub use process::*;
pub use proxy::*;
pub use receiver::*;
pub use rest::*;
pub use rng::*;
pub use stack::*;
pub use tls::*;
pub use token_server::*;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use axum::{Router, body::Bytes, http::HeaderMap};
use relay_api::{Listeners, RunningApi, config::ApiConfig, secrets::Keyring};
use relay_contracts::relay::admin::v1::admin_service_client::AdminServiceClient;
use relay_dispatcher::{DispatcherConfig, RunningDispatcher};
use relay_domain::{health::CircuitPolicy, schedule::RetrySchedule};
use relay_netguard::Policy;
use sqlx::{Connection, Executor, PgConnection};
use tokio::net::TcpListener;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use uuid::Uuid;

pub const PG_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// One `v1=<hex>` signature entry, computed from `docs/webhooks.md` alone
/// and deliberately not by calling the project's signer: HMAC-SHA256 keyed
/// with the secret's UTF-8 bytes over `v1:<timestamp>:<raw body>`, lowercase hex.
pub fn contract_signature(secret: &str, timestamp: &str, body: &[u8]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(format!("v1:{timestamp}:").as_bytes());
    mac.update(body);
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `within`.
pub async fn eventually<T, F, Fut>(within: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Python of the verifiers' venv (`RELAY_VERIFIERS_PYTHON`, else where
/// `deploy/local/services.sh ensure_verifiers` puts it); an error saying how
/// to install it when it is not there.
pub fn verifiers_python() -> Result<PathBuf> {
    let python = std::env::var("RELAY_VERIFIERS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.relay/verifiers/bin/python"));
    anyhow::ensure!(
        python.exists(),
        "the verifiers' Python is not installed ({}): deploy/local/test installs it (deploy/local/services.sh ensure_verifiers)",
        python.display()
    );
    Ok(python)
}
