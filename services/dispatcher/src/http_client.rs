//! The client that sends webhooks: never follows redirects, and resolves
//! names itself, refusing any name with a blocked address before connecting
//! to exactly the addresses it checked (no second lookup, so DNS rebinding
//! between check and connect is impossible).
//!
//! An endpoint with TLS of its own (a client certificate to present, a CA
//! bundle to pin) is sent to by a client built the same way plus that TLS,
//! kept by the digest of its TLS material and shared by every lane; a
//! changed certificate is another digest, so another client.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use relay_netguard::{Policy, Resolve};
use reqwest::dns::{Addrs, Name, Resolving};
use sha2::{Digest, Sha256};

/// reqwest's resolver: one lookup, every address checked, and reqwest then
/// connects to these addresses only.
#[derive(Debug, Clone)]
struct GuardedResolver {
    policy: Arc<Policy>,
    resolver: Arc<dyn Resolve>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let (policy, resolver) = (self.policy.clone(), self.resolver.clone());
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let ips = resolver.lookup(&host).await?;
            policy.check_addresses(&host, &ips)?;
            Ok(Box::new(ips.into_iter().map(|ip| SocketAddr::new(ip, 0))) as Addrs)
        })
    }
}

/// Everything an attempt needs to reach an endpoint safely.
#[derive(Debug, Clone)]
pub struct Sender {
    pub client: reqwest::Client,
    pub policy: Arc<Policy>,
    pub resolver: Arc<dyn Resolve>,
    /// With a proxy, the proxy connects to the target, so the target is
    /// resolved and checked here before the request is handed to it.
    pub via_proxy: bool,
    shape: Shape,
    with_tls: Arc<Mutex<HashMap<[u8; 32], reqwest::Client>>>,
    /// OAuth2 tokens, shared by every lane of this process.
    pub tokens: Arc<crate::oauth2::Tokens>,
    /// Where attempts to listeners' endpoints go (`crate::listen`).
    pub listen: Option<Arc<crate::listen::Route>>,
}

/// How every client is built (so that one with an endpoint's TLS differs
/// from the shared one in its TLS alone).
#[derive(Debug, Clone)]
struct Shape {
    proxy: Option<String>,
    source_address: Option<std::net::IpAddr>,
    timeout: Duration,
    /// CAs trusted besides the platform's roots (PEM), for endpoints that
    /// pin none of their own.
    receiver_ca: Option<Vec<u8>>,
}

/// Clients with an endpoint's own TLS kept at once; past this the cache
/// starts over (each is rebuilt on its endpoint's next attempt).
const TLS_CLIENTS_KEPT: usize = 1024;

impl Sender {
    /// The client for an endpoint: the shared one, or one presenting its
    /// client certificate and trusting its pinned CA bundle alone. An error
    /// names what could not be loaded (the attempt fails with it).
    pub fn client_for(&self, identity_pem: &str, ca_bundle: &str) -> Result<reqwest::Client, String> {
        if identity_pem.is_empty() && ca_bundle.is_empty() {
            return Ok(self.client.clone());
        }
        let mut digest = Sha256::new();
        digest.update(identity_pem.as_bytes());
        digest.update([0]);
        digest.update(ca_bundle.as_bytes());
        let key: [u8; 32] = digest.finalize().into();
        if let Some(c) = self.with_tls.lock().expect("not poisoned").get(&key) {
            return Ok(c.clone());
        }
        let mut b = builder(&self.policy, &self.resolver, &self.shape, !ca_bundle.is_empty()).map_err(|e| format!("tls: {e:#}"))?;
        if !identity_pem.is_empty() {
            let identity = reqwest::Identity::from_pem(identity_pem.as_bytes())
                .map_err(|e| format!("tls: the endpoint's client certificate cannot be loaded: {e}"))?;
            b = b.identity(identity);
        }
        if !ca_bundle.is_empty() {
            let roots = reqwest::Certificate::from_pem_bundle(ca_bundle.as_bytes())
                .map_err(|e| format!("tls: the endpoint's CA bundle cannot be loaded: {e}"))?;
            b = b.tls_certs_only(roots);
        }
        let client = b.build().map_err(|e| format!("tls: a client with the endpoint's TLS cannot be built: {e}"))?;
        let mut kept = self.with_tls.lock().expect("not poisoned");
        if kept.len() >= TLS_CLIENTS_KEPT {
            kept.clear();
        }
        kept.insert(key, client.clone());
        Ok(client)
    }
}

/// Idle connections kept per receiving host.
const IDLE_CONNECTIONS_PER_HOST: usize = 256;

pub fn build(
    policy: Arc<Policy>,
    resolver: Arc<dyn Resolve>,
    proxy: Option<&str>,
    source_address: Option<std::net::IpAddr>,
    timeout: Duration,
    receiver_ca: Option<Vec<u8>>,
) -> Result<Sender> {
    let shape = Shape { proxy: proxy.map(str::to_owned), source_address, timeout, receiver_ca };
    let client = builder(&policy, &resolver, &shape, false)?.build().context("building the webhook HTTP client")?;
    Ok(Sender {
        client,
        policy,
        resolver,
        via_proxy: proxy.is_some(),
        shape,
        with_tls: Arc::default(),
        tokens: Arc::default(),
        listen: None,
    })
}

/// A client's common shape; `pinned`: the endpoint brings its own CAs, so
/// the platform-wide extra ones are not added.
fn builder(policy: &Arc<Policy>, resolver: &Arc<dyn Resolve>, shape: &Shape, pinned: bool) -> Result<reqwest::ClientBuilder> {
    let Shape { proxy, source_address, timeout, receiver_ca } = shape;
    let (source_address, timeout) = (*source_address, *timeout);
    let b = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(timeout)
        .pool_idle_timeout(Duration::from_secs(60))
        // Connections are pooled per host, not per endpoint: many endpoints
        // of one receiver (a tenant's ingest host, a shared gateway) each
        // keep a lane sending back to back, and with fewer idle connections
        // kept than lanes every POST past them opened a connection of its
        // own (connect and shutdown were a fifth of the dispatcher's CPU
        // with 10 endpoints on one host). Each lane holds at most one.
        .pool_max_idle_per_host(IDLE_CONNECTIONS_PER_HOST)
        .user_agent(concat!("Relay-Webhooks/", env!("CARGO_PKG_VERSION")))
        .local_address(source_address)
        .dns_resolver(Arc::new(GuardedResolver { policy: policy.clone(), resolver: resolver.clone() }));
    let b = match receiver_ca.as_deref().filter(|_| !pinned) {
        Some(pem) => {
            b.tls_certs_merge(reqwest::Certificate::from_pem_bundle(pem).context("RELAY_RECEIVER_CA_FILE is not PEM certificates")?)
        }
        None => b,
    };
    Ok(match proxy {
        Some(p) => b.proxy(reqwest::Proxy::all(p).context("RELAY_EGRESS_PROXY is not a proxy URL")?),
        // Ignore HTTP(S)_PROXY from the environment: a proxy is a decision.
        None => b.no_proxy(),
    })
}
