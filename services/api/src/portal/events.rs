//! The event log (newest first; by type, by time, by id) and an event's
//! page: its payload as sent and each delivery's attempt timeline.

use std::collections::HashMap;

use askama::Template;
use axum::{
    extract::{Path, RawQuery, State},
    http::{HeaderMap, StatusCode},
    response::Response,
};
use chrono::{NaiveDateTime, TimeZone, Utc};
use relay_domain::EventId;
use relay_domain::{
    EndpointId,
    delivery::DeliveryState,
    models::{Attempt, Delivery, EventFilter},
};

use super::{Frame, Section, failed, html, message, not_found, outcome_text, path_id, redirect, session, when};
use crate::app::{App, Timestamp, events::EVENT_PAGE};

/// What a page shows of a response body or a payload.
const SNIPPET: usize = 2048;
const PAYLOAD_SHOWN: usize = 64 * 1024;

struct EventRow {
    id: String,
    event_type: String,
    created_at: String,
    summary: String,
    summary_class: &'static str,
}

#[derive(Template)]
#[template(path = "portal/events.html")]
struct List {
    frame: Frame,
    event_type: String,
    since: String,
    until: String,
    id: String,
    events: Vec<EventRow>,
    older: Option<String>,
    error: Option<String>,
}

/// A time as the filter's field gives it (`datetime-local`, read as UTC) or
/// as RFC 3339.
fn parse_time(name: &str, raw: &str) -> Result<Option<Timestamp>, String> {
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(None);
    }
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(raw) {
        return Ok(Some(t.with_timezone(&Utc)));
    }
    for f in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(raw, f) {
            return Ok(Some(Utc.from_utc_datetime(&t)));
        }
    }
    let shown: String = raw.chars().take(40).collect();
    Err(format!("{name} must be a time like 2026-12-01T14:30 (UTC), got {shown:?}"))
}

/// The next page's cursor: `<seq>~<created_at>`.
fn parse_before(raw: &str) -> Result<Option<(Timestamp, i64)>, String> {
    if raw.is_empty() {
        return Ok(None);
    }
    let bad = || "the page cursor is not one this portal wrote; start from the newest events".to_owned();
    let (seq, at) = raw.split_once('~').ok_or_else(bad)?;
    let seq: i64 = seq.parse().map_err(|_| bad())?;
    let at = chrono::DateTime::parse_from_rfc3339(at).map_err(|_| bad())?.with_timezone(&Utc);
    Ok(Some((at, seq)))
}

fn summary(e: &relay_domain::models::LoggedEvent) -> (String, &'static str) {
    if e.deliveries == 0 {
        return ("no endpoint subscribed".into(), "muted");
    }
    let mut parts = vec![format!("{} of {} delivered", e.delivered, e.deliveries)];
    if e.failing > 0 {
        parts.push(format!("{} retrying", e.failing));
    }
    if e.dead > 0 {
        parts.push(format!("{} failed", e.dead));
    }
    let class = if e.dead > 0 {
        "bad"
    } else if e.failing > 0 {
        "warn"
    } else if e.delivered == e.deliveries {
        "ok"
    } else {
        "muted"
    };
    (parts.join(", "), class)
}

pub async fn list(State(app): State<App>, headers: HeaderMap, RawQuery(query): RawQuery) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let q: HashMap<String, String> = url::form_urlencoded::parse(query.unwrap_or_default().as_bytes()).into_owned().collect();
    let field = |k: &str| q.get(k).map(|v| v.trim().to_owned()).unwrap_or_default();
    let (event_type, since_raw, until_raw, id) = (field("type"), field("since"), field("until"), field("id"));
    let mut page = List {
        frame: Frame::new(&s, Section::Events),
        event_type: event_type.clone(),
        since: since_raw.clone(),
        until: until_raw.clone(),
        id: id.clone(),
        events: Vec::new(),
        older: None,
        error: None,
    };
    // A search by id goes to the event's page.
    if !id.is_empty() {
        return match id.parse::<EventId>() {
            Ok(uuid) => redirect(&format!("/portal/events/{uuid}")),
            Err(_) => {
                let shown: String = id.chars().take(60).collect();
                page.error = Some(format!("an event id is a UUID like 0190f4c2-8d3e-7a41-9b7e-6c1f2a3b4c5d, got {shown:?}"));
                html(StatusCode::BAD_REQUEST, page)
            }
        };
    }
    let filter = (|| -> Result<EventFilter, String> {
        Ok(EventFilter {
            event_type: (!event_type.is_empty()).then(|| event_type.clone()),
            since: parse_time("since", &since_raw)?,
            until: parse_time("until", &until_raw)?,
            before: parse_before(&field("before"))?,
        })
    })();
    let filter = match filter {
        Ok(f) => f,
        Err(e) => {
            page.error = Some(e);
            return html(StatusCode::BAD_REQUEST, page);
        }
    };
    let events = match app.list_events(s.tenant, &filter).await {
        Ok(events) => events,
        Err(e) if e.code == crate::error::ErrorCode::InvalidArgument => {
            page.error = Some(e.message);
            return html(StatusCode::BAD_REQUEST, page);
        }
        Err(e) => return failed(e),
    };
    if events.len() as i64 == EVENT_PAGE {
        let last = events.last().expect("a full page");
        let mut next = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in [("type", &event_type), ("since", &since_raw), ("until", &until_raw)] {
            if !v.is_empty() {
                next.append_pair(k, v);
            }
        }
        next.append_pair("before", &format!("{}~{}", last.seq, last.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)));
        page.older = Some(format!("/portal/events?{}", next.finish()));
    }
    page.events = events
        .iter()
        .map(|e| {
            let (summary, summary_class) = summary(e);
            EventRow { id: e.id.to_string(), event_type: e.event_type.clone(), created_at: when(e.created_at), summary, summary_class }
        })
        .collect();
    html(StatusCode::OK, page)
}

struct AttemptView {
    number: i32,
    generation: i32,
    at: String,
    outcome: String,
    outcome_class: &'static str,
    latency: String,
    next: Option<String>,
    response: String,
    scheme: String,
    /// A failure after which nothing was scheduled (the run ended).
    last_of_run: bool,
}

struct DeliveryView {
    endpoint_id: String,
    endpoint_url: String,
    endpoint_live: bool,
    state: &'static str,
    state_class: &'static str,
    detail: String,
    attempts: Vec<AttemptView>,
}

#[derive(Template)]
#[template(path = "portal/event.html")]
struct Show {
    frame: Frame,
    id: String,
    event_type: String,
    /// Whether its type is in the catalogue (the type links to it).
    in_catalogue: bool,
    created_at: String,
    /// Its ordering key and number in the key's publish order; empty: none.
    ordering: String,
    payload: String,
    payload_cut: bool,
    deliveries: Vec<DeliveryView>,
}

fn snippet(bytes: &[u8], max: usize) -> String {
    let cut = &bytes[..bytes.len().min(max)];
    let mut text = String::from_utf8_lossy(cut).into_owned();
    if bytes.len() > max {
        text.push('…');
    }
    text
}

fn attempt_view(a: &Attempt) -> AttemptView {
    let ok = a.http_status.is_some_and(|s| (200..300).contains(&s));
    let outcome = outcome_text(a.http_status, a.error.as_deref());
    let outcome_class = if ok { "ok" } else { "bad" };
    AttemptView {
        number: a.attempt,
        generation: a.generation,
        at: when(a.attempted_at),
        outcome,
        outcome_class,
        latency: format!("{} ms", a.latency_ms),
        next: if ok { None } else { a.next_attempt_at.map(when) },
        last_of_run: !ok && a.next_attempt_at.is_none(),
        response: a.response_body.as_deref().map(|b| snippet(b, SNIPPET)).unwrap_or_default(),
        scheme: a.signature_scheme.clone().unwrap_or_default(),
    }
}

fn delivery_view(d: &Delivery, urls: &HashMap<EndpointId, String>) -> DeliveryView {
    let (state, state_class) = match d.state {
        DeliveryState::Delivered => ("delivered", "ok"),
        DeliveryState::Dead => ("failed: dead letter", "bad"),
        DeliveryState::Held => ("held: endpoint failing", "warn"),
        DeliveryState::Queued => ("queued behind its key", "muted"),
        DeliveryState::Pending if d.attempts.is_empty() => ("sending", "muted"),
        DeliveryState::Pending => ("retrying", "warn"),
    };
    let detail = match d.state {
        DeliveryState::Pending | DeliveryState::Held => format!("attempt {} due {}", d.attempt, when(d.next_attempt_at)),
        DeliveryState::Queued => {
            format!("sent when the deliveries of {} ahead of it have ended", d.ordering_key.as_deref().unwrap_or("its key"))
        }
        DeliveryState::Dead => format!("after {} attempts: {}", d.attempts.len(), outcome_text(d.last_status, d.last_error.as_deref())),
        DeliveryState::Delivered => String::new(),
    };
    let mut attempts: Vec<AttemptView> = d.attempts.iter().map(attempt_view).collect();
    // Newest first: the timeline reads from what happened last.
    attempts.reverse();
    DeliveryView {
        endpoint_id: d.endpoint_id.to_string(),
        endpoint_url: urls.get(&d.endpoint_id).cloned().unwrap_or_else(|| "(deleted endpoint)".into()),
        endpoint_live: urls.contains_key(&d.endpoint_id),
        state,
        state_class,
        detail,
        attempts,
    }
}

pub async fn show(State(app): State<App>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let Some(id) = path_id(&id) else { return not_found() };
    let event = match app.get_event(s.tenant, id).await {
        Ok(e) => e,
        Err(e) if e.code == crate::error::ErrorCode::NotFound => {
            return message(
                StatusCode::NOT_FOUND,
                "No such event",
                "No event with this id was published in this account, or it has passed retention.",
            );
        }
        Err(e) => return failed(e),
    };
    let (deliveries, endpoints, types) =
        match tokio::try_join!(app.list_event_deliveries(s.tenant, id), app.list_endpoints(s.tenant), app.list_event_types(s.tenant)) {
            Ok(all) => all,
            Err(e) => return failed(e),
        };
    let urls: HashMap<EndpointId, String> = endpoints.into_iter().map(|e| (e.id, e.url)).collect();
    html(
        StatusCode::OK,
        Show {
            frame: Frame::new(&s, Section::Events),
            id: event.id.to_string(),
            in_catalogue: types.iter().any(|t| t.name == event.event_type),
            event_type: event.event_type,
            created_at: when(event.created_at),
            ordering: event
                .ordering_key
                .map(|k| format!("{k} · number {}", event.ordering_sequence.unwrap_or_default()))
                .unwrap_or_default(),
            payload_cut: event.envelope.len() > PAYLOAD_SHOWN,
            payload: snippet(&event.envelope, PAYLOAD_SHOWN),
            deliveries: deliveries.iter().map(|d| delivery_view(d, &urls)).collect(),
        },
    )
}
