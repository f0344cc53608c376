//! Hot paths on connections of their own.
//!
//! A call through the pool costs two round trips besides its statements:
//! the check that the connection is not left inside a transaction (see the
//! module above) and sqlx's ping when the connection is given back. At
//! moderate load, where a batch holds a few items, those round trips — each
//! a wake-up of Postgres and of the caller — were most of the database's
//! CPU per delivery. A [`Batcher`] holds its connections for good: work is
//! queued to it, and each connection in turn takes everything that waits (up
//! to a bound) and runs it as one batch, so batches grow with load with no
//! timer, like the dispatcher's seam batcher.
//!
//! Cancellation: the caller awaits an answer, not the work. A caller that
//! goes away drops its receiver; the batch it was part of runs to its end on
//! the batcher's own task, so no statement or transaction is ever cut off at an
//! await point. A batcher stops between batches, at shutdown.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    time::Duration,
};

use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::{Mutex, mpsc, oneshot, watch};

use crate::error::{AppError, AppResult, ErrorCode};

type Reply<Resp> = oneshot::Sender<AppResult<Resp>>;
/// An item, whether it was taken or given up on, and where its answer goes.
type Queued<Req, Resp> = (Req, Arc<AtomicU8>, Reply<Resp>);

/// An item waits in the queue…
const QUEUED: u8 = 0;
/// …until a batch takes it (then it runs, and its caller waits for it)…
const TAKEN: u8 = 1;
/// …or its caller stops waiting first (then it never runs).
const ABANDONED: u8 = 2;

/// What one batch does with its connection: answers item by item, in
/// order, or fails as a whole.
pub type Handler<Req, Resp> = Arc<dyn for<'c> Fn(&'c mut PgConnection, &'c [Req]) -> BatchFuture<'c, Resp> + Send + Sync>;

/// A batch being run on a connection.
pub type BatchFuture<'c, Resp> = Pin<Box<dyn Future<Output = BatchResult<Resp>> + Send + 'c>>;

/// A batch's answers, one per item in order, or the batch's failure.
pub type BatchResult<Resp> = AppResult<Vec<AppResult<Resp>>>;

pub struct Batcher<Req, Resp> {
    tx: mpsc::UnboundedSender<Queued<Req, Resp>>,
    queue_timeout: Duration,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone(), queue_timeout: self.queue_timeout }
    }
}

impl<Req, Resp> std::fmt::Debug for Batcher<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

/// How a batcher runs.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Connections it holds, each taking its own batches.
    pub connections: usize,
    /// Items one batch takes at most.
    pub max_batch: usize,
    /// Plan each statement once per connection (`plan_cache_mode =
    /// force_generic_plan`). By default Postgres plans a prepared statement
    /// again at every execution while its plan for the given parameters
    /// looks cheaper than the general one, which for a statement of many
    /// CTEs over arrays is most of its cost: 3–5 ms to plan an expansion or
    /// an outcome batch that runs in less. The general plan takes every
    /// array for ten elements, so it is only for statements whose cost does
    /// not hinge on that estimate: lookups written as ids by index
    /// (`INDEXED_LOOKUPS`) and no batch-sized set joined to another
    /// (`JOINS_BY_ESTIMATE`, both in `db::deliveries`). An earlier version
    /// of these statements did join CTEs, and the general plan looped over
    /// them (an expansion of 209 events compared 11.6 million pairs, 2.6 s),
    /// so large batches were planned for their size; planning is now the
    /// same at every size.
    pub plan_once: bool,
}

/// A connection a long-running task holds for good, apart from the pool:
/// opened when first needed, dropped after an error that may have broken
/// it (the next use opens another), to wherever the pool connects by then
/// (after a failover, the new primary: see [`super::primary`]).
pub struct KeptConnection {
    pool: PgPool,
    conn: Option<PgConnection>,
    plan_once: bool,
}

impl KeptConnection {
    pub fn new(pool: &PgPool) -> Self {
        Self { pool: pool.clone(), conn: None, plan_once: false }
    }

    /// A connection whose statements are planned once (see
    /// [`Shape::plan_once`]).
    pub fn planning_once(pool: &PgPool) -> Self {
        Self { plan_once: true, ..Self::new(pool) }
    }

    pub async fn get(&mut self) -> AppResult<&mut PgConnection> {
        if self.conn.is_none() {
            let mut conn = PgConnection::connect_with(&self.pool.connect_options()).await?;
            if self.plan_once {
                sqlx::raw_sql("SET plan_cache_mode = force_generic_plan").execute(&mut conn).await?;
            }
            self.conn = Some(conn);
        }
        Ok(self.conn.as_mut().expect("just opened"))
    }

    /// After an error other than a lost conflict (which leaves the
    /// connection as good as it was), the connection is let go.
    pub fn after_error(&mut self, e: &AppError) {
        if !e.lost_a_conflict() {
            self.conn = None;
        }
    }

    /// Lets the connection go after an error whose kind is not known.
    pub fn forget(&mut self) {
        self.conn = None;
    }

    /// Closes the connection politely (at shutdown).
    pub async fn close(&mut self) {
        if let Some(conn) = self.conn.take() {
            let _ = conn.close().await;
        }
    }
}

impl<Req: Send + Sync + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// `connections` tasks, each holding a connection to `pool`'s database
    /// (not one of the pool's own), take up to `max_batch` waiting items at a
    /// time until `stop`. A caller whose item is not taken within
    /// `queue_timeout` is answered UNAVAILABLE, and its item never runs, as a
    /// pool call that waited that long for a connection: the caller may
    /// retry, knowing nothing was written.
    pub fn spawn(pool: &PgPool, shape: Shape, queue_timeout: Duration, stop: watch::Receiver<bool>, handler: Handler<Req, Resp>) -> Self {
        let Shape { connections, max_batch, plan_once } = shape;
        let (tx, rx) = mpsc::unbounded_channel::<Queued<Req, Resp>>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..connections.max(1) {
            let held = if plan_once { KeptConnection::planning_once(pool) } else { KeptConnection::new(pool) };
            let (rx, handler, mut stop, mut held) = (rx.clone(), handler.clone(), stop.clone(), held);
            tokio::spawn(async move {
                loop {
                    let batch = {
                        let mut rx = rx.lock().await;
                        let mut batch = Vec::new();
                        while batch.is_empty() {
                            let first = tokio::select! {
                                first = rx.recv() => first,
                                _ = stop.wait_for(|stopped| *stopped) => None,
                            };
                            let Some(first) = first else {
                                held.close().await;
                                return;
                            };
                            take(&mut batch, first);
                            while batch.len() < max_batch {
                                match rx.try_recv() {
                                    Ok(item) => take(&mut batch, item),
                                    Err(_) => break,
                                }
                            }
                        }
                        batch
                    };
                    run(&mut held, &handler, batch).await;
                }
            });
        }
        Self { tx, queue_timeout }
    }

    /// Queues one item and waits for its answer.
    pub async fn call(&self, req: Req) -> AppResult<Resp> {
        self.call_all(vec![req]).await.pop().expect("one answer per item")
    }

    /// Queues many items at once (so they share a batch) and waits for all.
    pub async fn call_all(&self, reqs: Vec<Req>) -> Vec<AppResult<Resp>> {
        let mut waiting = Vec::with_capacity(reqs.len());
        for req in reqs {
            let (reply, answer) = oneshot::channel();
            let state = Arc::new(AtomicU8::new(QUEUED));
            match self.tx.send((req, state.clone(), reply)) {
                Ok(()) => waiting.push(Some((state, answer))),
                Err(_) => waiting.push(None),
            }
        }
        let deadline = tokio::time::Instant::now() + self.queue_timeout;
        let mut out = Vec::with_capacity(waiting.len());
        for item in waiting {
            let Some((state, mut answer)) = item else {
                out.push(Err(stopped()));
                continue;
            };
            let answered = match tokio::time::timeout_at(deadline, &mut answer).await {
                Ok(a) => a,
                // Not answered in time: given up, unless a batch took it
                // meanwhile (then it runs, and its answer is waited for).
                Err(_) if state.compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire).is_ok() => {
                    out.push(Err(overloaded()));
                    continue;
                }
                Err(_) => answer.await,
            };
            out.push(answered.map_err(|_| stopped()).and_then(|r| r));
        }
        out
    }
}

/// Adds an item to a batch unless its caller gave up on it first.
fn take<Req, Resp>(batch: &mut Vec<(Req, Reply<Resp>)>, (req, state, reply): Queued<Req, Resp>) {
    if state.compare_exchange(QUEUED, TAKEN, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        batch.push((req, reply));
    }
}

fn overloaded() -> AppError {
    AppError::unavailable(anyhow::anyhow!("the database is not keeping up: this waited too long for its turn, and did not run"))
}

fn stopped() -> AppError {
    AppError::unavailable(anyhow::anyhow!("the api is shutting down"))
}

/// How long a batcher waits before taking a new connection after one failed.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

/// One batch: its answers sent item by item. A batch that fails as a whole
/// for a reason that may be one item's (not the database being away, not a
/// lost conflict) is run again item by item, so one bad item fails alone.
async fn run<Req, Resp>(held: &mut KeptConnection, handler: &Handler<Req, Resp>, batch: Vec<(Req, Reply<Resp>)>) {
    let (reqs, replies): (Vec<Req>, Vec<Reply<Resp>>) = batch.into_iter().unzip();
    match run_once(held, handler, &reqs).await {
        Err(e) if reqs.len() > 1 && e.code != ErrorCode::Unavailable => {
            tracing::warn!(items = reqs.len(), error = ?e, "a database batch failed as a whole; running its items one by one");
            for (req, reply) in reqs.chunks(1).zip(replies) {
                let answer = match run_once(held, handler, req).await {
                    Ok(mut one) => one.pop().expect("one answer"),
                    Err(e) => Err(e),
                };
                let _ = reply.send(answer);
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.for_each()));
            }
        }
        Ok(answers) => {
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        }
    }
}

/// The batch on the held connection: exactly one answer per item, or the
/// batch's failure.
async fn run_once<Req, Resp>(held: &mut KeptConnection, handler: &Handler<Req, Resp>, reqs: &[Req]) -> BatchResult<Resp> {
    let n = reqs.len();
    let conn = match held.get().await {
        Ok(c) => c,
        Err(e) => {
            tokio::time::sleep(RECONNECT_PAUSE).await;
            return Err(e);
        }
    };
    match handler(conn, reqs).await {
        Ok(answers) if answers.len() == n => Ok(answers),
        Ok(answers) => Err(AppError::internal(anyhow::anyhow!("a batch of {n} came back with {} answers", answers.len()))),
        Err(e) => {
            held.after_error(&e);
            Err(e)
        }
    }
}
