//! Every error the REST facade answers: JSON `{code, message, reason}` with
//! the HTTP status grpc-gateway would use, and a message that never echoes
//! unbounded input.

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use relay_contracts::ERROR_REASON_METADATA;
use relay_domain::Reason;
use tonic::{Code, Status};

pub use crate::error::{MAX_MESSAGE_CHARS, bounded};

/// How long an overloaded api asks a client to wait before retrying.
pub const RETRY_AFTER_SECS: u64 = 1;

/// grpc-gateway's mapping from gRPC codes to HTTP statuses.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).expect("valid"),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The JSON body of an error, as bytes (also used below the router, where
/// hyper's own answers are rewritten).
pub fn error_json(code: Code, reason: Reason, message: &str) -> String {
    serde_json::json!({ "code": code as i32, "message": bounded(message), "reason": reason.as_str() }).to_string()
}

pub fn error_response(http: StatusCode, code: Code, reason: Reason, message: &str) -> Response {
    let mut resp = (http, [(header::CONTENT_TYPE, "application/json")], error_json(code, reason, message)).into_response();
    // Overload and unavailability are worth retrying, and say when.
    if http == StatusCode::SERVICE_UNAVAILABLE || http == StatusCode::TOO_MANY_REQUESTS {
        resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
    }
    resp
}

pub fn invalid(reason: Reason, message: impl AsRef<str>) -> Response {
    error_response(StatusCode::BAD_REQUEST, Code::InvalidArgument, reason, message.as_ref())
}

pub fn status_response(st: &Status) -> Response {
    // Every reason the api gives is in the catalogue; a status without one
    // (tonic's own) gets its code's.
    let reason = st.metadata().get(ERROR_REASON_METADATA).and_then(|v| v.to_str().ok()).and_then(Reason::parse);
    let reason = reason.unwrap_or_else(|| default_reason(st.code()));
    let mut resp = error_response(http_status(st.code()), st.code(), reason, st.message());
    // A limit says when the same request would pass.
    if let Some(secs) = st.metadata().get(relay_contracts::RETRY_AFTER_METADATA).and_then(|v| v.to_str().ok()?.parse::<u64>().ok()) {
        resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

fn default_reason(code: Code) -> Reason {
    match code {
        Code::Unauthenticated => Reason::Unauthenticated,
        Code::NotFound => Reason::NotFound,
        Code::InvalidArgument => Reason::InvalidArgument,
        Code::PermissionDenied => Reason::PermissionDenied,
        Code::Unavailable => Reason::Unavailable,
        Code::ResourceExhausted => Reason::ResourceExhausted,
        _ => Reason::Error,
    }
}

pub fn internal(e: anyhow::Error) -> Response {
    tracing::error!(error = format!("{e:#}"), "REST facade failure");
    error_response(StatusCode::INTERNAL_SERVER_ERROR, Code::Internal, Reason::Internal, "internal error")
}

pub fn overloaded() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        Code::Unavailable,
        Reason::Overloaded,
        &format!("the api is at capacity for request bodies; retry after {RETRY_AFTER_SECS} s"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_map_as_grpc_gateway_maps_them() {
        assert_eq!(http_status(Code::NotFound), StatusCode::NOT_FOUND);
        assert_eq!(http_status(Code::FailedPrecondition), StatusCode::BAD_REQUEST);
        assert_eq!(http_status(Code::Unauthenticated), StatusCode::UNAUTHORIZED);
        assert_eq!(http_status(Code::PermissionDenied), StatusCode::FORBIDDEN);
        assert_eq!(http_status(Code::AlreadyExists), StatusCode::CONFLICT);
        assert_eq!(http_status(Code::Unavailable), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn messages_are_bounded_on_a_character_boundary() {
        let long = "é".repeat(10_000);
        let cut = bounded(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE_CHARS + 1);
        assert!(cut.ends_with('…'));
        assert_eq!(bounded("short"), "short");
    }

    #[test]
    fn overload_says_when_to_retry() {
        let r = overloaded();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
