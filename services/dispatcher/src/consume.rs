//! The two durable pull consumers, with explicit acks.
//!
//! Each message ends in exactly one of: Ack (handled, including a customer's
//! failure, which is an outcome), Nak with a delay (we could not process it:
//! the api was unreachable; it comes back), or Term (it can never be
//! processed, e.g. undecodable bytes). The broker's redelivery budget is for
//! our failures only; the customer's attempt budget lives in the api.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use async_nats::jetstream::{self, AckKind, consumer::pull, message::Message};
use futures::StreamExt;
use prost::Message as _;
use relay_contracts::{
    StreamNames,
    relay::{
        dispatch::v1::{ExpandRequest, MaterialRequest, MaterialResponse, OutcomeRequest},
        queue::v1::DeliveryJob,
    },
};
use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tonic::Code;
use tracing::Instrument as _;

use crate::{attempt, batch, config::DispatcherConfig, http_client::Sender, seam::Seam};

/// Redeliveries of a job we could not process, before the broker gives up on
/// it. The api's leases re-publish anything dropped here.
const MAX_DELIVER: i64 = 50;
/// Asking for a job back: 1 s, doubling with each redelivery, at most 30 s,
/// so an api outage is ridden out for many minutes within `MAX_DELIVER`.
fn retry_later(msg: &Message) -> AckKind {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).clamp(1, 6) as u32;
    AckKind::Nak(Some((Duration::from_secs(1) * 2u32.pow(delivered - 1)).min(Duration::from_secs(30))))
}
/// A lane with nothing to do for this long closes.
const LANE_IDLE: Duration = Duration::from_secs(30);

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

/// What the broker is told about a message, decided from the api's answer in
/// this one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Handled, or nothing left to do for it.
    Ack,
    /// Not handled this time; it comes back after a delay.
    Retry,
    /// It can never be handled.
    Term,
}

/// The verdict for an answer of the api that is not a success. `for_event`:
/// an EVENTS message (expansion), else a DELIVERIES job (material).
fn verdict(st: &tonic::Status, for_event: bool) -> Verdict {
    let reason = st.metadata().get(relay_contracts::ERROR_REASON_METADATA).and_then(|v| v.to_str().ok()).unwrap_or_default();
    match (st.code(), reason) {
        // Another dispatcher is sending this attempt: if it reports, the
        // attempt is done; if it died, its claim runs out. Either way, ask
        // again later rather than send.
        (_, relay_contracts::reasons::IN_HAND_ELSEWHERE) => Verdict::Retry,
        // An event the api does not know, or that does not match its record.
        (Code::NotFound | Code::InvalidArgument, _) if for_event => Verdict::Term,
        // The attempt is no longer current (reported, delivery finished,
        // endpoint switched off) or the delivery is gone: nothing to send.
        (Code::FailedPrecondition | Code::NotFound, _) => Verdict::Ack,
        // A job the api refuses to read will be refused every time.
        (Code::InvalidArgument, _) => Verdict::Term,
        // The api is away or failing: the job comes back.
        _ => Verdict::Retry,
    }
}

async fn settle_by(msg: &Message, v: Verdict) {
    let kind = match v {
        Verdict::Ack => AckKind::Ack,
        Verdict::Retry => retry_later(msg),
        Verdict::Term => AckKind::Term,
    };
    settle(msg, kind).await
}

async fn settle(msg: &Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "settling a message with the broker failed; it will be redelivered");
    }
}

pub async fn expand_loop(
    js: jetstream::Context,
    names: StreamNames,
    seam: Seam,
    cfg: Arc<DispatcherConfig>,
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
    let mut messages = consumer.messages().await.context("subscribing to EVENTS")?;
    let permits = Arc::new(Semaphore::new(cfg.max_expanding));
    let expansions = batch::expansions(seam);
    loop {
        let msg = tokio::select! {
            m = messages.next() => m,
            _ = stop.changed() => return Ok(()),
        };
        let Some(msg) = msg else { return Ok(()) };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "EVENTS consumer error");
                continue;
            }
        };
        let permit = permits.clone().acquire_owned().await.expect("semaphore open");
        let expansions = expansions.clone();
        let span = tracing::info_span!("expand_event", event_id = tracing::field::Empty);
        if let Some(headers) = &msg.headers {
            relay_telemetry::set_parent(&span, &relay_telemetry::NatsHeadersRef(headers));
        }
        let task = async move {
            let _permit = permit;
            let Some(mut req) = decode_event(&msg.payload) else {
                tracing::error!(subject = %msg.subject, "undecodable event; terminating it");
                return settle(&msg, AckKind::Term).await;
            };
            tracing::Span::current().record("event_id", req.event_id.as_str());
            // Batched with other events: the context rides in the item.
            req.traceparent = relay_telemetry::current_traceparent().unwrap_or_default();
            match expansions.call(req).await {
                Ok(_) => settle(&msg, AckKind::Ack).await,
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
        tokio::spawn(task.instrument(span));
    }
}

fn decode_event(body: &[u8]) -> Option<ExpandRequest> {
    #[derive(serde::Deserialize)]
    struct Head {
        id: String,
        #[serde(rename = "type")]
        event_type: String,
        environment_id: String,
    }
    let h: Head = serde_json::from_slice(body).ok()?;
    Some(ExpandRequest { event_id: h.id, environment_id: h.environment_id, r#type: h.event_type, traceparent: String::new() })
}

type Job = (Arc<Message>, DeliveryJob);
type Lanes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>>;
/// Attempts in this process's hands, by `delivery:generation:attempt`: taken
/// before their material is asked for, given back once the outcome is
/// recorded (or the job goes back to the broker). A second copy of such a job
/// (a redelivery racing its original) is acked unsent: the original either
/// records its outcome or comes back itself. Taking the key before asking
/// matters: the api hands this process's own claim back to it, so a copy
/// whose material was fetched while the original was still being reported
/// would otherwise be sent again once the report landed.
type Unsettled = Arc<std::sync::Mutex<HashSet<String>>>;

fn attempt_key(job: &DeliveryJob) -> String {
    format!("{}:{}:{}", job.delivery_id, job.generation, job.attempt)
}

/// Jobs a lane fetches material for in one go.
const PREFETCH: usize = 32;
/// Material older than this is fetched again before sending: behind a slow
/// attempt, a disabled endpoint or a changed URL must not be missed.
const MATERIAL_FRESH: Duration = Duration::from_secs(2);

/// Deliveries: one lane per endpoint, so one attempt per endpoint is in
/// flight and a hanging endpoint holds up only its own lane; lanes run
/// concurrently, bounded overall by `max_in_flight`.
pub async fn deliver_loop(
    js: jetstream::Context,
    names: StreamNames,
    seam: Seam,
    cfg: Arc<DispatcherConfig>,
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
    let mut messages = consumer.messages().await.context("subscribing to DELIVERIES")?;
    let sender = crate::http_client::build(
        Arc::new(cfg.url_policy.clone()),
        cfg.resolver.clone(),
        cfg.egress_proxy.as_deref(),
        cfg.attempt_timeout,
    )?;
    let shared = Arc::new(LaneShared {
        lanes: Default::default(),
        materials: batch::materials(seam.clone()),
        outcomes: batch::outcomes(seam),
        sender,
        permits: Arc::new(Semaphore::new(cfg.max_in_flight)),
        unsettled: Default::default(),
        progress_every: cfg.deliveries_ack_wait() / 3,
        stop: stop.clone(),
        claimant: uuid::Uuid::new_v4().to_string(),
        claim_hold: MATERIAL_FRESH + cfg.attempt_timeout + CLAIM_MARGIN,
    });
    loop {
        let msg = tokio::select! {
            m = messages.next() => m,
            _ = stop.changed() => {
                // Closing the lanes' queues lets each finish its job in hand and exit.
                shared.lanes.lock().await.clear();
                return Ok(());
            }
        };
        let Some(msg) = msg else { return Ok(()) };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "DELIVERIES consumer error");
                continue;
            }
        };
        let Ok(job) = DeliveryJob::decode(msg.payload.as_ref()) else {
            tracing::error!(subject = %msg.subject, "undecodable delivery job; terminating it");
            settle(&msg, AckKind::Term).await;
            continue;
        };
        let mut map = shared.lanes.lock().await;
        let key = job.endpoint_id.clone();
        let job = (Arc::new(msg), job);
        let pending = match map.get(&key) {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(first) = pending {
            let (tx, rx) = mpsc::unbounded_channel();
            tx.send(first).expect("receiver alive");
            map.insert(key.clone(), tx);
            tokio::spawn(Lane { key, shared: shared.clone() }.run(rx));
        }
    }
}

/// What every lane of one consumer shares.
struct LaneShared {
    lanes: Lanes,
    materials: batch::Materials,
    outcomes: batch::Outcomes,
    sender: Sender,
    permits: Arc<Semaphore>,
    unsettled: Unsettled,
    /// How often jobs waiting in (or being worked by) a lane tell the broker
    /// they are in progress, so a slow endpoint's queue never outlives the
    /// ack wait and gets redelivered while still queued.
    progress_every: Duration,
    /// Shutdown: a lane finishes the attempt in hand and leaves the rest
    /// unacked, for the broker to hand to another dispatcher.
    stop: watch::Receiver<bool>,
    /// This process, as the claimant of the attempts it sends.
    claimant: String,
    /// How long a claim is held: an attempt starts within `MATERIAL_FRESH`
    /// of its claim and ends within the attempt timeout, so the claim
    /// outlasts the POST; the margin is for reporting the outcome, which
    /// ends the claim.
    claim_hold: Duration,
}

/// Time, after an attempt ends, for its outcome to reach the api before
/// another dispatcher may claim the attempt again.
const CLAIM_MARGIN: Duration = Duration::from_secs(5);

struct Lane {
    key: String,
    shared: Arc<LaneShared>,
}

impl Lane {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<Job>) {
        let mut queue: VecDeque<Job> = VecDeque::new();
        let mut tick = tokio::time::interval(self.shared.progress_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !*self.shared.stop.borrow() {
            if queue.is_empty() {
                match tokio::time::timeout(LANE_IDLE, rx.recv()).await {
                    Ok(Some(next)) => queue.push_back(next),
                    Ok(None) => return,
                    Err(_) => {
                        // Idle: close the lane, unless a job slipped in meanwhile.
                        let mut map = self.shared.lanes.lock().await;
                        match rx.try_recv() {
                            Ok(next) => queue.push_back(next),
                            Err(_) => {
                                map.remove(&self.key);
                                return;
                            }
                        }
                    }
                }
            }
            while let Ok(next) = rx.try_recv() {
                queue.push_back(next);
            }
            let chunk: Vec<Job> = queue.drain(..queue.len().min(PREFETCH)).collect();
            let in_hand: Vec<Arc<Message>> = chunk.iter().map(|(m, _)| m.clone()).collect();
            let work = self.work(chunk);
            tokio::pin!(work);
            let leftover = loop {
                tokio::select! {
                    leftover = &mut work => break leftover,
                    Some(next) = rx.recv() => queue.push_back(next),
                    _ = tick.tick() => {
                        for m in in_hand.iter().chain(queue.iter().map(|(m, _)| m)) {
                            let _ = m.ack_with(AckKind::Progress).await;
                        }
                    }
                }
            };
            for job in leftover.into_iter().rev() {
                queue.push_front(job);
            }
        }
    }

    /// Fetches material for the chunk in one go, then sends its attempts one
    /// after another. Returns the jobs it did not get to (stale material, or
    /// shutdown), in order. Copies of an attempt already in hand are acked
    /// before anything is asked for them.
    async fn work(&self, chunk: Vec<Job>) -> Vec<Job> {
        let mut mine = Vec::with_capacity(chunk.len());
        for (msg, job) in chunk {
            if self.shared.unsettled.lock().expect("unpoisoned").insert(attempt_key(&job)) {
                mine.push((msg, job));
            } else {
                tracing::debug!(delivery_id = %job.delivery_id, attempt = job.attempt, "a copy of this attempt is already in hand; acking the duplicate");
                settle(&msg, AckKind::Ack).await;
            }
        }
        let fetched = futures::future::join_all(mine.iter().map(|(_, job)| {
            self.shared.materials.call(MaterialRequest {
                delivery_id: job.delivery_id.clone(),
                attempt: job.attempt,
                generation: job.generation,
                claimant: self.shared.claimant.clone(),
                hold_ms: self.shared.claim_hold.as_millis() as u32,
            })
        }))
        .await;
        let fetched_at = Instant::now();
        let mut rest = mine.into_iter().zip(fetched).enumerate();
        while let Some((i, ((msg, job), material))) = rest.next() {
            if i > 0 && (fetched_at.elapsed() > MATERIAL_FRESH || *self.shared.stop.borrow()) {
                let leftover: Vec<Job> = std::iter::once((msg, job)).chain(rest.map(|(_, (j, _))| j)).collect();
                let mut unsettled = self.shared.unsettled.lock().expect("unpoisoned");
                for (_, job) in &leftover {
                    unsettled.remove(&attempt_key(job));
                }
                return leftover;
            }
            self.send_one(msg, job, material).await;
        }
        Vec::new()
    }

    async fn send_one(&self, msg: Arc<Message>, job: DeliveryJob, material: Result<MaterialResponse, tonic::Status>) {
        let material = match material {
            Ok(m) => m,
            Err(st) => {
                let v = verdict(&st, false);
                match v {
                    Verdict::Ack => tracing::debug!(delivery_id = %job.delivery_id, message = st.message(), "nothing to send for this job"),
                    _ => {
                        tracing::warn!(delivery_id = %job.delivery_id, code = ?st.code(), message = st.message(), verdict = ?v, "no material for this job")
                    }
                }
                self.shared.unsettled.lock().expect("unpoisoned").remove(&attempt_key(&job));
                return settle_by(&msg, v).await;
            }
        };
        // The attempt's span continues the delivery's trace (the relay put
        // its context in the message headers) and covers the POST and the report.
        let span = tracing::info_span!(
            "attempt",
            delivery_id = %job.delivery_id, endpoint_id = %job.endpoint_id, attempt = job.attempt, generation = job.generation,
            http_status = tracing::field::Empty, latency_ms = tracing::field::Empty, outcome = tracing::field::Empty,
        );
        if let Some(headers) = &msg.headers {
            relay_telemetry::set_parent(&span, &relay_telemetry::NatsHeadersRef(headers));
        }
        let key = attempt_key(&job);
        let event_id = material.event_id.clone();
        let outcome = async {
            let _permit = self.shared.permits.clone().acquire_owned().await.expect("semaphore open");
            attempt::send(&self.shared.sender, material).await
        }
        .instrument(span.clone())
        .await;
        if let Some(status) = outcome.http_status {
            span.record("http_status", status);
        }
        span.record("latency_ms", outcome.latency_ms);
        // The lane moves on to its next attempt while this one is reported.
        let (outcomes, unsettled) = (self.shared.outcomes.clone(), self.shared.unsettled.clone());
        tokio::spawn(
            async move {
                report(&outcomes, &msg, &job, &event_id, outcome).await;
                unsettled.lock().expect("unpoisoned").remove(&key);
            }
            .instrument(span),
        );
    }
}

/// The POST has happened; report it, retrying briefly. If the api stays away
/// the job comes back and is sent again: the receiver may see the event id
/// twice, and the schedule still advances once.
async fn report(outcomes: &batch::Outcomes, msg: &Message, job: &DeliveryJob, event_id: &str, outcome: OutcomeRequest) {
    let (status, error) = (outcome.http_status, outcome.error.clone());
    for backoff in [0u64, 200, 1000] {
        tokio::time::sleep(Duration::from_millis(backoff)).await;
        match outcomes.call(outcome.clone()).await {
            Ok(decision) => {
                tracing::Span::current().record("outcome", decision.decision().as_str_name());
                tracing::info!(
                    delivery_id = %job.delivery_id, event_id = %event_id, attempt = job.attempt, status = ?status, error = %error,
                    decision = decision.decision, "attempt recorded"
                );
                return settle(msg, AckKind::Ack).await;
            }
            Err(st) => {
                tracing::warn!(delivery_id = %job.delivery_id, code = ?st.code(), message = st.message(), "reporting an outcome failed")
            }
        }
    }
    settle(msg, retry_later(msg)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, reason: &str) -> tonic::Status {
        let mut st = tonic::Status::new(code, "x");
        if !reason.is_empty() {
            st.metadata_mut().insert(relay_contracts::ERROR_REASON_METADATA, reason.parse().unwrap());
        }
        st
    }

    #[test]
    fn the_apis_answers_map_to_one_broker_verdict_each() {
        use Verdict::*;
        for (code, reason, for_event, want) in [
            (Code::Unavailable, relay_contracts::reasons::IN_HAND_ELSEWHERE, false, Retry),
            (Code::FailedPrecondition, "stale_attempt", false, Ack),
            (Code::FailedPrecondition, "endpoint_inactive", false, Ack),
            (Code::NotFound, "not_found", false, Ack),
            (Code::InvalidArgument, "attempt_out_of_range", false, Term),
            (Code::Unavailable, "", false, Retry),
            (Code::Internal, "", false, Retry),
            (Code::DeadlineExceeded, "", false, Retry),
            (Code::NotFound, "not_found", true, Term),
            (Code::InvalidArgument, "event_mismatch", true, Term),
            (Code::Unavailable, "", true, Retry),
        ] {
            assert_eq!(verdict(&status(code, reason), for_event), want, "{code:?} {reason} event={for_event}");
        }
    }
}
