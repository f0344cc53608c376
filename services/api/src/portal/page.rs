//! The portal's pages as responses: every one with its headers (the CSP,
//! no framing, no sniffing, no referrer, nothing cached), the refusals and
//! messages, and the little text helpers pages share.

use askama::Template;
use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use crate::error::{AppError, ErrorCode};

/// Scripts, styles and images only from the portal's own embedded files (no
/// inline script, no inline style, no `eval`), no frames, no plugins, forms
/// posted here only.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// A timestamp as pages show it (UTC, to the second).
pub fn when(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// An error the form's own input caused (what [`failed`] answers 400): shown
/// on the form again.
pub fn callers_mistake(e: &AppError) -> bool {
    matches!(e.code, ErrorCode::InvalidArgument | ErrorCode::FailedPrecondition)
}

/// What an attempt ended with, in words.
pub fn outcome_text(status: Option<i32>, error: Option<&str>) -> String {
    match (status, error) {
        (Some(s), Some(e)) if !e.is_empty() => format!("HTTP {s}: {e}"),
        (Some(s), _) => format!("HTTP {s}"),
        (None, Some(e)) => e.to_owned(),
        (None, None) => "not attempted yet".to_owned(),
    }
}

/// What a use-case's error becomes on a page: the status REST would
/// answer, and its message (the reason's words, never an internal cause).
pub fn failed(e: AppError) -> Response {
    let status = match e.code {
        ErrorCode::InvalidArgument | ErrorCode::FailedPrecondition => StatusCode::BAD_REQUEST,
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::AlreadyExists => StatusCode::CONFLICT,
        ErrorCode::ResourceExhausted { .. } => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::Unavailable => return unavailable(),
        ErrorCode::Internal => {
            tracing::error!(error = ?e, "a portal page failed");
            return message(StatusCode::INTERNAL_SERVER_ERROR, "Something went wrong", "The error has been logged. Please try again.");
        }
    };
    if e.code == ErrorCode::NotFound {
        return not_found();
    }
    message(status, "That did not work", &e.message)
}

#[derive(Template)]
#[template(path = "portal/message.html")]
struct Message<'a> {
    title: &'a str,
    text: &'a str,
}

/// A response with the portal's headers ([`secure`]).
pub(super) fn page(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let mut resp = (status, body).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    secure(resp)
}

/// The portal's headers: the CSP, no framing, no sniffing, no referrer (a
/// link's token never leaves in a Referer), nothing cached.
pub(super) fn secure(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// Whether a request path is the portal's: its answers are its pages, even
/// those made before any route is found (see `rest::server`).
pub fn owns(path: &str) -> bool {
    path == "/portal" || path.starts_with("/portal/")
}

/// The page for a request refused before any of its work was done, by
/// status; `why` says what to change.
pub fn refusal(status: StatusCode, why: &str) -> Response {
    let title = match status {
        StatusCode::NOT_FOUND => "Not found",
        StatusCode::METHOD_NOT_ALLOWED => "Not available here",
        StatusCode::REQUEST_TIMEOUT => "That took too long",
        StatusCode::PAYLOAD_TOO_LARGE => "That is more than the portal accepts",
        StatusCode::URI_TOO_LONG => "That address is too long",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "That form could not be read",
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "That request is too large",
        s if s.is_server_error() => "Something went wrong",
        _ => "That did not work",
    };
    message(status, title, why)
}

/// An answer the framework made on its own, with none of the portal's
/// headers (every page of the portal has them): a method a route does not
/// take (405, its `Allow` kept), a path or query its extractor could not
/// read (400). It becomes the portal's page for that status; its own text
/// is not shown, as it may quote the request.
pub(super) async fn framework_answer(resp: Response) -> Response {
    if resp.headers().contains_key(header::CONTENT_SECURITY_POLICY) {
        return resp;
    }
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return secure(resp);
    }
    let why = match status {
        StatusCode::NOT_FOUND => return not_found(),
        StatusCode::METHOD_NOT_ALLOWED => "This address does not take that kind of request.",
        s if s.is_server_error() => "Please try again in a moment.",
        _ => "The request could not be read. Go back to the portal and try again.",
    };
    let allow = resp.headers().get(header::ALLOW).cloned();
    let mut page = refusal(status, why);
    if let Some(allow) = allow {
        page.headers_mut().insert(header::ALLOW, allow);
    }
    page
}

/// A query parameter's value (the first, when given twice); empty when absent.
pub(super) fn query_param(query: Option<&str>, name: &str) -> String {
    query.and_then(|q| url::form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == name).map(|(_, v)| v.into_owned())).unwrap_or_default()
}

pub fn html(status: StatusCode, t: impl Template) -> Response {
    match t.render() {
        Ok(body) => page(status, "text/html; charset=utf-8", body),
        Err(e) => {
            tracing::error!(error = %e, "rendering a portal page failed");
            page(StatusCode::INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", "the page could not be rendered".into())
        }
    }
}

pub fn message(status: StatusCode, title: &str, text: &str) -> Response {
    html(status, Message { title, text })
}

/// After a form: see the page the change shows on (POST, redirect, GET).
pub fn redirect(to: &str) -> Response {
    let mut resp = page(StatusCode::SEE_OTHER, "text/plain; charset=utf-8", String::new());
    match HeaderValue::from_str(to) {
        Ok(v) => {
            resp.headers_mut().insert(header::LOCATION, v);
            resp
        }
        Err(_) => message(StatusCode::BAD_REQUEST, "That did not work", "The page to return to has an invalid address."),
    }
}

pub fn unavailable() -> Response {
    message(StatusCode::SERVICE_UNAVAILABLE, "Temporarily unavailable", "Please try again in a moment.")
}

pub(super) fn signed_out() -> Response {
    message(
        StatusCode::UNAUTHORIZED,
        "Your session has ended",
        "Sessions last an hour. Open the portal again from the application that sent you here.",
    )
}

/// An id from a path; anything but a UUID is a page that does not exist
/// ([`not_found`]).
pub fn path_id<Id: From<uuid::Uuid>>(raw: &str) -> Option<Id> {
    raw.parse::<uuid::Uuid>().ok().map(Id::from)
}

/// The same page for "never existed" and "another environment's".
pub fn not_found() -> Response {
    refusal(StatusCode::NOT_FOUND, "There is nothing here, or it belongs to another account.")
}

/// The page a form without its session's CSRF token gets (nothing changed).
pub(super) fn forbidden_form() -> Response {
    message(StatusCode::FORBIDDEN, "This form has expired", "Reload the page and try again.")
}
