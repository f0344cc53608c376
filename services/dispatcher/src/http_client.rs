//! The client that sends webhooks: never follows redirects, and resolves
//! names itself, refusing any name with a blocked address before connecting
//! to the addresses it checked.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use relay_netguard::Policy;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Resolves with the system resolver and keeps the answer only if every
/// address is permitted; reqwest then connects to exactly these addresses.
#[derive(Debug, Clone)]
struct GuardedResolver {
    policy: Arc<Policy>,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let ips: Vec<_> = addrs.iter().map(|a| a.ip()).collect();
            policy.check_addresses(&host, &ips)?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

pub fn build(policy: Arc<Policy>, timeout: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(timeout)
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(4)
        .user_agent(concat!("Relay-Webhooks/", env!("CARGO_PKG_VERSION")))
        .dns_resolver(Arc::new(GuardedResolver { policy }))
        .build()
        .context("building the webhook HTTP client")
}
