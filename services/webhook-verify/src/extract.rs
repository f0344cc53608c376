//! An axum extractor: the handler runs only for a verified webhook.

use axum::{
    body::Bytes,
    extract::{FromRef, FromRequest, Request},
    http::StatusCode,
    response::{IntoResponse, Response},
};

use crate::{Error, Verified, Verifier};

/// A verified webhook: its id (deduplicate on it), timestamp and raw body.
/// The state must give a [`Verifier`] (`FromRef`). A request that fails is
/// answered 400 (headers missing or malformed) or 401 (signature or
/// timestamp), and Relay retries it as a failure.
#[derive(Debug, Clone)]
pub struct VerifiedWebhook {
    pub id: String,
    pub timestamp: i64,
    pub body: Bytes,
}

/// Why the extractor refused a request.
#[derive(Debug)]
pub struct Refused(pub Error);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let status = match self.0 {
            Error::MissingHeaders | Error::MalformedTimestamp => StatusCode::BAD_REQUEST,
            Error::OutsideTolerance { .. } | Error::NoMatchingSignature => StatusCode::UNAUTHORIZED,
        };
        (status, self.0.to_string()).into_response()
    }
}

impl<S> FromRequest<S> for VerifiedWebhook
where
    S: Send + Sync,
    Verifier: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let verifier = Verifier::from_ref(state);
        let headers = req.headers().clone();
        let body = Bytes::from_request(req, state).await.map_err(IntoResponse::into_response)?;
        let Verified { id, timestamp } = verifier.verify(&headers, &body).map_err(|e| Refused(e).into_response())?;
        Ok(Self { id, timestamp, body })
    }
}
