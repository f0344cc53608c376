//! A portal session: the cookie that carries it, and the CSRF token every
//! form must carry back.

use axum::{
    http::{HeaderMap, HeaderValue, header},
    response::Response,
};
use subtle::ConstantTimeEq;

use super::page::{signed_out, unavailable};
use crate::app::{App, portal::PortalSession};

/// The session cookie's name.
const COOKIE: &str = "relay_portal";

/// The session cookie's value, when the request carries one.
pub(super) fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE).and_then(|rest| rest.strip_prefix('=')).map(str::to_owned))
}

pub(super) fn session_cookie(app: &App, value: &str, max_age: i64) -> HeaderValue {
    let secure = if app.portal_settings().secure_cookie { "; Secure" } else { "" };
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

/// A state-changing form must carry the session's CSRF token.
pub(super) fn csrf_ok(s: &PortalSession, csrf: &str) -> bool {
    !csrf.is_empty() && bool::from(csrf.as_bytes().ct_eq(s.csrf_token.as_bytes()))
}
