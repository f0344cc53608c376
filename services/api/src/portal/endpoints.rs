//! The endpoint pages: the list, one endpoint (its charts, held deliveries
//! and the forms that change it), creating one, and the page that shows a
//! new secret its one time.

use askama::Template;
use axum::{
    extract::{Path, RawQuery, State},
    http::{HeaderMap, StatusCode},
    response::Response,
};
use relay_domain::EndpointId;
use relay_signing::{Scheme, SigningSecret};

use super::{
    Frame, Posted, Section,
    auth_view::ReceiverAuthView,
    callers_mistake, chart, failed,
    fields::{header_lines, in_flight_field, rate_fields, split_types},
    html, not_found, outcome_text, path_id, query_param, redirect, session, when,
};
use relay_domain::{
    health::{Circuit, DisabledReason},
    models::HeldDelivery,
};

use crate::app::{
    App,
    bulk_recovery::Recovery,
    endpoints::{Endpoint, EndpointChange, NewEndpoint},
    portal::PortalSession,
};

/// An endpoint as the pages show it.
pub struct EndpointView {
    pub id: String,
    pub url: String,
    pub event_types: Vec<String>,
    pub enabled: bool,
    pub status: &'static str,
    pub status_class: &'static str,
    pub scheme: &'static str,
    pub public_key: Option<String>,
    pub held: i64,
    pub created_at: String,
    pub rotated_at: Option<String>,
    pub last_success_at: Option<String>,
    pub failing_since: Option<String>,
    /// Attempts and failures over the circuit's window, once any failed.
    pub recent: Option<String>,
    /// Custom headers, values masked as every read shows them.
    pub headers: Vec<(String, String)>,
    /// Its in-flight cap; empty: the platform's.
    pub max_in_flight: String,
    /// Its payload filter's JSON; empty: none.
    pub filter: String,
    /// Its rate limit's two numbers; empty: unlimited.
    pub rate_per_second: String,
    pub rate_burst: String,
    /// How Relay authenticates to the receiver beyond the signature.
    pub auth: ReceiverAuthView,
    /// "none" or "per_key".
    pub ordering: &'static str,
}

impl From<Endpoint> for EndpointView {
    fn from(e: Endpoint) -> Self {
        let auth = ReceiverAuthView::of(&e);
        // What the circuit decided, not every failure: a receiver whose
        // retries succeed is active, however many first attempts it refuses.
        let (status, status_class) = match (e.enabled, e.health.circuit) {
            (false, _) => (
                match e.disabled_reason {
                    Some(DisabledReason::Gone) => "disabled by Relay: it answered 410 Gone",
                    Some(DisabledReason::Failing) => "disabled by Relay: failing",
                    _ => "disabled",
                },
                "bad",
            ),
            (true, Circuit::Closed) => ("active", "ok"),
            (true, Circuit::Recovering) => ("recovering: held deliveries going out", "warn"),
            (true, Circuit::Open | Circuit::HalfOpen) => ("down: deliveries held", "bad"),
        };
        let (recent_attempts, recent_failures) = e.recent;
        Self {
            id: e.id.to_string(),
            url: e.url,
            event_types: e.event_types,
            enabled: e.enabled,
            status,
            status_class,
            scheme: e.signature_scheme.as_str(),
            public_key: e.public_key,
            held: e.held,
            created_at: when(e.created_at),
            rotated_at: e.secret_rotated_at.map(when),
            last_success_at: e.health.last_success_at.map(when),
            // Only while Relay holds its deliveries: a run of failures that
            // retries get through is not an endpoint failing.
            failing_since: e.health.failing_since.filter(|_| e.health.circuit.holds()).map(when),
            recent: (recent_attempts > 0).then(|| format!("{recent_failures} of {recent_attempts} failed in the last 2 minutes")),
            headers: e.headers,
            max_in_flight: e.max_in_flight.map(|n| n.to_string()).unwrap_or_default(),
            filter: e.filter.unwrap_or_default(),
            rate_per_second: e.rate_limit.map(|r| r.per_second().to_string()).unwrap_or_default(),
            rate_burst: e.rate_limit.map(|r| r.burst().to_string()).unwrap_or_default(),
            auth,
            ordering: e.ordering.as_str(),
        }
    }
}

#[derive(Template)]
#[template(path = "portal/endpoints.html")]
struct List {
    frame: Frame,
    endpoints: Vec<EndpointView>,
}

pub async fn list(State(app): State<App>, headers: HeaderMap) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    match app.list_endpoints(s.tenant).await {
        Ok(list) => {
            html(StatusCode::OK, List { frame: Frame::new(&s, Section::Endpoints), endpoints: list.into_iter().map(Into::into).collect() })
        }
        Err(e) => failed(e),
    }
}

/// The create and edit form's fields, as typed (shown again with an error).
#[derive(serde::Deserialize)]
pub struct EndpointForm {
    #[serde(default)]
    url: String,
    /// One per line, or separated by commas.
    #[serde(default)]
    event_types: String,
    #[serde(default)]
    signature_scheme: String,
    /// Custom headers, one `Name: value` per line; on an edit, empty keeps
    /// the current ones (their values are never shown to copy back).
    #[serde(default)]
    headers: String,
    /// Present when the edit form's "remove all custom headers" is ticked.
    #[serde(default)]
    clear_headers: Option<String>,
    /// Empty: the platform's cap.
    #[serde(default)]
    max_in_flight: String,
    /// A payload filter's JSON; on an edit the current one is shown, so
    /// empty removes it.
    #[serde(default)]
    filter: String,
    /// The rate limit, requests a second (empty: unlimited) and burst.
    #[serde(default)]
    rate_per_second: String,
    #[serde(default)]
    rate_burst: String,
    /// "none" or "per_key"; empty: none (create) or kept (edit).
    #[serde(default)]
    ordering: String,
}

struct SchemeChoice {
    value: &'static str,
    selected: bool,
}

fn scheme_choices(current: &str) -> Vec<SchemeChoice> {
    let current = if current.is_empty() { Scheme::default().as_str() } else { current };
    Scheme::ALL.iter().map(|s| SchemeChoice { value: s.as_str(), selected: s.as_str() == current }).collect()
}

#[derive(Template)]
#[template(path = "portal/endpoint_new.html")]
struct NewForm {
    frame: Frame,
    error: Option<String>,
    url: String,
    event_types: String,
    schemes: Vec<SchemeChoice>,
    headers: String,
    max_in_flight: String,
    filter: String,
    rate_per_second: String,
    rate_burst: String,
    ordering: String,
    /// The catalogue's type names, offered beside the event types.
    catalogue: Vec<String>,
}

/// The catalogue's type names, for the forms (none if it cannot be read:
/// the form works without them).
async fn catalogue_names(app: &App, s: &PortalSession) -> Vec<String> {
    app.list_event_types(s.tenant).await.map(|types| types.into_iter().map(|t| t.name).collect()).unwrap_or_default()
}

pub async fn new_form(State(app): State<App>, headers: HeaderMap) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    html(
        StatusCode::OK,
        NewForm {
            frame: Frame::new(&s, Section::Endpoints),
            error: None,
            url: String::new(),
            event_types: String::new(),
            schemes: scheme_choices(""),
            headers: String::new(),
            max_in_flight: String::new(),
            filter: String::new(),
            rate_per_second: String::new(),
            rate_burst: String::new(),
            ordering: String::new(),
            catalogue: catalogue_names(&app, &s).await,
        },
    )
}

/// The one page a secret is ever shown on.
#[derive(Template)]
#[template(path = "portal/secret.html")]
struct SecretShown {
    frame: Frame,
    heading: &'static str,
    endpoint: EndpointView,
    secret: Option<String>,
}

fn secret_page(s: &PortalSession, heading: &'static str, endpoint: Endpoint, secret: Option<SigningSecret>) -> Response {
    html(
        StatusCode::OK,
        SecretShown {
            frame: Frame::new(s, Section::Endpoints),
            heading,
            endpoint: endpoint.into(),
            secret: secret.map(|s| s.expose().to_owned()),
        },
    )
}

pub async fn create(State(app): State<App>, posted: Posted<EndpointForm>) -> Response {
    let Posted { session: s, form, .. } = posted;
    let catalogue = catalogue_names(&app, &s).await;
    let refused = |form: EndpointForm, error: String| {
        html(
            StatusCode::BAD_REQUEST,
            NewForm {
                frame: Frame::new(&s, Section::Endpoints),
                error: Some(error),
                schemes: scheme_choices(&form.signature_scheme),
                url: form.url,
                event_types: form.event_types,
                headers: form.headers,
                max_in_flight: form.max_in_flight,
                filter: form.filter,
                rate_per_second: form.rate_per_second,
                rate_burst: form.rate_burst,
                ordering: form.ordering,
                catalogue: catalogue.clone(),
            },
        )
    };
    let fields = header_lines(&form.headers)
        .and_then(|h| Ok((h, in_flight_field(&form.max_in_flight)?, rate_fields(&form.rate_per_second, &form.rate_burst)?)));
    let (headers, max_in_flight, rate_limit) = match fields {
        Ok(all) => all,
        Err(error) => return refused(form, error),
    };
    let new = NewEndpoint {
        url: form.url.trim().to_owned(),
        event_types: split_types(&form.event_types),
        signature_scheme: form.signature_scheme.clone(),
        headers,
        max_in_flight,
        filter: form.filter.clone(),
        rate_limit,
        ordering: form.ordering.clone(),
        // Client certificates and CA bundles are set through the API.
        ..NewEndpoint::default()
    };
    match app.create_endpoint(s.tenant, new).await {
        Ok((endpoint, secret)) => secret_page(&s, "Endpoint created", endpoint, secret),
        Err(e) if callers_mistake(&e) => refused(form, e.message),
        Err(e) => failed(e),
    }
}

/// A held delivery as the endpoint page lists it.
struct HeldView {
    event_id: String,
    attempt: i32,
    due: String,
    last: String,
}

impl From<HeldDelivery> for HeldView {
    fn from(h: HeldDelivery) -> Self {
        Self {
            event_id: h.event_id.to_string(),
            attempt: h.attempt,
            due: when(h.next_attempt_at),
            last: outcome_text(h.last_status, h.last_error.as_deref()),
        }
    }
}

#[derive(Template)]
#[template(path = "portal/endpoint.html")]
struct Show {
    frame: Frame,
    endpoint: EndpointView,
    event_types_text: String,
    schemes: Vec<SchemeChoice>,
    chart: chart::Charts,
    held: Vec<HeldView>,
    error: Option<String>,
    notice: Option<&'static str>,
    catalogue: Vec<String>,
}

pub(super) async fn show_page(
    app: &App,
    s: &PortalSession,
    id: EndpointId,
    error: Option<(StatusCode, String)>,
    notice: Option<&'static str>,
) -> Response {
    let endpoint = match app.get_endpoint(s.tenant, id).await {
        Ok(e) => e,
        Err(e) => return failed(e),
    };
    let (chart, held) = match tokio::try_join!(app.endpoint_chart(&endpoint), app.list_held(s.tenant, id, None, 20)) {
        Ok(both) => both,
        Err(e) => return failed(e),
    };
    let (status, error) = match error {
        Some((status, text)) => (status, Some(text)),
        None => (StatusCode::OK, None),
    };
    html(
        status,
        Show {
            frame: Frame::new(s, Section::Endpoints),
            event_types_text: endpoint.event_types.join("\n"),
            schemes: scheme_choices(endpoint.signature_scheme.as_str()),
            endpoint: endpoint.into(),
            chart: chart::Charts::of(&chart),
            held: held.into_iter().map(Into::into).collect(),
            error,
            notice,
            catalogue: catalogue_names(app, s).await,
        },
    )
}

pub async fn show(State(app): State<App>, headers: HeaderMap, Path(id): Path<String>, RawQuery(query): RawQuery) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let Some(id) = path_id(&id) else { return not_found() };
    // A fixed set of notices: nothing from the query reaches the page.
    let notice = match query_param(query.as_deref(), "done").as_str() {
        "saved" => Some("Saved."),
        "enabled" => Some("Enabled: held deliveries are being sent."),
        "disabled" => Some("Disabled: pending deliveries became dead letters, to replay after enabling."),
        "recovering" => Some("Recovery started: dead and held deliveries of the last 7 days are being sent again."),
        _ => None,
    };
    show_page(&app, &s, id, None, notice).await
}

fn endpoint_url(id: EndpointId, done: &str) -> String {
    format!("/portal/endpoints/{id}?done={done}")
}

pub async fn update(State(app): State<App>, Path(id): Path<String>, posted: Posted<EndpointForm>) -> Response {
    let Posted { session: s, form, .. } = posted;
    let Some(id) = path_id(&id) else { return not_found() };
    let types = split_types(&form.event_types);
    if types.is_empty() {
        return show_page(&app, &s, id, Some((StatusCode::BAD_REQUEST, "an endpoint needs at least one event type".into())), None).await;
    }
    let fields = header_lines(&form.headers)
        .and_then(|h| Ok((h, in_flight_field(&form.max_in_flight)?, rate_fields(&form.rate_per_second, &form.rate_burst)?)));
    let (headers, max_in_flight, rate_limit) = match fields {
        Ok(all) => all,
        Err(error) => return show_page(&app, &s, id, Some((StatusCode::BAD_REQUEST, error)), None).await,
    };
    let change = EndpointChange {
        url: Some(form.url.trim().to_owned()),
        event_types: types,
        signature_scheme: (!form.signature_scheme.is_empty()).then(|| form.signature_scheme.clone()),
        // Empty keeps them: their values are never shown to copy back.
        headers,
        clear_headers: form.clear_headers.is_some(),
        // The form always shows the cap: empty is the platform's.
        max_in_flight: Some(max_in_flight),
        // The form shows the current filter: empty removes it.
        clear_filter: form.filter.trim().is_empty(),
        filter: form.filter.clone(),
        // Shown too: an empty rate removes the limit.
        clear_rate_limit: rate_limit.is_none(),
        rate_limit,
        ordering: (!form.ordering.is_empty()).then(|| form.ordering.clone()),
        // Receiver authentication has its own form (`receiver_auth`).
        ..EndpointChange::default()
    };
    match app.update_endpoint(s.tenant, id, change).await {
        // A change of scheme may mint new material: shown once, like a rotation's.
        Ok((endpoint, Some(secret))) => secret_page(&s, "Endpoint saved: its new signing secret", endpoint, Some(secret)),
        Ok((_, None)) => redirect(&endpoint_url(id, "saved")),
        Err(e) if callers_mistake(&e) => show_page(&app, &s, id, Some((StatusCode::BAD_REQUEST, e.message)), None).await,
        Err(e) => failed(e),
    }
}

pub async fn rotate(State(app): State<App>, Path(id): Path<String>, Posted { session: s, .. }: Posted) -> Response {
    let Some(id) = path_id(&id) else { return not_found() };
    match app.rotate_endpoint_secret(s.tenant, id).await {
        Ok((endpoint, secret)) => secret_page(&s, "Secret rotated: the previous one keeps signing for 24 hours", endpoint, secret),
        Err(e) => failed(e),
    }
}

async fn set_enabled(app: App, s: PortalSession, id: String, enabled: bool) -> Response {
    let Some(id) = path_id(&id) else { return not_found() };
    match app.set_endpoint_enabled(s.tenant, id, enabled).await {
        Ok(_) => redirect(&endpoint_url(id, if enabled { "enabled" } else { "disabled" })),
        Err(e) => failed(e),
    }
}

pub async fn enable(State(app): State<App>, Path(id): Path<String>, posted: Posted) -> Response {
    set_enabled(app, posted.session, id, true).await
}

pub async fn disable(State(app): State<App>, Path(id): Path<String>, posted: Posted) -> Response {
    set_enabled(app, posted.session, id, false).await
}

pub async fn delete(State(app): State<App>, Path(id): Path<String>, Posted { session: s, .. }: Posted) -> Response {
    let Some(id) = path_id(&id) else { return not_found() };
    match app.delete_endpoint(s.tenant, id).await {
        Ok(()) => redirect("/portal/"),
        Err(e) => failed(e),
    }
}

/// Sends the endpoint's dead and held deliveries of the last 7 days again
/// (a recovery operation, throttled).
pub async fn recover(State(app): State<App>, Path(id): Path<String>, Posted { session: s, .. }: Posted) -> Response {
    let Some(id) = path_id(&id) else { return not_found() };
    let until = app.now();
    match app.recover_endpoint(Some(s.tenant), id, until - chrono::TimeDelta::days(7), until, false).await {
        Ok(Recovery::Started(_) | Recovery::WouldRecover(_)) => redirect(&endpoint_url(id, "recovering")),
        Err(e) => failed(e),
    }
}
