//! Dead letters: deliveries whose attempts ran out (or whose endpoint was
//! disabled or deleted while they waited), each with a replay button.

use std::collections::HashMap;

use askama::Template;
use axum::{
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::Response,
};
use relay_domain::{EndpointId, EventId};

use super::{Frame, Posted, Section, failed, html, not_found, outcome_text, path_id, redirect, session, when};
use crate::app::App;

/// How many a page lists (the newest).
const SHOWN: usize = 200;

struct DeadLetterView {
    id: String,
    event_id: String,
    endpoint_id: String,
    endpoint_url: String,
    attempts: i32,
    last: String,
    reason: String,
    at: String,
    /// Replay is offered while its endpoint takes deliveries.
    replayable: bool,
    replayed: bool,
}

#[derive(Template)]
#[template(path = "portal/dead_letters.html")]
struct List {
    frame: Frame,
    dead_letters: Vec<DeadLetterView>,
    total: usize,
}

pub async fn list(State(app): State<App>, headers: HeaderMap) -> Response {
    let (_, s) = match session(&app, &headers).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let (letters, endpoints) = match tokio::try_join!(app.list_dead_letters(s.tenant), app.list_endpoints(s.tenant)) {
        Ok(both) => both,
        Err(e) => return failed(e),
    };
    let live: HashMap<EndpointId, (String, bool)> = endpoints.into_iter().map(|e| (e.id, (e.url, e.enabled))).collect();
    let total = letters.len();
    let dead_letters = letters
        .into_iter()
        .take(SHOWN)
        .map(|d| {
            let (url, enabled) = live.get(&d.endpoint_id).cloned().unwrap_or_else(|| ("(deleted endpoint)".into(), false));
            DeadLetterView {
                id: d.id.to_string(),
                event_id: d.event_id.to_string(),
                endpoint_id: d.endpoint_id.to_string(),
                endpoint_url: url,
                attempts: d.attempts,
                last: outcome_text(d.last_status, d.last_error.as_deref()),
                reason: d.reason.as_str().replace('_', " "),
                at: when(d.dead_lettered_at),
                replayable: enabled && !d.replayed,
                replayed: d.replayed,
            }
        })
        .collect();
    html(StatusCode::OK, List { frame: Frame::new(&s, Section::DeadLetters), dead_letters, total })
}

#[derive(serde::Deserialize)]
pub struct ReplayForm {
    /// Where to go after: the event's page (only an id is accepted).
    #[serde(default)]
    event_id: String,
}

pub async fn replay(State(app): State<App>, Path(id): Path<String>, Posted { session: s, form, .. }: Posted<ReplayForm>) -> Response {
    let Some(id) = path_id(&id) else { return not_found() };
    match app.replay_dead_letter(Some(s.tenant), id).await {
        Ok(_) => match form.event_id.parse::<EventId>() {
            Ok(event) => redirect(&format!("/portal/events/{event}")),
            Err(_) => redirect("/portal/dead-letters"),
        },
        Err(e) => failed(e),
    }
}
