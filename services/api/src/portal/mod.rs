//! The portal: server-rendered pages under `/portal/` on the REST port, for
//! a tenant's own customers. A link minted through the tenant API
//! (`POST /v1/portal-sessions`) is opened once, at `/portal/enter`, and
//! becomes an HttpOnly, SameSite=Strict session cookie scoped to `/portal`
//! and to that link's environment; every page reads only that environment.
//!
//! Every response carries a Content-Security-Policy that allows scripts and
//! styles only from `/portal/assets/` (files embedded in the binary; no
//! inline script or style, no `eval`); every
//! value a tenant or customer wrote is HTML-escaped by the templates; every
//! form that changes something carries the session's CSRF token, and is
//! read only once its session is known ([`form`]); [`page`] makes every
//! response, [`session`] reads the cookie. Bad input is the
//! caller's mistake, named on a 400 page, never a 5xx; answers the
//! framework makes on its own (an unknown page, a method a page does not
//! take, a form it cannot read) are the portal's pages too, with the same
//! headers.

mod auth_view;
mod catalogue;
mod chart;
mod dead_letters;
mod endpoints;
mod events;
mod fields;
mod form;
mod page;
mod receiver_auth;
mod session;

use askama::Template;
use axum::{
    Router,
    extract::{RawQuery, State},
    http::{HeaderValue, StatusCode, header},
    response::Response,
    routing::{any, get, post},
};

pub use self::{
    form::{FORM_READ_TIMEOUT, MAX_FORM_BYTES, Posted},
    page::{
        CONTENT_SECURITY_POLICY, callers_mistake, failed, html, message, not_found, outcome_text, owns, path_id, redirect, refusal,
        unavailable, when,
    },
    session::session,
};
use self::{
    page::{framework_answer, page, query_param},
    session::session_cookie,
};
use crate::app::{App, portal::PortalSession};

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
        .route("/portal/endpoints/{id}/auth", post(receiver_auth::update))
        .route("/portal/endpoints/{id}/rotate", post(endpoints::rotate))
        .route("/portal/endpoints/{id}/enable", post(endpoints::enable))
        .route("/portal/endpoints/{id}/disable", post(endpoints::disable))
        .route("/portal/endpoints/{id}/delete", post(endpoints::delete))
        .route("/portal/endpoints/{id}/recover", post(endpoints::recover))
        .route("/portal/events", get(events::list))
        .route("/portal/events/{id}", get(events::show))
        .route("/portal/dead-letters", get(dead_letters::list))
        .route("/portal/event-types", get(catalogue::list))
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
    Catalogue,
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

#[derive(Template)]
#[template(path = "portal/enter.html")]
struct Entering;

/// Uses a link. The session cookie is set on a page that then moves on to
/// the portal itself: a SameSite=Strict cookie set while following a link
/// from another site is not sent on a redirect of that same navigation,
/// but it is on the page's own next navigation.
async fn enter(State(app): State<App>, RawQuery(query): RawQuery) -> Response {
    let token = query_param(query.as_deref(), "token");
    match app.enter_portal(&token).await {
        Ok(Some(started)) => {
            let max_age = (started.expires_at - app.now()).num_seconds().max(0);
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

async fn logout(State(app): State<App>, posted: Posted) -> Response {
    if let Err(e) = app.leave_portal(&posted.token).await {
        tracing::warn!(error = ?e, "ending a portal session failed");
        return unavailable();
    }
    let mut resp = message(StatusCode::OK, "Signed out", "You can close this page.");
    resp.headers_mut().insert(header::SET_COOKIE, session_cookie(&app, "", 0));
    resp
}
