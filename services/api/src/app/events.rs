//! Publishing events into the outbox, and reading what became of them.

use anyhow::Context;
use serde::Serialize;
use uuid::Uuid;

use super::{App, Tenant, Timestamp, endpoints::check_event_type, require_nonempty};
use crate::error::{AppError, AppResult};

/// The webhook body. Serialised once, at publish time, and stored as bytes:
/// every attempt sends exactly these bytes, so the body a recipient verifies
/// never changes between attempts.
#[derive(Serialize)]
struct Envelope<'a> {
    id: Uuid,
    #[serde(rename = "type")]
    event_type: &'a str,
    environment_id: Uuid,
    occurred_at: String,
    payload: &'a serde_json::Value,
}

/// Payloads are bounded so one request cannot fill the outbox.
pub const MAX_ENVELOPE_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Delivery {
    pub id: Uuid,
    pub event_id: Uuid,
    pub endpoint_id: Uuid,
    pub state: String,
    pub attempt: i32,
    pub next_attempt_at: Timestamp,
    pub created_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub generation: i32,
    #[sqlx(skip)]
    pub attempts: Vec<Attempt>,
}

/// One row of the attempt log.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Attempt {
    pub delivery_id: Uuid,
    pub generation: i32,
    pub attempt: i32,
    pub attempted_at: Timestamp,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub latency_ms: i64,
    pub response_body: Option<Vec<u8>>,
    pub next_attempt_at: Option<Timestamp>,
}

#[derive(Debug, Clone, Copy)]
pub struct Published {
    pub event_id: Uuid,
    pub duplicate: bool,
}

impl App {
    pub async fn publish_event(
        &self,
        tenant: Tenant,
        id: Option<Uuid>,
        event_type: &str,
        payload: &serde_json::Value,
    ) -> AppResult<Published> {
        require_nonempty("type", event_type)?;
        let event_type = event_type.trim();
        check_event_type(event_type)?;
        let event_id = id.unwrap_or_else(Uuid::now_v7);
        let occurred_at = chrono::Utc::now();
        let envelope = serde_json::to_vec(&Envelope {
            id: event_id,
            event_type,
            environment_id: tenant.environment_id,
            occurred_at: occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            payload,
        })
        .context("serialising an envelope")?;
        if envelope.len() > MAX_ENVELOPE_BYTES {
            return Err(AppError::invalid(
                "payload_too_large",
                format!("an event may be at most {MAX_ENVELOPE_BYTES} bytes as delivered; this one is {}", envelope.len()),
            ));
        }

        // The event row is the outbox row: one insert, one transaction. Ids
        // are unique per environment, so a conflict is this tenant's own
        // earlier publish of the same id.
        let inserted = sqlx::query(
            "INSERT INTO events (id, environment_id, event_type, envelope, created_at, trace_context)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (environment_id, id) DO NOTHING",
        )
        .bind(event_id)
        .bind(tenant.environment_id)
        .bind(event_type)
        .bind(&envelope)
        .bind(occurred_at)
        // The relays continue this trace from the row.
        .bind(relay_telemetry::current_traceparent())
        .execute(&self.db)
        .await?;
        let duplicate = inserted.rows_affected() == 0;
        if !duplicate {
            self.outbox_wake.wake();
        }
        Ok(Published { event_id, duplicate })
    }

    pub async fn list_event_deliveries(&self, tenant: Tenant, event_id: Uuid) -> AppResult<Vec<Delivery>> {
        let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM events WHERE id = $1 AND environment_id = $2)")
            .bind(event_id)
            .bind(tenant.environment_id)
            .fetch_one(&self.db)
            .await?;
        if !exists {
            return Err(AppError::not_found("event"));
        }
        let mut deliveries = sqlx::query_as::<_, Delivery>(
            "SELECT id, event_id, endpoint_id, state, attempt, next_attempt_at, created_at, last_status, last_error, generation
             FROM webhook_deliveries WHERE event_id = $1 AND environment_id = $2 ORDER BY created_at, id",
        )
        .bind(event_id)
        .bind(tenant.environment_id)
        .fetch_all(&self.db)
        .await?;
        let ids: Vec<Uuid> = deliveries.iter().map(|d| d.id).collect();
        let attempts = sqlx::query_as::<_, Attempt>(
            "SELECT delivery_id, generation, attempt, attempted_at, http_status, error, latency_ms, response_body, next_attempt_at
             FROM delivery_attempts WHERE delivery_id = ANY ($1) AND environment_id = $2
             ORDER BY generation, attempt",
        )
        .bind(&ids)
        .bind(tenant.environment_id)
        .fetch_all(&self.db)
        .await?;
        for a in attempts {
            if let Some(d) = deliveries.iter_mut().find(|d| d.id == a.delivery_id) {
                d.attempts.push(a);
            }
        }
        Ok(deliveries)
    }
}
