//! A posted portal form, taken in the REST facade's order so that no work
//! is done for a caller who could never succeed: the session (from its
//! cookie) before a byte of the body is read, so that a request without
//! one is answered at once whatever it declares; then the content type and
//! the declared length (413 from the header alone); then the body, bounded
//! in size and in time by the rule the facade uses ([`crate::body`]); and
//! last the CSRF token, which the form carries in its body.

use std::time::Duration;

use axum::{
    extract::{FromRequest, Request},
    http::{HeaderMap, StatusCode, header},
    response::Response,
};
use serde::de::DeserializeOwned;

use super::{
    page::{forbidden_form, refusal},
    session::{csrf_ok, session},
};
use crate::{
    app::{App, portal::PortalSession},
    body::{BodyError, declared_length, read_bounded},
};

/// The largest form body read. The largest form, an endpoint's receiver
/// authentication, holds at most 112 KiB of PEM (a 32 KiB certificate chain,
/// a 16 KiB key, a 64 KiB CA bundle) and a few short OAuth2 fields;
/// percent-encoded (base64 text grows by about a sixth): under this.
pub const MAX_FORM_BYTES: usize = 192 * 1024;
/// How long a form's body may take to arrive once its head is in. A browser
/// sends a form's bytes with its head; a caller that trickles (at the limit,
/// under 39 KiB/s) or never finishes is answered 408.
pub const FORM_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The field every form carries: the session's CSRF token.
#[derive(serde::Deserialize)]
struct Csrf {
    #[serde(default)]
    csrf: String,
}

/// A form with no fields of its own (a button: rotate, delete, sign out...).
#[derive(serde::Deserialize)]
pub struct Button {}

/// A form posted with a live session and that session's CSRF token, and
/// its own fields.
pub struct Posted<F = Button> {
    pub session: PortalSession,
    /// The session cookie's value (signing out ends it).
    pub token: String,
    pub form: F,
}

impl<F: DeserializeOwned> FromRequest<App> for Posted<F> {
    type Rejection = Response;

    async fn from_request(req: Request, app: &App) -> Result<Self, Response> {
        let (parts, body) = req.into_parts();
        let (token, session) = session(app, &parts.headers).await?;
        if !is_form(&parts.headers) {
            return Err(refusal(StatusCode::UNSUPPORTED_MEDIA_TYPE, "a portal form is sent as application/x-www-form-urlencoded"));
        }
        declared_length(&parts.headers, MAX_FORM_BYTES).map_err(|e| body_refused(&e))?;
        let bytes = read_bounded(body, MAX_FORM_BYTES, FORM_READ_TIMEOUT).await.map_err(|e| body_refused(&e))?;
        let unreadable = |e: serde_urlencoded::de::Error| {
            refusal(StatusCode::BAD_REQUEST, &format!("the form could not be read ({e}); reload the page and try again"))
        };
        let Csrf { csrf } = serde_urlencoded::from_bytes(&bytes).map_err(unreadable)?;
        if !csrf_ok(&session, &csrf) {
            return Err(forbidden_form());
        }
        let form = serde_urlencoded::from_bytes(&bytes).map_err(unreadable)?;
        Ok(Self { session, token, form })
    }
}

/// `application/x-www-form-urlencoded`, with or without parameters.
fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/x-www-form-urlencoded"))
}

/// A body not read, as the portal's page for its status.
fn body_refused(e: &BodyError) -> Response {
    refusal(e.status(), &e.to_string())
}
