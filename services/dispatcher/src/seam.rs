//! The dispatcher's client of the api's internal seam, over mTLS with the
//! dispatcher's platform identity.

use anyhow::{Context, Result};
use relay_contracts::relay::dispatch::v1::dispatch_service_client::DispatchServiceClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::config::DispatcherConfig;

pub type Seam = DispatchServiceClient<Channel>;

pub fn connect(cfg: &DispatcherConfig) -> Result<Seam> {
    let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&cfg.tls_ca)?))
        .identity(Identity::from_pem(read(&cfg.tls_cert)?, read(&cfg.tls_key)?))
        .domain_name(cfg.api_tls_name.clone());
    // Lazy: the dispatcher starts, and keeps its broker position, while the
    // api is away; calls fail until it returns and jobs come back unacked.
    let channel = Channel::from_shared(cfg.api_url.clone())
        .context("RELAY_API_INTERNAL_URL is not a URI")?
        .tls_config(tls)
        .context("configuring the seam's TLS")?
        .connect_timeout(std::time::Duration::from_secs(3))
        .timeout(cfg.seam_timeout)
        .connect_lazy();
    // The same message limits as the api's end (see the contracts).
    Ok(DispatchServiceClient::new(channel)
        .max_decoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES)
        .max_encoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES))
}
