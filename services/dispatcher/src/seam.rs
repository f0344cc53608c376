//! The dispatcher's client of the api's internal seam, over mTLS with the
//! dispatcher's platform identity.
//!
//! `RELAY_API_INTERNAL_URL` names one api or several (comma-separated). With
//! several, calls go to one of them until a call fails at the transport (the
//! api died, its connection reset, nothing listens): later calls then go to
//! the next in the list. The failed call itself is not repeated here; its
//! caller already treats a seam failure as "nothing was recorded" (a job is
//! left unacked, an outcome is reported again), so moving on is all that is
//! needed for a dispatcher to outlive the api it was talking to. Behind one
//! load-balanced address (a Kubernetes Service) one URL is the right setting.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context as TaskContext, Poll},
};

use anyhow::{Context, Result, bail};
use futures::future::BoxFuture;
use relay_contracts::relay::dispatch::v1::dispatch_service_client::DispatchServiceClient;
use tonic::{
    body::Body,
    transport::{Certificate, Channel, ClientTlsConfig, Identity},
};

use crate::config::DispatcherConfig;

pub type Seam = DispatchServiceClient<Failover>;

/// The apis' channels, and which one calls go to now.
pub struct Failover {
    channels: Arc<[(String, Channel)]>,
    current: Arc<AtomicUsize>,
    /// The channel `poll_ready` made ready, which the next `call` uses.
    picked: Option<(usize, Channel)>,
}

impl Clone for Failover {
    /// A clone shares the channels and the choice, not the channel this one
    /// made ready: readiness is a slot reserved in that channel's buffer,
    /// which a clone of the channel does not hold.
    fn clone(&self) -> Self {
        Self { channels: self.channels.clone(), current: self.current.clone(), picked: None }
    }
}

impl std::fmt::Debug for Failover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failover").field("apis", &self.channels.iter().map(|(u, _)| u).collect::<Vec<_>>()).finish()
    }
}

impl Failover {
    fn new(channels: Vec<(String, Channel)>) -> Self {
        Self { channels: channels.into(), current: Default::default(), picked: None }
    }
}

impl tower::Service<http::Request<Body>> for Failover {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        let (channels, current) = (&self.channels, &self.current);
        let (_, channel) = self.picked.get_or_insert_with(|| {
            let i = current.load(Ordering::Relaxed) % channels.len();
            (i, channels[i].1.clone())
        });
        tower::Service::poll_ready(channel, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let (index, mut channel) = self.picked.take().expect("poll_ready before call");
        let (channels, current) = (self.channels.clone(), self.current.clone());
        let response = tower::Service::call(&mut channel, request);
        Box::pin(async move {
            let result = response.await;
            if let Err(e) = &result
                && channels.len() > 1
            {
                let next = (index + 1) % channels.len();
                // Concurrent failures of the same api move on once.
                if current.compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                    tracing::warn!(failed = %channels[index].0, next = %channels[next].0, error = %e, "the api's seam failed; calling the next api");
                }
            }
            result
        })
    }
}

/// The api URLs `RELAY_API_INTERNAL_URL` lists, in order.
pub fn api_urls(spec: &str) -> Result<Vec<String>> {
    let urls: Vec<String> = spec.split(',').map(|u| u.trim().to_string()).collect();
    for (i, u) in urls.iter().enumerate() {
        if u.is_empty() {
            bail!("RELAY_API_INTERNAL_URL: entry {} of {} is empty", i + 1, urls.len());
        }
    }
    Ok(urls)
}

/// One lazy channel per api `RELAY_API_INTERNAL_URL` lists.
fn channels(cfg: &DispatcherConfig) -> Result<Vec<(String, Channel)>> {
    let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&cfg.tls_ca)?))
        .identity(Identity::from_pem(read(&cfg.tls_cert)?, read(&cfg.tls_key)?))
        .domain_name(cfg.api_tls_name.clone());
    let mut channels = Vec::new();
    for url in api_urls(&cfg.api_url)? {
        // Lazy: the dispatcher starts, and keeps its broker position, while the
        // api is away; calls fail until it returns and jobs come back unacked.
        // The timeout bounds a call until its answer begins, so a stream
        // (`TakeAttempts`) stays open past it.
        let channel = Channel::from_shared(url.clone())
            .with_context(|| format!("RELAY_API_INTERNAL_URL: {url} is not a URI"))?
            .tls_config(tls.clone())
            .context("configuring the seam's TLS")?
            .connect_timeout(std::time::Duration::from_secs(3))
            .timeout(cfg.seam_timeout)
            .connect_lazy();
        channels.push((url, channel));
    }
    Ok(channels)
}

/// A client with the seam's message limits (the same as the api's end, see
/// the contracts).
fn client<T>(inner: T) -> DispatchServiceClient<T>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    DispatchServiceClient::new(inner)
        .max_decoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES)
        .max_encoding_message_size(relay_contracts::SEAM_MESSAGE_LIMIT_BYTES)
}

pub fn connect(cfg: &DispatcherConfig) -> Result<Seam> {
    Ok(client(Failover::new(channels(cfg)?)))
}

/// A client of each api, for what every api must reach: `TakeAttempts`,
/// by which an api sends this dispatcher the first attempts it expanded
/// at publish (see `take`).
pub fn each_api(cfg: &DispatcherConfig) -> Result<Vec<(String, DispatchServiceClient<Channel>)>> {
    Ok(channels(cfg)?.into_iter().map(|(url, channel)| (url, client(channel))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_list_names_an_empty_entry_by_position() {
        assert_eq!(api_urls("https://a:1, https://b:2").expect("valid"), ["https://a:1", "https://b:2"]);
        assert_eq!(api_urls("https://a:1").expect("valid"), ["https://a:1"]);
        let err = api_urls("https://a:1,,https://c:3").expect_err("refused").to_string();
        assert!(err.contains("entry 2 of 3 is empty"), "{err}");
    }
}
