//! Deliveries, one lane per endpoint: one attempt per endpoint is in
//! flight (or as many as the endpoint's own `max_in_flight`, which the api
//! never exceeds in what it hands out), so a hanging endpoint holds up only
//! its own lane; lanes run concurrently, bounded overall by `max_in_flight`. A lane fetches material
//! for a chunk of jobs (those that did not come with it), sends them one
//! after another and reports each outcome.
//!
//! Jobs come from the DELIVERIES consumer (retries, replays, attempts past
//! an endpoint's cap, leases that ran out) or straight from an expansion,
//! material in hand: a first attempt then costs no broker message and no
//! material call.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;
use async_nats::jetstream::message::Message;
use relay_config::timing::MATERIAL_FRESH;
use relay_contracts::{
    AttemptKey,
    relay::{
        dispatch::v1::{MaterialRequest, MaterialResponse},
        queue::v1::DeliveryJob,
    },
};
use tokio::sync::{Semaphore, mpsc, watch};
use tracing::Instrument as _;

mod reporting;

use crate::{
    attempt, batch,
    config::DispatcherConfig,
    http_client::Sender,
    seam::Seam,
    settle::{SentLately, Source},
    switched_off::Switches,
    unreported::Unreported,
    verdict::{Verdict, verdict},
};

/// The job an attempt handed over with its material is.
fn job_of(material: &MaterialResponse) -> DeliveryJob {
    DeliveryJob {
        delivery_id: material.delivery_id.clone(),
        endpoint_id: material.endpoint_id.clone(),
        environment_id: material.environment_id.clone(),
        attempt: material.attempt,
        generation: material.generation,
    }
}

/// A lane with nothing to do for this long closes.
const LANE_IDLE: Duration = Duration::from_secs(30);

/// One attempt to make, with its material if already fetched (and when).
struct Job {
    source: Arc<Source>,
    job: DeliveryJob,
    material: Option<(Result<MaterialResponse, tonic::Status>, Instant)>,
    /// Followers that came with material since gone stale (and asked for
    /// again, which comes without them): released with this attempt's
    /// report, as a run stopped before them.
    release: Vec<String>,
}

type Lanes = Arc<std::sync::Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>>;
/// Attempts in this process's hands, by their `AttemptKey`: taken
/// before their material is asked for, given back once the outcome is
/// recorded (or the job goes back to the broker). A second copy of such a job
/// (a redelivery racing its original, or the relay's publish of an attempt
/// in hand whose lease ran out) is not sent and not acked: the broker is
/// asked for it back after a claim's hold, by when the original has ended
/// (it is then refused its material and acked) or this process has died
/// (another dispatcher sends it, as nothing else would until the attempt's
/// next lease, minutes away, ran out). Asked for every few seconds instead,
/// the copies cost W4 (hanging endpoints, whose in-hand attempts outlive
/// their lease) a healthy p99 of 22 s; once a hold, while the original is
/// still here, they cost a broker round trip and no call to the api.
/// Taking the key before asking matters: the api hands this process's own
/// claim back to it, so a copy whose material was fetched while the
/// original was still being reported would otherwise be sent again once the
/// report landed.
type Unsettled = Arc<std::sync::Mutex<HashSet<AttemptKey>>>;

/// Jobs a lane fetches material for in one go.
const PREFETCH: usize = 32;

/// The lanes of one dispatcher, fed by its DELIVERIES consumer and its expansions.
pub(crate) struct LaneSet {
    shared: Arc<LaneShared>,
}

impl LaneSet {
    pub(crate) fn new(seam: Seam, cfg: &DispatcherConfig, stop: watch::Receiver<bool>, listen: crate::listen::Route) -> Result<Self> {
        let claim_hold = MATERIAL_FRESH + cfg.attempt_timeout + CLAIM_MARGIN;
        let claimant = uuid::Uuid::new_v4().to_string();
        relay_config::timing::check_claim(claim_hold)?;
        let receiver_ca = cfg
            .receiver_ca
            .as_ref()
            .map(|p| std::fs::read(p).map_err(|e| anyhow::anyhow!("reading RELAY_RECEIVER_CA_FILE {}: {e}", p.display())))
            .transpose()?;
        let mut sender = crate::http_client::build(
            Arc::new(cfg.url_policy.clone()),
            cfg.resolver.clone(),
            cfg.egress_proxy.as_deref(),
            cfg.source_address,
            cfg.attempt_timeout,
            receiver_ca,
        )?;
        sender.listen = Some(Arc::new(listen));
        let shared = Arc::new(LaneShared {
            lanes: Default::default(),
            materials: batch::materials(seam.clone()),
            outcomes: batch::outcomes(seam, claimant.clone(), claim_hold),
            sender,
            permits: Arc::new(Semaphore::new(cfg.max_in_flight)),
            unsettled: Default::default(),
            sent_lately: Default::default(),
            progress_every: cfg.deliveries_ack_wait() / 3,
            stop: stop.clone(),
            claimant,
            claim_hold,
            switches: Default::default(),
            unreported: Default::default(),
        });
        shared.start_retrying(stop);
        Ok(Self { shared })
    }

    /// Hands a DELIVERIES job to its endpoint's lane.
    pub(crate) fn route(&self, msg: Message, job: DeliveryJob) {
        self.shared.enqueue(Job { source: Arc::new(Source::Broker(Arc::new(msg))), job, material: None, release: Vec::new() })
    }

    /// Hands an attempt the api gave this process with a reply (an
    /// expansion's first attempts), with its material, to its endpoint's
    /// lane. `traceparent`: the trace to continue if the material names none.
    pub(crate) fn hand(&self, material: MaterialResponse, traceparent: Option<String>) {
        self.shared.hand(material, traceparent)
    }

    /// Who this process is when it claims an attempt, and for how long.
    pub(crate) fn claim(&self) -> (String, Duration) {
        (self.shared.claimant.clone(), self.shared.claim_hold)
    }

    /// The attempts switched off while in this process's hands.
    pub(crate) fn switches(&self) -> Arc<Switches> {
        self.shared.switches.clone()
    }

    pub(crate) async fn close(&self) {
        self.shared.lanes.lock().expect("unpoisoned").clear();
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
    sent_lately: SentLately,
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
    /// Attempts the api switched off (their endpoint disabled or deleted)
    /// while in this process's hands, and those on the wire.
    switches: Arc<Switches>,
    /// Outcomes the api has not taken yet.
    unreported: Unreported,
}

impl LaneShared {
    fn hand(self: &Arc<Self>, material: MaterialResponse, traceparent: Option<String>) {
        let job = job_of(&material);
        let traceparent = Some(material.traceparent.clone()).filter(|t| !t.is_empty()).or(traceparent);
        let source = Arc::new(Source::InHand { traceparent });
        self.enqueue(Job { source, job, material: Some((Ok(material), Instant::now())), release: Vec::new() })
    }

    /// Queues a job on its endpoint's lane, opening the lane if it has none.
    fn enqueue(self: &Arc<Self>, job: Job) {
        let mut map = self.lanes.lock().expect("unpoisoned");
        let key = job.job.endpoint_id.clone();
        let pending = match map.get(&key) {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(first) = pending {
            let (tx, rx) = mpsc::unbounded_channel();
            tx.send(first).expect("receiver alive");
            map.insert(key.clone(), tx);
            tokio::spawn(Lane { key, shared: self.clone() }.run(rx));
        }
    }
}

/// A lane head's run as it goes: the followers still to send, when their
/// material was read, and followers to release whatever happens.
struct Run<'a> {
    followers: &'a mut VecDeque<MaterialResponse>,
    fetched_at: Instant,
    release: Vec<String>,
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
                        let mut map = self.shared.lanes.lock().expect("unpoisoned");
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
            let in_hand: Vec<Arc<Source>> = chunk.iter().map(|j| j.source.clone()).collect();
            let work = self.work(chunk);
            tokio::pin!(work);
            let leftover = loop {
                tokio::select! {
                    leftover = &mut work => break leftover,
                    Some(next) = rx.recv() => queue.push_back(next),
                    _ = tick.tick() => {
                        for source in in_hand.iter().chain(queue.iter().map(|j| &j.source)) {
                            source.in_progress().await;
                        }
                    }
                }
            };
            for job in leftover.into_iter().rev() {
                queue.push_front(job);
            }
        }
    }

    /// Fetches material, in one go, for the jobs of the chunk that do not
    /// hold fresh material, then sends the chunk's attempts one after
    /// another, or as many at once as the endpoint's own `max_in_flight`.
    /// Returns the jobs it did not get to (material gone stale behind a slow
    /// attempt, or shutdown), in order. Copies of an attempt
    /// already in hand go back to the broker (or, sent lately, are acked)
    /// before anything is asked for them.
    async fn work(&self, chunk: Vec<Job>) -> Vec<Job> {
        let mut mine = Vec::with_capacity(chunk.len());
        for job in chunk {
            let key = AttemptKey::of(&job.job);
            let sent_lately = job.material.is_some() && self.shared.sent_lately.holds(&key);
            if sent_lately {
                tracing::debug!(delivery_id = %job.job.delivery_id, attempt = job.job.attempt, "a copy of an attempt sent lately; acking the duplicate");
                job.source.settle(Verdict::Ack).await;
            } else if !self.shared.unsettled.lock().expect("unpoisoned").insert(key.clone()) {
                tracing::debug!(delivery_id = %job.job.delivery_id, attempt = job.job.attempt, "a copy of this attempt is already in hand; asking for it back after the claim");
                job.source.back_after(self.shared.claim_hold).await;
            } else if let Some(kept) = self.shared.unreported.take(&key) {
                // Sent already: its outcome goes to the api, not a second request to the receiver.
                tracing::info!(delivery_id = %job.job.delivery_id, attempt = job.job.attempt, "an attempt whose outcome the api had not taken came back; reporting it");
                self.shared.report_spawned(job.source, kept.job, kept.event_id, kept.outcome, (false, false), tracing::Span::current());
            } else {
                mine.push(job);
            }
        }
        let stale = |j: &Job| j.material.as_ref().is_none_or(|(_, at)| at.elapsed() > MATERIAL_FRESH);
        let asked: Vec<usize> = (0..mine.len()).filter(|&i| stale(&mine[i])).collect();
        let fetched = futures::future::join_all(asked.iter().map(|&i| {
            let job = &mine[i].job;
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
        for (i, material) in asked.into_iter().zip(fetched) {
            if let Some((Ok(old), _)) = mine[i].material.replace((material, fetched_at)) {
                mine[i].release.extend(old.followers.into_iter().map(|f| f.delivery_id));
            }
        }
        // As many at once as the endpoint's own cap says (the api handed out
        // no more than it across dispatchers); without one, one at a time.
        let at_once = mine
            .iter()
            .filter_map(|j| j.material.as_ref().and_then(|(m, _)| m.as_ref().ok()).map(|m| m.max_in_flight as usize))
            .max()
            .unwrap_or(0)
            .clamp(1, PREFETCH);
        let leftover = std::sync::Mutex::new(Vec::new());
        futures::StreamExt::for_each_concurrent(futures::stream::iter(mine.into_iter().enumerate()), at_once, |(i, job)| {
            let leftover = &leftover;
            async move {
                // The first `at_once` start now; a later one starts only as
                // an earlier one ends, and not with material gone stale
                // behind it, nor after shutdown.
                let old = job.material.as_ref().is_none_or(|(_, at)| at.elapsed() > MATERIAL_FRESH);
                if i >= at_once && (old || *self.shared.stop.borrow()) {
                    self.shared.unsettled.lock().expect("unpoisoned").remove(&AttemptKey::of(&job.job));
                    leftover.lock().expect("unpoisoned").push((i, job));
                } else {
                    self.send_one(job).await;
                }
            }
        })
        .await;
        let mut leftover = leftover.into_inner().expect("unpoisoned");
        leftover.sort_by_key(|(i, _)| *i);
        leftover.into_iter().map(|(_, job)| job).collect()
    }

    /// Sends a job's attempt and has it reported; then, for a lane head
    /// that came with followers (the lane's next deliveries), each follower
    /// in turn on its predecessor's 2xx, without waiting for that outcome to
    /// be recorded: a key's deliveries go back to back at the receiver's
    /// pace. The run stops at the first attempt without a 2xx (the rest wait
    /// in the lane, promoted as usual), at shutdown, when the material has
    /// gone stale, or at a follower already in hand.
    async fn send_one(&self, Job { source, job, material, release }: Job) {
        let (mut head, fetched_at) = match material {
            Some((Ok(head), fetched_at)) => (head, fetched_at),
            other => {
                self.send_attempt(source, job, other.map(|(m, _)| m), false, None).await;
                return;
            }
        };
        let mut followers: VecDeque<MaterialResponse> = std::mem::take(&mut head.followers).into();
        let mut next = Some((source, job, head, false));
        let mut release = Some(release);
        while let Some((source, job, material, follower)) = next.take() {
            let run = Run { followers: &mut followers, fetched_at, release: release.take().unwrap_or_default() };
            let goes_on = self.send_attempt(source, job, Some(Ok(material)), follower, Some(run)).await;
            if goes_on != Some(true) {
                return;
            }
            let Some(material) = followers.pop_front() else { return };
            let job = job_of(&material);
            if !self.shared.unsettled.lock().expect("unpoisoned").insert(AttemptKey::of(&job)) {
                // Handed here again as a lane head meanwhile: that copy
                // goes on with the lane, followers of its own included.
                return;
            }
            let traceparent = Some(material.traceparent.clone()).filter(|t| !t.is_empty());
            next = Some((Arc::new(Source::InHand { traceparent }), job, material, true));
        }
    }

    /// Sends one attempt (a lane follower's when `follower`) and reports
    /// it. `run`: the followers still to send after it, and when the run's
    /// material was read. Whether the run goes on: the attempt got a 2xx
    /// with nothing asking the lane to slow down, the material is fresh and
    /// this process is not stopping; if not, the report releases the
    /// followers left.
    async fn send_attempt(
        &self,
        source: Arc<Source>,
        job: DeliveryJob,
        material: Option<Result<MaterialResponse, tonic::Status>>,
        follower: bool,
        run: Option<Run<'_>>,
    ) -> Option<bool> {
        let material = match material {
            Some(Ok(m)) => m,
            Some(Err(st)) => {
                let v = verdict(&st, false);
                match v {
                    Verdict::Ack => tracing::debug!(delivery_id = %job.delivery_id, message = st.message(), "nothing to send for this job"),
                    _ => {
                        tracing::warn!(delivery_id = %job.delivery_id, code = ?st.code(), message = st.message(), verdict = ?v, "no material for this job")
                    }
                }
                self.shared.unsettled.lock().expect("unpoisoned").remove(&AttemptKey::of(&job));
                if crate::verdict::reason_of(&st) == Some(relay_domain::Reason::InHandElsewhere) {
                    source.retry_soon().await;
                } else {
                    source.settle(v).await;
                }
                return None;
            }
            None => unreachable!("every job sent has been given or fetched its material"),
        };
        // The attempt's span continues the delivery's trace (the relay put
        // its context in the message headers; an expansion's attempt in hand
        // carries its event's) and covers the POST and the report.
        let span = tracing::info_span!(
            "attempt",
            delivery_id = %job.delivery_id, endpoint_id = %job.endpoint_id, attempt = job.attempt, generation = job.generation,
            http_status = tracing::field::Empty, latency_ms = tracing::field::Empty, outcome = tracing::field::Empty,
        );
        match &*source {
            Source::Broker(msg) => {
                if let Some(headers) = &msg.headers {
                    relay_telemetry::set_parent(&span, &relay_telemetry::NatsHeadersRef(headers));
                }
            }
            Source::InHand { traceparent: Some(tc) } => relay_telemetry::set_parent_from_traceparent(&span, tc),
            Source::InHand { traceparent: None } => {}
        }
        let key = AttemptKey::of(&job);
        let event_id = material.event_id.clone();
        tracing::debug!(delivery_id = %job.delivery_id, attempt = job.attempt, follower, followers = material.followers.len(),
            by_broker = matches!(&*source, Source::Broker(_)), claimant = %self.shared.claimant, "sending");
        // A lane head's successor waits on this outcome to be promoted.
        let urgent = !material.ordering_key.is_empty();
        tracing::debug!(target: "relay_hops", hop = "attempt_ready", event_id = %event_id, attempt = job.attempt);
        let outcome = async {
            let _permit = self.shared.permits.clone().acquire_owned().await.expect("semaphore open");
            // At the last moment, after any wait for a permit: an endpoint
            // switched off meanwhile gets no request from here on.
            let _on_wire = self.shared.switches.on_wire(&key)?;
            Some(attempt::send(&self.shared.sender, material).await)
        }
        .instrument(span.clone())
        .await;
        let Some(outcome) = outcome else {
            tracing::info!(delivery_id = %job.delivery_id, endpoint_id = %job.endpoint_id, attempt = job.attempt, "its endpoint was switched off before this attempt started; not sent");
            self.shared.unsettled.lock().expect("unpoisoned").remove(&key);
            source.settle(Verdict::Ack).await;
            return None;
        };
        tracing::debug!(target: "relay_hops", hop = "attempt_posted", event_id = %event_id, attempt = job.attempt);
        if let Some(status) = outcome.http_status {
            span.record("http_status", status);
        }
        span.record("latency_ms", outcome.latency_ms);
        let pause = attempt::back_pressure(&outcome);
        let delivered = pause.is_none() && outcome.http_status.is_some_and(|s| (200..300).contains(&s));
        let mut outcome = outcome;
        outcome.lane_follower = follower;
        let mut goes_on = false;
        if let Some(Run { followers, fetched_at, release }) = run {
            goes_on = delivered && !*self.shared.stop.borrow() && fetched_at.elapsed() <= MATERIAL_FRESH;
            outcome.released_followers = release;
            if goes_on {
                outcome.next_follower = followers.front().map(|f| f.delivery_id.clone()).unwrap_or_default();
            } else {
                outcome.released_followers.extend(followers.drain(..).map(|f| f.delivery_id));
            }
        }
        // The lane moves on to its next attempt while this one is reported.
        self.shared.report_spawned(source, job, event_id, outcome, (urgent, follower), span);
        // The receiver asked to be sent less: its next request waits (the
        // jobs queued meanwhile keep their place; material that goes stale
        // is fetched again). Shutdown does not wait for it.
        if let Some(pause) = pause {
            tracing::debug!(endpoint_id = %self.key, pause_ms = pause.as_millis() as u64, "the receiver asked to slow down");
            let mut stop = self.shared.stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.wait_for(|stopped| *stopped) => {}
            }
        }
        Some(goes_on)
    }
}
