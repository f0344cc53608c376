//! The api's side of NATS JetStream: it creates both streams, because it
//! publishes to both. The dispatcher only consumes.

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::{
    HeaderMap,
    jetstream::{self, stream},
};
use bytes::Bytes;
use futures::future::join_all;
use relay_contracts::StreamNames;

/// How long a re-publish of the same message id is recognised and dropped.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// `RELAY_NATS_URL`'s servers, as the client takes them: with several, it
/// connects to any and fails over between them (and those the cluster
/// announces) on its own.
pub fn servers(url: &str) -> Result<Vec<async_nats::ServerAddr>> {
    relay_config::nats_servers(url)?
        .iter()
        .map(|s| s.parse::<async_nats::ServerAddr>().with_context(|| format!("RELAY_NATS_URL: {s:?} is not a NATS server address")))
        .collect()
}

/// What this api has seen of its connection to the broker: when it last
/// lost it. Receivers are told each time it comes back.
#[derive(Debug, Clone, Copy, Default)]
pub struct Link {
    pub lost_at: Option<std::time::Instant>,
}

pub async fn connect(url: &str) -> Result<(jetstream::Context, tokio::sync::watch::Receiver<Link>)> {
    let (link_tx, link_rx) = tokio::sync::watch::channel(Link::default());
    let link_tx = std::sync::Arc::new(link_tx);
    // Retry on initial connect: the api must come up, and keep its outbox,
    // while the broker is away; the relays keep trying.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .name("relay-api")
        .event_callback(move |event| {
            let link = link_tx.clone();
            async move {
                match event {
                    // Noted, not announced: what matters is the return.
                    async_nats::Event::Disconnected => link.send_if_modified(|l| {
                        l.lost_at = Some(std::time::Instant::now());
                        false
                    }),
                    // The first connection is not a return.
                    async_nats::Event::Connected => link.send_if_modified(|l| l.lost_at.is_some()),
                    _ => false,
                };
            }
        })
        .connect(servers(url)?)
        .await
        .with_context(|| format!("connecting to NATS at {url}"))?;
    let mut js = jetstream::new(client);
    js.set_timeout(PUBLISH_ACK_TIMEOUT);
    Ok((js, link_rx))
}

/// How long a publish waits for the stream's ack before it counts as failed
/// (and its rows stay for the next pass, the same message id recognised by
/// the duplicate window). When the node a publish went to dies, its ack never
/// comes even though the client reconnects elsewhere at once; the client's
/// default of 5 s stalled the relays that long on each node lost in the
/// cluster test. An ack normally takes milliseconds, a stream leader's
/// election a few hundred.
const PUBLISH_ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// This api's connection to a NATS server is up (readiness and metrics).
pub fn connected(js: &jetstream::Context) -> bool {
    js.client().connection_state() == async_nats::connection::State::Connected
}

/// Creates both streams, or brings an existing one to this configuration
/// (a changed replica count is applied by the cluster, which copies or drops
/// replicas while the stream serves).
pub async fn ensure_streams(js: &jetstream::Context, names: &StreamNames, replicas: usize) -> Result<()> {
    for (name, subject, max_age) in [
        // Sized for how long the dispatcher may be down, not for retry tiers:
        // nothing waits in the broker for its time to come.
        (names.events_stream(), names.all_events(), Duration::from_secs(7 * 24 * 3600)),
        (names.deliveries_stream(), names.all_deliveries(), Duration::from_secs(7 * 24 * 3600)),
    ] {
        let config = stream::Config {
            name: name.clone(),
            subjects: vec![subject],
            max_age,
            duplicate_window: DUPLICATE_WINDOW,
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            num_replicas: replicas,
            ..Default::default()
        };
        let mut existing =
            js.get_or_create_stream(config.clone()).await.with_context(|| format!("creating stream {name} with {replicas} replicas"))?;
        let info = existing.info().await.with_context(|| format!("reading stream {name}"))?;
        if info.config.num_replicas != replicas {
            tracing::info!(stream = %name, from = info.config.num_replicas, to = replicas, "changing the stream's replicas");
            js.update_stream(config).await.with_context(|| {
                format!("changing stream {name} from {} to {replicas} replicas (RELAY_STREAM_REPLICAS)", info.config.num_replicas)
            })?;
        }
    }
    Ok(())
}

/// Publishes a batch and waits for the broker's acks together (one round
/// trip of latency per batch, not per message). Returns, per message, whether
/// the broker stored it, and the first failure.
pub async fn publish_all(js: &jetstream::Context, messages: Vec<(String, HeaderMap, Bytes)>) -> (Vec<bool>, Option<anyhow::Error>) {
    let sends = messages.into_iter().map(|(subject, headers, payload)| js.publish_with_headers(subject, headers, payload));
    let mut stored = Vec::new();
    let mut first_error = None;
    for sent in join_all(sends).await {
        let acked = match sent {
            Ok(ack) => ack.await.map(|_| ()).map_err(anyhow::Error::from),
            Err(e) => Err(e.into()),
        };
        stored.push(acked.is_ok());
        if let Err(e) = acked {
            first_error.get_or_insert(e);
        }
    }
    (stored, first_error)
}
