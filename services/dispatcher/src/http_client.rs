//! The client that sends webhooks: never follows redirects, and resolves
//! names itself, refusing any name with a blocked address before connecting
//! to exactly the addresses it checked (no second lookup, so DNS rebinding
//! between check and connect is impossible).

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use relay_netguard::{Policy, Resolve};
use reqwest::dns::{Addrs, Name, Resolving};

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
}

/// Idle connections kept per receiving host.
const IDLE_CONNECTIONS_PER_HOST: usize = 256;

pub fn build(
    policy: Arc<Policy>,
    resolver: Arc<dyn Resolve>,
    proxy: Option<&str>,
    source_address: Option<std::net::IpAddr>,
    timeout: Duration,
) -> Result<Sender> {
    let mut b = reqwest::Client::builder()
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
    b = match proxy {
        Some(p) => b.proxy(reqwest::Proxy::all(p).context("RELAY_EGRESS_PROXY is not a proxy URL")?),
        // Ignore HTTP(S)_PROXY from the environment: a proxy is a decision.
        None => b.no_proxy(),
    };
    Ok(Sender { client: b.build().context("building the webhook HTTP client")?, policy, resolver, via_proxy: proxy.is_some() })
}
