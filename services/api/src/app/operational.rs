//! Operational events: Relay tells a tenant what happens to its endpoints —
//! `endpoint.disabled` (with the reason), `endpoint.recovered`,
//! `endpoint.failing` (its circuit opened), `delivery.dead_lettered` (at most
//! one per endpoint per minute, with the count) — as signed events to the
//! operations endpoint the environment names, through the same outbox,
//! stream and delivery path as its own events. An event about the operations
//! endpoint itself is never sent to it, so a failing operations endpoint
//! cannot feed on its own failures.

use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use sqlx::PgConnection;

use relay_domain::{EndpointId, EnvironmentId, EventId, health::DisabledReason};

use super::{App, Tenant, Timestamp};
use crate::{
    db,
    error::{AppError, AppResult},
};

/// Dead letters are gathered this long after the first before they are
/// announced, so a burst is one event.
const GATHER_DEAD_LETTERS: Duration = Duration::from_secs(2);
/// And an endpoint's dead letters are announced at most this often.
const ANNOUNCE_DEAD_LETTERS_EVERY: Duration = Duration::from_secs(60);
/// How often the announcer looks for dead letters other api processes
/// counted, when this one has counted none lately.
pub const ANNOUNCE_BACKSTOP: Duration = Duration::from_secs(10);

/// When this process last counted a dead letter to announce.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterHint(std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl DeadLetterHint {
    pub fn counted(&self) {
        *self.0.lock().expect("not poisoned") = Some(std::time::Instant::now());
    }

    /// Whether a dead letter counted here may still wait to be announced:
    /// within the gathering window and the per-endpoint minute, and a margin.
    pub fn may_wait(&self) -> bool {
        self.0
            .lock()
            .expect("not poisoned")
            .is_some_and(|at| at.elapsed() < GATHER_DEAD_LETTERS + ANNOUNCE_DEAD_LETTERS_EVERY + Duration::from_secs(5))
    }
}

/// What happened to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Happened {
    Disabled(DisabledReason),
    Recovered,
    /// Its circuit opened after this many failures in a row.
    Failing {
        consecutive_failures: i32,
        since: Option<Timestamp>,
    },
    DeadLettered {
        count: i32,
        since: Timestamp,
    },
}

impl Happened {
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::Disabled(_) => "endpoint.disabled",
            Self::Recovered => "endpoint.recovered",
            Self::Failing { .. } => "endpoint.failing",
            Self::DeadLettered { .. } => "delivery.dead_lettered",
        }
    }

    fn payload(&self, endpoint_id: EndpointId) -> serde_json::Value {
        let stamp = |t: Timestamp| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        match *self {
            Self::Disabled(reason) => json!({"endpoint_id": endpoint_id, "reason": reason.as_str()}),
            Self::Recovered => json!({"endpoint_id": endpoint_id}),
            Self::Failing { consecutive_failures, since } => {
                json!({"endpoint_id": endpoint_id, "consecutive_failures": consecutive_failures, "failing_since": since.map(stamp)})
            }
            Self::DeadLettered { count, since } => json!({"endpoint_id": endpoint_id, "count": count, "since": stamp(since)}),
        }
    }
}

impl App {
    /// Writes operational events (environment, endpoint, what happened) in
    /// the caller's transaction, for environments that name an operations
    /// endpoint.
    pub(super) async fn announce(&self, tx: &mut PgConnection, what: &[(EnvironmentId, EndpointId, Happened)]) -> AppResult<()> {
        if what.is_empty() {
            return Ok(());
        }
        let now = self.clock.now();
        let mut rows = db::events::Operational::default();
        for &(environment_id, endpoint_id, happened) in what {
            let id = EventId::mint();
            let payload = serde_json::value::to_raw_value(&happened.payload(endpoint_id)).context("an operational payload")?;
            rows.envelope.push(super::events::envelope(id, happened.event_type(), environment_id, now, &payload)?);
            rows.environment_id.push(environment_id);
            rows.subject.push(endpoint_id);
            rows.id.push(id);
            rows.event_type.push(happened.event_type().to_owned());
        }
        if db::events::insert_operational(&mut *tx, &rows).await? > 0 {
            db::events::notify_outbox(&mut *tx).await?;
        }
        Ok(())
    }

    /// One pass: dead letters counted since their endpoint's last
    /// announcement become one `delivery.dead_lettered` each.
    pub async fn announce_dead_letters(&self) -> AppResult<usize> {
        let mut tx = self.db.begin().await?;
        let notices = db::dead_letters::take_dead_letter_notices(&mut tx, GATHER_DEAD_LETTERS, ANNOUNCE_DEAD_LETTERS_EVERY).await?;
        if notices.is_empty() {
            return Ok(0);
        }
        let what: Vec<(EnvironmentId, EndpointId, Happened)> =
            notices.iter().map(|n| (n.environment_id, n.endpoint_id, Happened::DeadLettered { count: n.count, since: n.since })).collect();
        self.announce(&mut tx, &what).await?;
        tx.commit().await.context("committing dead-letter announcements")?;
        Ok(notices.len())
    }

    /// Names the environment's operations endpoint (`None` clears it); it
    /// must be one of the environment's live endpoints.
    pub async fn set_operations_endpoint(&self, tenant: Tenant, endpoint_id: Option<EndpointId>) -> AppResult<Option<EndpointId>> {
        if let Some(id) = endpoint_id {
            self.get_endpoint(tenant, id).await?;
        }
        db::environments::set_operations_endpoint(&self.db, tenant.environment_id, endpoint_id)
            .await?
            .ok_or_else(|| AppError::not_found("environment"))
    }

    pub async fn operations_endpoint(&self, tenant: Tenant) -> AppResult<Option<EndpointId>> {
        db::environments::operations_endpoint(&self.db, tenant.environment_id).await?.ok_or_else(|| AppError::not_found("environment"))
    }
}
