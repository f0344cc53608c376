//! Coalesces single-item seam calls into batch RPCs.
//!
//! Callers ask for one item and await its answer; a worker gathers whatever
//! is waiting into one call. While every call slot is busy, requests pile up
//! and the next call carries all of them, so batches grow with load and a
//! lone request still goes out at once (no timer, no added latency when idle).

use std::{future::Future, pin::Pin, sync::Arc};

use relay_contracts::relay::dispatch::v1::{
    self as pb, ExpandBatchRequest, ExpandRequest, ExpandResponse, MaterialBatchRequest, MaterialRequest, MaterialResponse,
    OutcomeBatchRequest, OutcomeRequest, OutcomeResponse,
};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tonic::{Code, Status};

use crate::seam::Seam;

type Reply<T> = oneshot::Sender<Result<T, Status>>;

/// A request waiting for a call to carry it.
struct Item<Req, Resp> {
    req: Req,
    /// Where its answer goes.
    reply: Reply<Resp>,
    /// Someone waits on it to go on: the call it rides in lingers no longer.
    urgent: bool,
    /// How many times it was answered deferred and put back.
    requeued: u32,
}

/// Times an item answered deferred goes back in the queue before the
/// answer is its caller's. A deferred expansion waits for its key's
/// earlier event, usually in a call beside it; one whose earlier event is
/// nowhere in flight (still in the broker, or queued behind it in the
/// dispatcher's turns) would otherwise ride every call for ever, and hold
/// its caller — and its environment's turn — meanwhile: with every turn of
/// an environment so held, the earlier events never started (the crash
/// torture's silent stalls).
const REQUEUES: u32 = 16;

pub struct Batcher<Req, Resp> {
    tx: mpsc::UnboundedSender<Item<Req, Resp>>,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone() }
    }
}

type Call<Req, Resp> = dyn Fn(Vec<Req>) -> Pin<Box<dyn Future<Output = Result<Vec<Result<Resp, Status>>, Status>> + Send>> + Send + Sync;

impl<Req: Clone + Send + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// `call` answers a batch item by item, in order, or fails as a whole.
    /// An item answered `deferred` (see [`relay_domain::Reason::Deferred`])
    /// goes back in the queue, behind whatever waits, for the next call (at
    /// most `REQUEUES` times, then the caller is answered deferred); a
    /// batch that fails as a whole for what may be one item's sake is split
    /// until the failure is that item's alone.
    pub fn spawn<F, Fut>(max_batch: usize, calls_in_flight: usize, call: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Result<Resp, Status>>, Status>> + Send + 'static,
    {
        Self::spawn_lingering(max_batch, calls_in_flight, std::time::Duration::ZERO, call)
    }

    /// As `spawn`, but a call that could carry more waits up to `linger`
    /// after its first item for others to ride along: for requests whose
    /// answer nobody is waiting on to go on (outcomes), so that moderate load
    /// makes a few calls of several items rather than one call per item.
    /// An item sent with [`Batcher::call_now`] ends the wait: the call goes
    /// out with what has gathered so far.
    pub fn spawn_lingering<F, Fut>(max_batch: usize, calls_in_flight: usize, linger: std::time::Duration, call: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Result<Resp, Status>>, Status>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Item<Req, Resp>>();
        let requeue = tx.downgrade();
        let slots = Arc::new(Semaphore::new(calls_in_flight));
        let call: Arc<Call<Req, Resp>> = Arc::new(move |reqs| Box::pin(call(reqs)));
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Wait for a call slot before gathering: whatever arrives
                // meanwhile rides along.
                let slot = slots.clone().acquire_owned().await.expect("semaphore open");
                let mut urgent = first.urgent;
                let mut items = vec![first];
                let until = tokio::time::Instant::now() + linger;
                while items.len() < max_batch {
                    match rx.try_recv() {
                        Ok(item) => {
                            urgent |= item.urgent;
                            items.push(item)
                        }
                        Err(_) if linger.is_zero() || urgent => break,
                        Err(_) => match tokio::time::timeout_at(until, rx.recv()).await {
                            Ok(Some(item)) => {
                                urgent |= item.urgent;
                                items.push(item)
                            }
                            _ => break,
                        },
                    }
                }
                let (call, requeue) = (call.clone(), requeue.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    run(&*call, items, &requeue).await;
                });
            }
        });
        Self { tx }
    }

    pub async fn call(&self, req: Req) -> Result<Resp, Status> {
        self.send(req, false).await
    }

    /// As `call`, for an answer someone waits on to go on: the call that
    /// carries it leaves without lingering.
    pub async fn call_now(&self, req: Req) -> Result<Resp, Status> {
        self.send(req, true).await
    }

    async fn send(&self, req: Req, urgent: bool) -> Result<Resp, Status> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Item { req, reply, urgent, requeued: 0 }).map_err(|_| Status::unavailable("the batcher has stopped"))?;
        answer.await.map_err(|_| Status::unavailable("the batch call was dropped"))?
    }
}

/// Whether a whole-batch failure might be one item's doing (a message too
/// large, an item the api refuses to decode), so that smaller batches are
/// worth trying; not when the api is away or refuses the caller.
fn may_be_one_items(st: &Status) -> bool {
    !matches!(st.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unauthenticated | Code::PermissionDenied)
}

fn reason(st: &Status) -> Option<&str> {
    st.metadata().get(relay_contracts::ERROR_REASON_METADATA).and_then(|v| v.to_str().ok())
}

/// One batch call and its answers; on a failure that may be one item's,
/// each half again, down to single items.
fn run<'a, Req: Clone + Send + 'static, Resp: Send + 'static>(
    call: &'a Call<Req, Resp>,
    items: Vec<Item<Req, Resp>>,
    requeue: &'a mpsc::WeakUnboundedSender<Item<Req, Resp>>,
) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
    Box::pin(async move {
        let n = items.len();
        let reqs: Vec<Req> = items.iter().map(|item| item.req.clone()).collect();
        match call(reqs).await {
            Ok(answers) if answers.len() == n => {
                for (Item { req, reply, urgent, requeued }, answer) in items.into_iter().zip(answers) {
                    match answer {
                        Err(st) if reason(&st) == Some(relay_domain::Reason::Deferred.as_str()) && requeued < REQUEUES => {
                            match requeue.upgrade() {
                                Some(tx) => {
                                    if let Err(mpsc::error::SendError(item)) = tx.send(Item { req, reply, urgent, requeued: requeued + 1 })
                                    {
                                        let _ = item.reply.send(Err(st));
                                    }
                                }
                                None => {
                                    let _ = reply.send(Err(st));
                                }
                            }
                        }
                        answer => {
                            let _ = reply.send(answer);
                        }
                    }
                }
            }
            Ok(answers) => {
                let st = Status::internal(format!("a batch of {n} came back with {} answers", answers.len()));
                for item in items {
                    let _ = item.reply.send(Err(st.clone()));
                }
            }
            Err(st) if n > 1 && may_be_one_items(&st) => {
                tracing::warn!(items = n, code = ?st.code(), message = st.message(), "a seam batch failed as a whole; retrying it in halves");
                let mut items = items;
                let second = items.split_off(n / 2);
                run(call, items, requeue).await;
                run(call, second, requeue).await;
            }
            Err(st) => {
                for item in items {
                    let _ = item.reply.send(Err(st.clone()));
                }
            }
        }
    })
}

/// An item's error as the status the single call would have answered,
/// with its reason where the rest of the dispatcher can read it.
fn item_status(e: pb::ItemError) -> Status {
    let mut st = Status::new(Code::from_i32(e.code), e.message);
    if let Ok(v) = e.reason.parse() {
        st.metadata_mut().insert(relay_contracts::ERROR_REASON_METADATA, v);
    }
    st
}

/// The most items per batch; the api refuses more than 1000.
const MAX_BATCH: usize = 256;
/// Batch calls of each kind in flight at once.
const CALLS_IN_FLIGHT: usize = 2;

pub type Materials = Batcher<MaterialRequest, MaterialResponse>;
pub type Outcomes = Batcher<OutcomeRequest, OutcomeResponse>;
pub type Expansions = Batcher<ExpandRequest, ExpandResponse>;

/// One item of a batch answer: its value, or why that item failed.
trait Answer<T> {
    fn answer(self) -> Result<T, Status>;
}

macro_rules! answer {
    ($result:ty, $module:ident :: $ok:ident => $value:ty) => {
        impl Answer<$value> for $result {
            fn answer(self) -> Result<$value, Status> {
                match self.result {
                    Some(pb::$module::Result::$ok(v)) => Ok(v),
                    Some(pb::$module::Result::Error(e)) => Err(item_status(e)),
                    None => Err(Status::internal("an empty batch item")),
                }
            }
        }
    };
}
answer!(pb::ExpandResult, expand_result::Expanded => ExpandResponse);
answer!(pb::MaterialResult, material_result::Material => MaterialResponse);
answer!(pb::OutcomeResult, outcome_result::Outcome => OutcomeResponse);

/// Expansions that hand their first attempts to `claimant` for `hold`;
/// `express` ones for the api's express queue (`ExpandBatchRequest.express`).
pub fn expansions(seam: Seam, claimant: String, hold: std::time::Duration, express: bool) -> Expansions {
    let hold_ms = u32::try_from(hold.as_millis()).unwrap_or(u32::MAX);
    Batcher::spawn(MAX_BATCH, CALLS_IN_FLIGHT, move |items| {
        let (mut seam, claimant) = (seam.clone(), claimant.clone());
        async move {
            let req = ExpandBatchRequest { items, claimant, hold_ms, express };
            Ok(seam.expand_batch(req).await?.into_inner().items.into_iter().map(Answer::answer).collect())
        }
    })
}

pub fn materials(seam: Seam) -> Materials {
    Batcher::spawn(MAX_BATCH, CALLS_IN_FLIGHT, move |items| {
        let mut seam = seam.clone();
        async move {
            Ok(seam.material_batch(MaterialBatchRequest { items }).await?.into_inner().items.into_iter().map(Answer::answer).collect())
        }
    })
}

/// How long an outcome call waits for others to join it. Mostly nothing
/// waits on an outcome to go on (the lane has moved to its next attempt; the
/// job's ack and the endpoint's in-flight slot follow a few milliseconds
/// later), and at moderate load it turns a call per attempt into one per
/// several. A lane head's outcome is the exception (its key's next delivery
/// waits on it): it goes with `call_now`.
const OUTCOME_LINGER: std::time::Duration = std::time::Duration::from_millis(10);

/// Outcomes that ask for their endpoints' next attempts, for `claimant` for `hold`.
pub fn outcomes(seam: Seam, claimant: String, hold: std::time::Duration) -> Outcomes {
    let hold_ms = u32::try_from(hold.as_millis()).unwrap_or(u32::MAX);
    Batcher::spawn_lingering(MAX_BATCH, CALLS_IN_FLIGHT, OUTCOME_LINGER, move |items| {
        let (mut seam, claimant) = (seam.clone(), claimant.clone());
        async move {
            let req = OutcomeBatchRequest { items, claimant, hold_ms };
            Ok(seam.outcome_batch(req).await?.into_inner().items.into_iter().map(Answer::answer).collect())
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn deferred() -> Status {
        let mut st = Status::unavailable("budget spent");
        st.metadata_mut().insert(relay_contracts::ERROR_REASON_METADATA, relay_domain::Reason::Deferred.as_str().parse().unwrap());
        st
    }

    /// A fake api: serves at most three items per reply (deferring the
    /// rest), and fails any batch holding item 13 as a whole — as an
    /// oversized message would — while 13 alone gets its own error.
    #[tokio::test]
    async fn deferred_items_come_back_and_one_bad_item_fails_alone() {
        let calls: Arc<Mutex<Vec<Vec<u32>>>> = Default::default();
        let seen = calls.clone();
        let batcher: Batcher<u32, u32> = Batcher::spawn(64, 1, move |items: Vec<u32>| {
            seen.lock().unwrap().push(items.clone());
            async move {
                if items.len() > 1 && items.contains(&13) {
                    return Err(Status::resource_exhausted("message too large"));
                }
                Ok(items
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| match x {
                        13 => Err(Status::invalid_argument("thirteen")),
                        _ if i >= 3 => Err(deferred()),
                        _ => Ok(x * 10),
                    })
                    .collect())
            }
        });
        let answers = futures::future::join_all((0..20u32).map(|x| {
            let b = batcher.clone();
            async move { (x, b.call(x).await) }
        }))
        .await;
        for (x, answer) in answers {
            match x {
                13 => assert_eq!(answer.unwrap_err().code(), Code::InvalidArgument),
                _ => assert_eq!(answer.unwrap(), x * 10, "item {x}"),
            }
        }
        assert!(calls.lock().unwrap().iter().all(|c| c.len() <= 64));
    }

    /// A batcher over a fake api that answers each call as `answer` says,
    /// and the count of its calls.
    fn counting_batcher(
        answer: impl Fn(Vec<u32>) -> Result<Vec<Result<u32, Status>>, Status> + Send + Sync + 'static,
    ) -> (Batcher<u32, u32>, Arc<std::sync::atomic::AtomicUsize>) {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let batcher = Batcher::spawn(64, 1, move |items: Vec<u32>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::ready(answer(items))
        });
        (batcher, calls)
    }

    /// An item the api keeps deferring (its key's earlier event is nowhere
    /// in flight) is answered deferred after `REQUEUES` more calls, so its
    /// caller can let go (and the event's turn with it), instead of riding
    /// every call for ever while the caller waits.
    #[tokio::test]
    async fn an_item_deferred_again_and_again_is_answered_deferred() {
        let (batcher, calls) = counting_batcher(|items| Ok(items.into_iter().map(|_| Err(deferred())).collect()));
        let answer = tokio::time::timeout(std::time::Duration::from_secs(5), batcher.call(7))
            .await
            .expect("the caller is answered, not kept waiting while the item rides every call");
        assert_eq!(reason(&answer.unwrap_err()), Some(relay_domain::Reason::Deferred.as_str()));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), REQUEUES as usize + 1, "the first call and one per requeue");
    }

    /// A lingering call waits for company; an urgent item (a lane head's
    /// outcome, which its key's next delivery waits on) sends at once what
    /// has gathered. Time is paused: the linger is measured on the clock the
    /// batcher reads, not by how fast this machine is.
    #[tokio::test(start_paused = true)]
    async fn an_urgent_item_ends_the_linger() {
        let linger = std::time::Duration::from_secs(10);
        let batcher: Batcher<u32, u32> =
            Batcher::spawn_lingering(64, 1, linger, |items: Vec<u32>| async move { Ok(items.into_iter().map(Ok).collect()) });
        let started = tokio::time::Instant::now();
        assert_eq!(batcher.call(1).await.unwrap(), 1);
        assert!(started.elapsed() >= linger, "a plain call lingered: {:?}", started.elapsed());

        let started = tokio::time::Instant::now();
        let (plain, urgent) = tokio::join!(batcher.call(2), async {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            batcher.call_now(3).await
        });
        assert_eq!((plain.unwrap(), urgent.unwrap()), (2, 3));
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "the urgent item waited out the linger: {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn an_api_that_is_away_fails_the_batch_without_splitting_it() {
        let (batcher, calls) = counting_batcher(|_| Err(Status::unavailable("connection refused")));
        let (a, b) = tokio::join!(batcher.call(1), batcher.call(2));
        assert_eq!(a.unwrap_err().code(), Code::Unavailable);
        assert_eq!(b.unwrap_err().code(), Code::Unavailable);
        assert!(calls.load(std::sync::atomic::Ordering::SeqCst) <= 2, "not retried item by item");
    }
}
