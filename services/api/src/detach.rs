//! Request handling that a client cannot cancel.
//!
//! hyper drops a handler's future when its client goes away. A future dropped
//! in the middle of database work can leave a transaction half begun (see
//! [`crate::db`]) or a decision half made; the client's disconnect is no
//! reason to stop either. Every server of the api wraps its routes in
//! [`DetachLayer`]: each call runs in a task of its own, and a vanished
//! client only means nobody reads the answer.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use relay_domain::Reason;
use tower::{Layer, Service};

#[derive(Debug, Clone, Copy, Default)]
pub struct DetachLayer;

impl<S> Layer<S> for DetachLayer {
    type Service = Detach<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Detach(inner)
    }
}

#[derive(Debug, Clone)]
pub struct Detach<S>(S);

impl<S, Req> Service<Req> for Detach<S>
where
    S: Service<Req>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let running = tokio::spawn(self.0.call(req));
        Box::pin(async move {
            match running.await {
                Ok(answer) => answer,
                // A handler that panicked fails its caller as it did before
                // it ran in a task of its own.
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Cancelled only when the runtime itself shuts down: nobody
                // is left to answer.
                Err(_) => std::future::pending().await,
            }
        })
    }
}

pub use crate::app::TENANT_WORK_DEADLINE;

/// What a caller past the deadline is told.
pub fn past_deadline(after: std::time::Duration) -> crate::error::AppError {
    crate::error::AppError::new(
        crate::error::ErrorCode::Unavailable,
        Reason::NotConfirmed,
        format!(
            "the request did not finish within {} s (the database has not confirmed it); whether it took effect is unknown: \
             retry it (a publish with the same event id is idempotent)",
            after.as_secs_f64()
        ),
    )
}

/// Answers a gRPC caller UNAVAILABLE after a deadline (see
/// [`TENANT_WORK_DEADLINE`]). Goes outside [`DetachLayer`], so giving up on
/// the answer never cancels the work.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer(pub std::time::Duration);

impl<S> Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Deadline { inner, after: self.0 }
    }
}

#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    after: std::time::Duration,
}

impl<S, Req, B> Service<Req> for Deadline<S>
where
    S: Service<Req, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let (answer, after) = (self.inner.call(req), self.after);
        Box::pin(async move {
            match tokio::time::timeout(after, answer).await {
                Ok(answer) => answer,
                Err(_) => Ok(crate::grpc::status(past_deadline(after)).into_http()),
            }
        })
    }
}
