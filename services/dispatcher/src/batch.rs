//! Coalesces single-item seam calls into batch RPCs.
//!
//! Callers ask for one item and await its answer; a worker gathers whatever
//! is waiting into one call. While every call slot is busy, requests pile up
//! and the next call carries all of them, so batches grow with load and a
//! lone request still goes out at once (no timer, no added latency when idle).

use std::{future::Future, sync::Arc};

use relay_contracts::relay::dispatch::v1::{
    self as pb, ExpandBatchRequest, ExpandRequest, ExpandResponse, MaterialBatchRequest, MaterialRequest, MaterialResponse,
    OutcomeBatchRequest, OutcomeRequest, OutcomeResponse,
};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tonic::{Code, Status};

use crate::seam::Seam;

type Reply<T> = oneshot::Sender<Result<T, Status>>;

pub struct Batcher<Req, Resp> {
    tx: mpsc::UnboundedSender<(Req, Reply<Resp>)>,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone() }
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// `call` answers a batch item by item, in order, or fails as a whole.
    pub fn spawn<F, Fut>(max_batch: usize, calls_in_flight: usize, call: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Result<Resp, Status>>, Status>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Req, Reply<Resp>)>();
        let slots = Arc::new(Semaphore::new(calls_in_flight));
        let call = Arc::new(call);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Wait for a call slot before gathering: whatever arrives
                // meanwhile rides along.
                let slot = slots.clone().acquire_owned().await.expect("semaphore open");
                let mut items = vec![first];
                while items.len() < max_batch {
                    match rx.try_recv() {
                        Ok(item) => items.push(item),
                        Err(_) => break,
                    }
                }
                let call = call.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    let (reqs, replies): (Vec<Req>, Vec<Reply<Resp>>) = items.into_iter().unzip();
                    let n = reqs.len();
                    match call(reqs).await {
                        Ok(answers) if answers.len() == n => {
                            for (reply, answer) in replies.into_iter().zip(answers) {
                                let _ = reply.send(answer);
                            }
                        }
                        Ok(answers) => {
                            let st = Status::internal(format!("a batch of {n} came back with {} answers", answers.len()));
                            for reply in replies {
                                let _ = reply.send(Err(st.clone()));
                            }
                        }
                        Err(st) => {
                            for reply in replies {
                                let _ = reply.send(Err(st.clone()));
                            }
                        }
                    }
                });
            }
        });
        Self { tx }
    }

    pub async fn call(&self, req: Req) -> Result<Resp, Status> {
        let (reply, answer) = oneshot::channel();
        self.tx.send((req, reply)).map_err(|_| Status::unavailable("the batcher has stopped"))?;
        answer.await.map_err(|_| Status::unavailable("the batch call was dropped"))?
    }
}

fn item_status(e: pb::ItemError) -> Status {
    Status::new(Code::from_i32(e.code), e.message)
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

pub fn expansions(seam: Seam) -> Expansions {
    Batcher::spawn(MAX_BATCH, CALLS_IN_FLIGHT, move |items| {
        let mut seam = seam.clone();
        async move { Ok(seam.expand_batch(ExpandBatchRequest { items }).await?.into_inner().items.into_iter().map(Answer::answer).collect()) }
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

pub fn outcomes(seam: Seam) -> Outcomes {
    Batcher::spawn(MAX_BATCH, CALLS_IN_FLIGHT, move |items| {
        let mut seam = seam.clone();
        async move { Ok(seam.outcome_batch(OutcomeBatchRequest { items }).await?.into_inner().items.into_iter().map(Answer::answer).collect()) }
    })
}
