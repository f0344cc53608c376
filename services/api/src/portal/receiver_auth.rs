//! The endpoint page's form that changes how Relay authenticates to the
//! receiver (what the page shows of it: `auth_view`), with the API's rules
//! and refusals: the app checks; this module only reads the form's intent.
//!
//! Keys and client secrets are never shown: their fields start empty, and
//! empty keeps what is stored. What is public (the CA bundle, the OAuth2
//! token URL, client id, scope and audience) is shown in its field, so
//! emptying the bundle removes it.

use axum::{
    extract::{Path, State},
    http::StatusCode,
    response::Response,
};
use relay_domain::models::{OAuth2Credentials, OAuth2Shown};

use super::{Posted, callers_mistake, endpoints::show_page, failed, not_found, path_id, redirect};
use crate::app::{App, endpoints::EndpointChange};

/// The authentication form's fields, as typed.
#[derive(serde::Deserialize)]
pub struct AuthForm {
    /// A new certificate chain and key (both empty: kept).
    #[serde(default)]
    client_certificate: String,
    #[serde(default)]
    client_key: String,
    /// Ticked: the new certificate replaces the current one outright, or
    /// alone, the previous one is no longer presented.
    #[serde(default)]
    end_overlap: Option<String>,
    #[serde(default)]
    clear_client_certificate: Option<String>,
    /// Shown: empty removes the bundle.
    #[serde(default)]
    ca_bundle: String,
    #[serde(default)]
    token_url: String,
    #[serde(default)]
    client_id: String,
    /// Never shown: empty keeps the stored secret when nothing else changed.
    #[serde(default)]
    client_secret: String,
    #[serde(default)]
    scope: String,
    #[serde(default)]
    audience: String,
    #[serde(default)]
    clear_oauth2: Option<String>,
}

/// What the OAuth2 fields ask, given what is stored: new credentials, a
/// removal (`Ok((None, true))`), or nothing (`Ok((None, false))`).
fn oauth2_asked(form: &AuthForm, stored: Option<&OAuth2Shown>) -> Result<(Option<OAuth2Credentials>, bool), String> {
    if form.clear_oauth2.is_some() {
        return Ok((None, true));
    }
    let asked = OAuth2Credentials {
        token_url: form.token_url.trim().to_owned(),
        client_id: form.client_id.trim().to_owned(),
        client_secret: form.client_secret.clone(),
        scope: form.scope.trim().to_owned(),
        audience: form.audience.trim().to_owned(),
    };
    if !asked.client_secret.is_empty() {
        return Ok((Some(asked), false));
    }
    let unchanged = match stored {
        Some(s) => {
            (&s.token_url, &s.client_id, &s.scope, &s.audience) == (&asked.token_url, &asked.client_id, &asked.scope, &asked.audience)
        }
        None => [&asked.token_url, &asked.client_id, &asked.scope, &asked.audience].iter().all(|f| f.is_empty()),
    };
    if unchanged {
        Ok((None, false))
    } else {
        Err("OAuth2 client credentials change as a whole: enter the client secret too (it is never shown)".into())
    }
}

pub async fn update(State(app): State<App>, Path(id): Path<String>, posted: Posted<AuthForm>) -> Response {
    let Posted { session: s, form, .. } = posted;
    let Some(id) = path_id(&id) else { return not_found() };
    let stored = match app.get_endpoint(s.tenant, id).await {
        Ok(e) => e,
        Err(e) if callers_mistake(&e) => return not_found(),
        Err(e) => return failed(e),
    };
    let (oauth2, clear_oauth2) = match oauth2_asked(&form, stored.oauth2.as_ref()) {
        Ok(asked) => asked,
        Err(error) => return show_page(&app, &s, id, Some((StatusCode::BAD_REQUEST, error)), None).await,
    };
    // Browsers send a textarea's lines ended by CRLF; PEM is stored as the
    // API stores it, with LF.
    let lf = |pem: String| pem.replace("\r\n", "\n");
    let change = EndpointChange {
        client_certificate: lf(form.client_certificate),
        client_key: lf(form.client_key),
        clear_client_certificate: form.clear_client_certificate.is_some(),
        end_client_certificate_overlap: form.end_overlap.is_some(),
        clear_ca_bundle: form.ca_bundle.trim().is_empty() && stored.ca_bundle.is_some(),
        ca_bundle: lf(form.ca_bundle),
        oauth2,
        clear_oauth2,
        ..EndpointChange::default()
    };
    match app.update_endpoint(s.tenant, id, change).await {
        Ok(_) => redirect(&format!("/portal/endpoints/{id}?done=saved")),
        Err(e) if callers_mistake(&e) => show_page(&app, &s, id, Some((StatusCode::BAD_REQUEST, e.message)), None).await,
        Err(e) => failed(e),
    }
}
