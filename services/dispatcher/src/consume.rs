//! The two durable pull consumers, with explicit acks: EVENTS (expansion)
//! and DELIVERIES (handed to the lanes). What each message is told is
//! decided in `verdict`.

use std::sync::Arc;

use anyhow::{Context, Result};
use async_nats::jetstream::{self, AckKind, consumer::pull, message::Message};
use futures::StreamExt;
use prost::Message as _;
use relay_contracts::{
    StreamNames,
    relay::{dispatch::v1::ExpandRequest, queue::v1::DeliveryJob},
};
use tokio::sync::watch;
use tracing::Instrument as _;

use crate::{
    batch,
    config::DispatcherConfig,
    lanes::LaneSet,
    seam::Seam,
    turns::Turns,
    verdict::{Verdict, is_deferred, settle, settle_by, verdict},
};

/// Redeliveries of a job we could not process, before the broker gives up on
/// it. The api's leases re-publish anything dropped here.
const MAX_DELIVER: i64 = 50;
/// How an expansion deferred by the api is asked again in-process: after
/// 20 ms, doubling, the last after 640 ms (1.3 s in all).
const DEFERRED_FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);
const DEFERRED_LAST_PAUSE: std::time::Duration = std::time::Duration::from_millis(640);

/// Creates the durable consumer, or updates it to this configuration (ack
/// wait, redelivery budget and ack-pending limit follow the current config
/// rather than whatever the first dispatcher ever created).
async fn durable(stream: &jetstream::stream::Stream, config: pull::Config) -> Result<jetstream::consumer::PullConsumer> {
    let name = config.durable_name.clone().unwrap_or_default();
    match stream.create_consumer(config).await {
        Ok(c) => Ok(c),
        Err(e) => {
            tracing::warn!(consumer = %name, error = %e, "could not apply the consumer configuration; using the existing consumer");
            stream.get_consumer(&name).await.map_err(|e| anyhow::anyhow!("{e}")).context("getting the consumer")
        }
    }
}

/// Consumer errors in a row after which the consumer is created again: a
/// broker back without its store has no consumer to pull from, and the
/// pull stream would report missed heartbeats for ever (`PULL_HEARTBEAT`
/// apart, so about ten seconds).
const ERRORS_BEFORE_RECREATING: u32 = 5;

/// The next message of a consumer, or `None` once it ends, fails
/// `ERRORS_BEFORE_RECREATING` times in a row (the caller's loop ends and
/// the consumer is created again), or the process stops. A lone consumer
/// error is logged and skipped: the pull stream goes on.
async fn next_message(messages: &mut pull::Stream, stop: &mut watch::Receiver<bool>, what: &str) -> Option<Message> {
    let mut errors = 0;
    loop {
        let next = tokio::select! {
            m = messages.next() => m,
            _ = stop.changed() => return None,
        };
        match next? {
            Ok(m) => return Some(m),
            Err(e) => {
                errors += 1;
                tracing::warn!(error = %e, consumer = what, "consumer error");
                if errors >= ERRORS_BEFORE_RECREATING {
                    tracing::warn!(consumer = what, errors, "the consumer keeps failing; creating it again");
                    return None;
                }
            }
        }
    }
}

pub(crate) async fn expand_loop(
    js: jetstream::Context,
    names: StreamNames,
    seam: Seam,
    cfg: Arc<DispatcherConfig>,
    lanes: Arc<LaneSet>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let stream = js.get_stream(names.events_stream()).await.context("EVENTS stream")?;
    let consumer = durable(
        &stream,
        pull::Config {
            durable_name: Some(names.expand_durable()),
            filter_subject: names.all_events(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: cfg.events_ack_wait(),
            max_deliver: MAX_DELIVER,
            max_ack_pending: 1000,
            ..Default::default()
        },
    )
    .await?;
    let mut messages = pull(&consumer).await.context("subscribing to EVENTS")?;
    // Expansions in flight, in fair turns across environments (see `turns`).
    let mut turns = Turns::new(cfg.max_expanding, cfg.expanding_per_environment);
    let (ended_tx, mut ended_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    // First attempts come back with their expansion, into this process's
    // lanes, instead of through DELIVERIES.
    let (claimant, hold) = lanes.claim();
    // Two ways to the api, each with its own calls in flight: an item of an
    // environment with little in flight beside others' (`Started::express`)
    // does not wait for a call slot behind theirs, and rides with other such
    // items to the api's express queue (see its `app::expansion_queues`).
    let expansions = batch::expansions(seam.clone(), claimant.clone(), hold, false);
    let express = batch::expansions(seam, claimant, hold, true);
    loop {
        let start = tokio::select! {
            msg = next_message(&mut messages, &mut stop, "EVENTS") => {
                let Some(msg) = msg else { break };
                let Some(req) = decode_event(&msg.payload) else {
                    tracing::error!(subject = %msg.subject, "undecodable event; terminating it");
                    settle(&msg, AckKind::Term).await;
                    continue;
                };
                tracing::debug!(target: "relay_hops", hop = "events_received", event_id = %req.event_id);
                turns.offer(req.environment_id.clone(), (msg, req))
            }
            Some(env) = ended_rx.recv() => turns.ended(&env),
        };
        for started in start {
            let (msg, req) = started.item;
            let ended = EndedTurn(Some((started.env, ended_tx.clone())));
            let way = if started.express { &express } else { &expansions };
            tokio::spawn(expand_one(msg, req, way.clone(), lanes.clone(), ended));
        }
    }
    Ok(())
}

/// Tells the expand loop an environment's turn ended, however its task ends.
struct EndedTurn(Option<(String, tokio::sync::mpsc::UnboundedSender<String>)>);

impl Drop for EndedTurn {
    fn drop(&mut self) {
        if let Some((env, tx)) = self.0.take() {
            let _ = tx.send(env);
        }
    }
}

/// Expands one event (batched with others by `expansions`) and settles its message.
async fn expand_one(msg: Message, mut req: ExpandRequest, expansions: batch::Expansions, lanes: Arc<LaneSet>, _turn: EndedTurn) {
    let span = tracing::info_span!("expand_event", event_id = %req.event_id);
    if let Some(headers) = &msg.headers {
        relay_telemetry::set_parent(&span, &relay_telemetry::NatsHeadersRef(headers));
    }
    let task = async move {
        tracing::debug!(target: "relay_hops", hop = "expand_started", event_id = %req.event_id);
        // Batched with other events: the context rides in the item.
        let traceparent = relay_telemetry::current_traceparent();
        req.traceparent = traceparent.clone().unwrap_or_default();
        // An event whose key's earlier event is still being expanded
        // (by another batch or dispatcher) is asked for again here, a
        // few times over about a second, before the broker is told to
        // bring it back: each redelivery counts against MAX_DELIVER.
        let mut pause = DEFERRED_FIRST_PAUSE;
        let answer = loop {
            match expansions.call(req.clone()).await {
                Err(st) if is_deferred(&st) && pause <= DEFERRED_LAST_PAUSE => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                answer => break answer,
            }
        };
        tracing::debug!(target: "relay_hops", hop = "expand_answered", event_id = %req.event_id);
        match answer {
            Ok(expanded) => {
                for attempt in expanded.attempts {
                    lanes.hand(attempt, traceparent.clone());
                }
                settle(&msg, AckKind::Ack).await
            }
            Err(st) => {
                let v = verdict(&st, true);
                match v {
                    Verdict::Term => {
                        tracing::error!(code = ?st.code(), message = st.message(), "event cannot be expanded; terminating it")
                    }
                    _ => tracing::warn!(code = ?st.code(), message = st.message(), "expand failed; the event will come back"),
                }
                settle_by(&msg, v).await
            }
        }
    };
    task.instrument(span).await
}

fn decode_event(body: &[u8]) -> Option<ExpandRequest> {
    #[derive(serde::Deserialize)]
    struct Head {
        id: String,
        #[serde(rename = "type")]
        event_type: String,
        environment_id: String,
        #[serde(default)]
        target_endpoint_id: Option<String>,
    }
    let h: Head = serde_json::from_slice(body).ok()?;
    Some(ExpandRequest {
        event_id: h.id,
        environment_id: h.environment_id,
        r#type: h.event_type,
        traceparent: String::new(),
        target_endpoint_id: h.target_endpoint_id.unwrap_or_default(),
    })
}

/// Deliveries: each job goes to its endpoint's lane (see `lanes`).
pub(crate) async fn deliver_loop(
    js: jetstream::Context,
    names: StreamNames,
    cfg: Arc<DispatcherConfig>,
    lanes: Arc<LaneSet>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let stream = js.get_stream(names.deliveries_stream()).await.context("DELIVERIES stream")?;
    let consumer = durable(
        &stream,
        pull::Config {
            durable_name: Some(names.deliver_durable()),
            filter_subject: names.all_deliveries(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: cfg.deliveries_ack_wait(),
            max_deliver: MAX_DELIVER,
            // 512 endpoints hanging at once, each holding the api's default
            // in-flight cap of 64 jobs, before healthy endpoints' jobs wait.
            max_ack_pending: 32_768,
            ..Default::default()
        },
    )
    .await?;
    let mut messages = pull(&consumer).await.context("subscribing to DELIVERIES")?;
    while let Some(msg) = next_message(&mut messages, &mut stop, "DELIVERIES").await {
        let Ok(job) = DeliveryJob::decode(msg.payload.as_ref()) else {
            tracing::error!(subject = %msg.subject, "undecodable delivery job; terminating it");
            settle(&msg, AckKind::Term).await;
            continue;
        };
        lanes.route(msg, job);
    }
    // At shutdown, closing the lanes' queues lets each finish its job in
    // hand and exit (a consumer that merely restarts keeps them).
    if *stop.borrow() {
        lanes.close().await;
    }
    Ok(())
}

/// How long one pull request waits on the server, and how often the server
/// says it is alive meanwhile. A pull request lives on the server that took
/// it: when that node dies (a NATS cluster losing a node), the client
/// reconnects elsewhere at once but the request is only renewed when it
/// expires or its heartbeats stop. The client's defaults (30 s, 15 s) made
/// that a 30 s stall in the cluster test; these bound it to a few seconds,
/// for a request every few seconds on an idle consumer.
const PULL_EXPIRES: std::time::Duration = std::time::Duration::from_secs(6);
const PULL_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(2);

async fn pull(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
) -> Result<async_nats::jetstream::consumer::pull::Stream, async_nats::jetstream::consumer::StreamError> {
    consumer.stream().expires(PULL_EXPIRES).heartbeat(PULL_HEARTBEAT).messages().await
}
