//! The portal: server-rendered pages under `/portal/` on the REST port, for
//! a tenant's own customers. A link minted through the tenant API
//! (`POST /v1/portal-sessions`) is opened once, at `/portal/enter`, and
//! becomes an HttpOnly, SameSite=Strict session cookie scoped to `/portal`
//! and to that link's environment; every page reads only that environment.
//!
//! Every response carries a Content-Security-Policy that allows no script at
//! all and styles only from `/portal/assets/`, embedded in the binary; every
//! value a tenant or customer wrote is HTML-escaped by the templates; every
//! form that changes something carries the session's CSRF token, and is
//! read only once its session is known ([`form`]). Bad input is the
//! caller's mistake, named on a 400 page, never a 5xx; answers the
//! framework makes on its own (an unknown page, a method a page does not
//! take, a form it cannot read) are the portal's pages too, with the same
//! headers.

mod chart;
mod dead_letters;
mod endpoints;
mod events;
mod form;

use askama::Template;
use axum::{
    Router,
    extract::{RawQuery, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{any, get, post},
};
use subtle::ConstantTimeEq;

pub use self::form::{FORM_READ_TIMEOUT, MAX_FORM_BYTES, Posted};
use crate::{
    app::{App, portal::PortalSession},
    error::{AppError, ErrorCode},
};

/// The session cookie's name.
const COOKIE: &str = "relay_portal";

/// Scripts, styles and images only from the portal's own embedded files (no
/// inline script, no inline style, no `eval`), no frames, no plugins, forms
/// posted here only.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const STYLESHEET: &str = include_str!("../../templates/portal/portal.css");
/// The few lines of progressive enhancement: a copy button beside a secret,
/// a confirmation before deleting. Every page works without it.
const SCRIPT: &str = include_str!("../../templates/portal/portal.js");

pub fn routes(app: App) -> Router {
    Router::new()
        .route("/portal/enter", get(enter))
        .route("/portal/", get(endpoints::list))
        .route("/portal", get(|| async { redirect("/portal/") }))
        .route("/portal/logout", post(logout))
        .route("/portal/endpoints/new", get(endpoints::new_form))
        .route("/portal/endpoints", post(endpoints::create))
        .route("/portal/endpoints/{id}", get(endpoints::show).post(endpoints::update))
        .route("/portal/endpoints/{id}/rotate", post(endpoints::rotate))
        .route("/portal/endpoints/{id}/enable", post(endpoints::enable))
        .route("/portal/endpoints/{id}/disable", post(endpoints::disable))
        .route("/portal/endpoints/{id}/delete", post(endpoints::delete))
        .route("/portal/endpoints/{id}/recover", post(endpoints::recover))
        .route("/portal/events", get(events::list))
        .route("/portal/events/{id}", get(events::show))
        .route("/portal/dead-letters", get(dead_letters::list))
        .route("/portal/dead-letters/{id}/replay", post(dead_letters::replay))
        .route("/portal/assets/portal.css", get(|| async { page(StatusCode::OK, "text/css; charset=utf-8", STYLESHEET.to_owned()) }))
        .route("/portal/assets/portal.js", get(|| async { page(StatusCode::OK, "text/javascript; charset=utf-8", SCRIPT.to_owned()) }))
        // Anything else under the portal is the portal's own 404 page, not
        // the REST facade's JSON one.
        .route("/portal/{*rest}", any(|| async { not_found() }))
        .layer(axum::middleware::map_response(framework_answer))
        // A browser that goes away (a closed tab, a second click) must not
        // cancel a page's database work half-way: each request runs in a
        // task of its own.
        .layer(crate::detach::DetachLayer)
        .with_state(app)
}

/// Which page the navigation marks as current.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Endpoints,
    Events,
    DeadLetters,
}

/// What every page's frame needs: the session's CSRF token (the sign-out
/// form) and the section it is in.
pub struct Frame {
    pub csrf: String,
    pub section: Section,
}

impl Frame {
    pub fn new(s: &PortalSession, section: Section) -> Self {
        Self { csrf: s.csrf_token.clone(), section }
    }

    pub fn current(&self, section: Section) -> &'static str {
        if self.section == section { "page" } else { "false" }
    }
}

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

#[derive(Template)]
#[template(path = "portal/enter.html")]
struct Entering;

/// A response with the portal's headers ([`secure`]).
fn page(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let mut resp = (status, body).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    secure(resp)
}

/// The portal's headers: the CSP, no framing, no sniffing, no referrer (a
/// link's token never leaves in a Referer), nothing cached.
fn secure(mut resp: Response) -> Response {
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
async fn framework_answer(resp: Response) -> Response {
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
fn query_param(query: Option<&str>, name: &str) -> String {
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

fn signed_out() -> Response {
    message(
        StatusCode::UNAUTHORIZED,
        "Your session has ended",
        "Sessions last an hour. Open the portal again from the application that sent you here.",
    )
}

/// The session cookie's value, when the request carries one.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE).and_then(|rest| rest.strip_prefix('=')).map(str::to_owned))
}

fn session_cookie(app: &App, value: &str, max_age: i64) -> HeaderValue {
    let secure = if app.portal.secure_cookie { "; Secure" } else { "" };
    HeaderValue::from_str(&format!("{COOKIE}={value}; Path=/portal; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"))
        .expect("a cookie of token characters")
}

/// The request's session, or the response that says there is none.
pub async fn session(app: &App, headers: &HeaderMap) -> Result<(String, PortalSession), Response> {
    let Some(token) = cookie(headers) else { return Err(signed_out()) };
    match app.portal_session(&token).await {
        Ok(Some(s)) => Ok((token, s)),
        Ok(None) => Err(signed_out()),
        Err(e) => {
            tracing::warn!(error = ?e, "reading a portal session failed");
            Err(unavailable())
        }
    }
}

/// Uses a link. The session cookie is set on a page that then moves on to
/// the portal itself: a SameSite=Strict cookie set while following a link
/// from another site is not sent on a redirect of that same navigation,
/// but it is on the page's own next navigation.
async fn enter(State(app): State<App>, RawQuery(query): RawQuery) -> Response {
    let token = query_param(query.as_deref(), "token");
    match app.enter_portal(&token).await {
        Ok(Some(started)) => {
            let max_age = (started.expires_at - chrono::Utc::now()).num_seconds().max(0);
            let mut resp = html(StatusCode::OK, Entering);
            let h = resp.headers_mut();
            h.insert(header::SET_COOKIE, session_cookie(&app, &started.token, max_age));
            h.insert(header::REFRESH, HeaderValue::from_static("0; url=/portal/"));
            resp
        }
        Ok(None) => message(
            StatusCode::FORBIDDEN,
            "This link does not open the portal",
            "A portal link works once, for ten minutes. Ask the application that sent you here for a new one.",
        ),
        Err(e) => {
            tracing::warn!(error = ?e, "using a portal link failed");
            unavailable()
        }
    }
}

/// A state-changing form must carry the session's CSRF token.
fn csrf_ok(s: &PortalSession, csrf: &str) -> bool {
    !csrf.is_empty() && bool::from(csrf.as_bytes().ct_eq(s.csrf_token.as_bytes()))
}

/// An id from a path; anything but a UUID is a page that does not exist
/// ([`not_found`]).
pub fn path_id(raw: &str) -> Option<uuid::Uuid> {
    raw.parse().ok()
}

/// The same page for "never existed" and "another environment's".
pub fn not_found() -> Response {
    refusal(StatusCode::NOT_FOUND, "There is nothing here, or it belongs to another account.")
}

/// The page a form without its session's CSRF token gets (nothing changed).
fn forbidden_form() -> Response {
    message(StatusCode::FORBIDDEN, "This form has expired", "Reload the page and try again.")
}

async fn logout(State(app): State<App>, posted: Posted) -> Response {
    if let Err(e) = app.leave_portal(&posted.token).await {
        tracing::warn!(error = ?e, "ending a portal session failed");
        return unavailable();
    }
    let mut resp = message(StatusCode::OK, "Signed out", "You can close this page.");
    resp.headers_mut().insert(header::SET_COOKIE, session_cookie(&app, "", 0));
    resp
}
