//! The portal: server-rendered pages under `/portal/` on the REST port, for
//! a tenant's own customers. A link minted through the tenant API
//! (`POST /v1/portal-sessions`) is opened once, at `/portal/enter`, and
//! becomes an HttpOnly, SameSite=Strict session cookie scoped to `/portal`
//! and to that link's environment; every page reads only that environment.
//!
//! Every response carries a Content-Security-Policy that allows no script at
//! all and styles only from `/portal/assets/`, embedded in the binary; every
//! value a tenant or customer wrote is HTML-escaped by the templates; every
//! form that changes something carries the session's CSRF token.

use askama::Template;
use axum::{
    Form, Router,
    extract::{RawQuery, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use subtle::ConstantTimeEq;

use crate::app::{App, endpoints::Endpoint, portal::PortalSession};

/// The session cookie's name.
const COOKIE: &str = "relay_portal";

/// No script, no frames, no plugins, forms and styles from here only.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

const STYLESHEET: &str = include_str!("../../templates/portal/portal.css");

pub fn routes(app: App) -> Router {
    Router::new()
        .route("/portal/enter", get(enter))
        .route("/portal/", get(endpoints))
        .route("/portal", get(|| async { redirect("/portal/") }))
        .route("/portal/logout", post(logout))
        .route("/portal/assets/portal.css", get(|| async { page(StatusCode::OK, "text/css; charset=utf-8", STYLESHEET.to_owned()) }))
        .with_state(app)
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

/// An endpoint as the list shows it.
struct EndpointRow {
    id: String,
    url: String,
    event_types: Vec<String>,
    status: &'static str,
    status_class: &'static str,
    scheme: &'static str,
    held: i64,
    created_at: String,
}

impl From<Endpoint> for EndpointRow {
    fn from(e: Endpoint) -> Self {
        let (status, status_class) = match (e.enabled, e.health.circuit.as_str()) {
            (false, _) => ("disabled", "bad"),
            (true, "closed") => ("active", "ok"),
            (true, _) => ("failing: deliveries held", "warn"),
        };
        Self {
            id: e.id.to_string(),
            url: e.url,
            event_types: e.event_types,
            status,
            status_class,
            scheme: e.signature_scheme.as_str(),
            held: e.held,
            created_at: e.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }
    }
}

#[derive(Template)]
#[template(path = "portal/endpoints.html")]
struct Endpoints {
    csrf: String,
    endpoints: Vec<EndpointRow>,
}

/// A response with the portal's headers: the CSP, no framing, no sniffing,
/// no referrer (a link's token never leaves in a Referer), nothing cached.
fn page(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let mut resp = (status, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn html(status: StatusCode, t: impl Template) -> Response {
    match t.render() {
        Ok(body) => page(status, "text/html; charset=utf-8", body),
        Err(e) => {
            tracing::error!(error = %e, "rendering a portal page failed");
            page(StatusCode::INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", "the page could not be rendered".into())
        }
    }
}

fn message(status: StatusCode, title: &str, text: &str) -> Response {
    html(status, Message { title, text })
}

fn redirect(to: &'static str) -> Response {
    let mut resp = page(StatusCode::SEE_OTHER, "text/plain; charset=utf-8", String::new());
    resp.headers_mut().insert(header::LOCATION, HeaderValue::from_static(to));
    resp
}

fn unavailable() -> Response {
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
async fn session(app: &App, headers: &HeaderMap) -> Result<(String, PortalSession), Response> {
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
    let token = query
        .as_deref()
        .and_then(|q| url::form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "token").map(|(_, v)| v.into_owned()))
        .unwrap_or_default();
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

async fn endpoints(State(app): State<App>, headers: HeaderMap) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    match app.list_endpoints(s.tenant).await {
        Ok(list) => html(StatusCode::OK, Endpoints { csrf: s.csrf_token, endpoints: list.into_iter().map(EndpointRow::from).collect() }),
        Err(e) => {
            tracing::warn!(error = ?e, "listing endpoints for the portal failed");
            unavailable()
        }
    }
}

#[derive(serde::Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// A state-changing form must carry the session's CSRF token.
fn csrf_ok(s: &PortalSession, form: &CsrfForm) -> bool {
    !form.csrf.is_empty() && bool::from(form.csrf.as_bytes().ct_eq(s.csrf_token.as_bytes()))
}

fn forbidden_form() -> Response {
    message(StatusCode::FORBIDDEN, "This form has expired", "Reload the page and try again.")
}

async fn logout(State(app): State<App>, headers: HeaderMap, Form(form): Form<CsrfForm>) -> Response {
    let (token, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    if !csrf_ok(&s, &form) {
        return forbidden_form();
    }
    if let Err(e) = app.leave_portal(&token).await {
        tracing::warn!(error = ?e, "ending a portal session failed");
        return unavailable();
    }
    let mut resp = message(StatusCode::OK, "Signed out", "You can close this page.");
    resp.headers_mut().insert(header::SET_COOKIE, session_cookie(&app, "", 0));
    resp
}
