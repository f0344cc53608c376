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
