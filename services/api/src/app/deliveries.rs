//! The delivery state machine: expand, material, outcome, replay, and the
//! dead-letter store. Every transition is one transaction.

use std::time::Duration;

use anyhow::Context;
use chrono::{SubsecRound, Utc};
use relay_signing::SigningSecret;
use uuid::Uuid;

use super::{App, Tenant, Timestamp};
use crate::error::{AppError, AppResult};

/// The ledger name expansion claims events under.
const EXPAND_CONSUMER: &str = "expand";
/// How long a rotated-out secret keeps signing. A promise recipients code
/// against, not a tuning knob.
pub const ROTATION_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The attempt log keeps this much of a response body.
pub const MAX_RESPONSE_BODY: usize = 4096;
const MAX_ERROR_LEN: usize = 2000;

#[derive(Debug, Clone, Copy)]
pub struct Expanded {
    pub created: u32,
    pub duplicate: bool,
}

/// Everything one attempt needs. The secrets are decrypted for this attempt
/// only; `SigningSecret`'s `Debug` keeps them out of logs.
#[derive(Debug)]
pub struct Material {
    pub delivery_id: Uuid,
    pub endpoint_id: Uuid,
    pub environment_id: Uuid,
    pub event_id: Uuid,
    pub url: String,
    pub attempt: u32,
    pub generation: u32,
    pub secrets: Vec<SigningSecret>,
    pub payload: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct AttemptReport {
    pub delivery_id: Uuid,
    pub generation: u32,
    pub attempt: u32,
    pub http_status: Option<u32>,
    pub error: String,
    pub latency_ms: u64,
    pub response_body: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Delivered,
    Rescheduled { next_attempt_at: Timestamp },
    DeadLettered,
}

impl Decision {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Rescheduled { .. } => "rescheduled",
            Self::DeadLettered => "dead_lettered",
        }
    }
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DeadLetter {
    pub id: Uuid,
    pub delivery_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub reason: String,
    pub dead_lettered_at: Timestamp,
}

#[derive(sqlx::FromRow)]
struct MaterialRow {
    environment_id: Uuid,
    endpoint_id: Uuid,
    event_id: Uuid,
    attempt: i32,
    generation: i32,
    state: String,
    url: String,
    enabled: bool,
    deleted: bool,
    secret_key_id: String,
    secret_ciphertext: Vec<u8>,
    previous_secret_key_id: Option<String>,
    previous_secret_ciphertext: Option<Vec<u8>>,
    secret_rotated_at: Option<Timestamp>,
    envelope: Vec<u8>,
}

#[derive(sqlx::FromRow)]
struct OutcomeRow {
    environment_id: Uuid,
    endpoint_id: Uuid,
    event_id: Uuid,
    attempt: i32,
    generation: i32,
    state: String,
    next_attempt_at: Timestamp,
    /// The decision already recorded for this very attempt, if any.
    recorded_decision: Option<String>,
    recorded_next_attempt_at: Option<Timestamp>,
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// The Postgres channel that says "deliveries are due now". Every api
/// process's delivery relay listens, so a row written by one api wakes the
/// relays of all of them; delivered at commit, so never before the rows exist.
pub const DUE_CHANNEL: &str = "relay_deliveries_due";

async fn notify_due(tx: &mut sqlx::PgConnection) -> AppResult<()> {
    sqlx::query("SELECT pg_notify($1, '')").bind(DUE_CHANNEL).execute(&mut *tx).await?;
    Ok(())
}

impl App {
    /// One delivery per matching endpoint, exactly once: the ledger claim and
    /// the rows commit together, so a redelivered event is a no-op.
    pub async fn expand(&self, event_id: Uuid, environment_id: Uuid, event_type: &str) -> AppResult<Expanded> {
        let mut tx = self.db.begin().await?;
        let stored: Option<(Uuid, String)> =
            sqlx::query_as("SELECT environment_id, event_type FROM events WHERE environment_id = $1 AND id = $2")
                .bind(environment_id)
                .bind(event_id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((stored_env, stored_type)) = stored else { return Err(AppError::not_found("event")) };
        if stored_env != environment_id || stored_type != event_type {
            return Err(AppError::invalid("event_mismatch", format!("event {event_id} does not have that environment and type")));
        }
        let claimed =
            sqlx::query("INSERT INTO consumed_events (consumer, environment_id, event_id) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                .bind(EXPAND_CONSUMER)
                .bind(environment_id)
                .bind(event_id)
                .execute(&mut *tx)
                .await?;
        if claimed.rows_affected() == 0 {
            return Ok(Expanded { created: 0, duplicate: true });
        }
        // Subscription filtering happens here, not at send time: a row that
        // exists is a row that will be sent.
        let created = sqlx::query(
            "INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id)
             SELECT gen_random_uuid(), environment_id, id, $1 FROM webhook_endpoints
             WHERE environment_id = $2 AND enabled AND deleted_at IS NULL AND $3 = ANY (event_types)
             ON CONFLICT (event_id, endpoint_id) DO NOTHING",
        )
        .bind(event_id)
        .bind(environment_id)
        .bind(event_type)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if created > 0 {
            notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing an expansion")?;
        if created > 0 {
            self.deliveries_wake.wake();
        }
        Ok(Expanded { created: created as u32, duplicate: false })
    }

    /// What one attempt needs, if that attempt is still the delivery's current one.
    pub async fn material(&self, delivery_id: Uuid, generation: u32, attempt: u32) -> AppResult<Material> {
        let row = sqlx::query_as::<_, MaterialRow>(
            "SELECT d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.state,
                    e.url, e.enabled, e.deleted_at IS NOT NULL AS deleted,
                    e.secret_key_id, e.secret_ciphertext, e.previous_secret_key_id, e.previous_secret_ciphertext,
                    e.secret_rotated_at, v.envelope
             FROM webhook_deliveries d
             JOIN webhook_endpoints e ON e.id = d.endpoint_id
             JOIN events v ON v.environment_id = d.environment_id AND v.id = d.event_id
             WHERE d.id = $1",
        )
        .bind(delivery_id)
        .fetch_optional(&self.db)
        .await?
        .ok_or_else(|| AppError::not_found("delivery"))?;
        if row.state != "pending" || row.attempt as u32 != attempt || row.generation as u32 != generation {
            return Err(AppError::precondition(
                "stale_attempt",
                format!(
                    "delivery {delivery_id} is {} at attempt {} (generation {}); attempt {attempt} (generation {generation}) is not current",
                    row.state, row.attempt, row.generation
                ),
            ));
        }
        if !row.enabled || row.deleted {
            return Err(AppError::precondition("endpoint_inactive", format!("endpoint {} is disabled or deleted", row.endpoint_id)));
        }
        let mut secrets = vec![self.keyring.decrypt(&row.secret_key_id, &row.secret_ciphertext).context("decrypting a signing secret")?];
        if let (Some(key_id), Some(ct), Some(at)) = (&row.previous_secret_key_id, &row.previous_secret_ciphertext, row.secret_rotated_at) {
            let window = chrono::Duration::from_std(ROTATION_WINDOW).expect("24 h fits");
            if Utc::now() < at + window {
                secrets.push(self.keyring.decrypt(key_id, ct).context("decrypting a previous signing secret")?);
            }
        }
        Ok(Material {
            delivery_id,
            endpoint_id: row.endpoint_id,
            environment_id: row.environment_id,
            event_id: row.event_id,
            url: row.url,
            attempt,
            generation,
            secrets,
            payload: row.envelope,
        })
    }

    /// Records an attempt and decides what comes next, in one transaction.
    /// Idempotent on (delivery, generation, attempt): a repeat returns the
    /// first decision and changes nothing, so the schedule never advances
    /// twice for one attempt.
    pub async fn record_outcome(&self, report: AttemptReport) -> AppResult<Decision> {
        let mut tx = self.db.begin().await?;
        // The delivery, locked, and whatever was already recorded for this
        // attempt: one round trip.
        let row = sqlx::query_as::<_, OutcomeRow>(
            "SELECT d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.state, d.next_attempt_at,
                    a.decision AS recorded_decision, a.next_attempt_at AS recorded_next_attempt_at
             FROM webhook_deliveries d
             LEFT JOIN delivery_attempts a ON a.delivery_id = d.id AND a.generation = $2 AND a.attempt = $3
             WHERE d.id = $1 FOR UPDATE OF d",
        )
        .bind(report.delivery_id)
        .bind(report.generation as i32)
        .bind(report.attempt as i32)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| AppError::not_found("delivery"))?;
        if let Some(decision) = &row.recorded_decision {
            return Ok(match (decision.as_str(), row.recorded_next_attempt_at) {
                ("delivered", _) => Decision::Delivered,
                ("rescheduled", Some(next_attempt_at)) => Decision::Rescheduled { next_attempt_at },
                _ => Decision::DeadLettered,
            });
        }
        if row.state != "pending" || row.attempt as u32 != report.attempt || row.generation as u32 != report.generation {
            // Not the current attempt and never recorded: a report from before
            // a replay, say. Answer with where the delivery stands; change nothing.
            return Ok(match row.state.as_str() {
                "delivered" => Decision::Delivered,
                "dead" => Decision::DeadLettered,
                _ => Decision::Rescheduled { next_attempt_at: row.next_attempt_at },
            });
        }

        let succeeded = matches!(report.http_status, Some(200..=299));
        let error = truncate(report.error.clone(), MAX_ERROR_LEN);
        let decision = if succeeded {
            Decision::Delivered
        } else {
            match self.schedule.delay_before(report.attempt + 1) {
                // Truncated to Postgres's microseconds, so a repeated report
                // answers with exactly the instant the first one did.
                Some(delay) => Decision::Rescheduled {
                    next_attempt_at: (Utc::now() + chrono::Duration::from_std(delay).context("tier fits a chrono duration")?)
                        .trunc_subsecs(6),
                },
                None => Decision::DeadLettered,
            }
        };
        let status = report.http_status.map(|s| s as i32);
        let error_col = (!error.is_empty()).then_some(error.as_str());
        match decision {
            Decision::Delivered => {
                sqlx::query(
                    "UPDATE webhook_deliveries SET state = 'delivered', dispatched_at = NULL, last_status = $2, last_error = NULL, updated_at = now() WHERE id = $1",
                )
                .bind(report.delivery_id)
                .bind(status)
                .execute(&mut *tx)
                .await?;
            }
            Decision::Rescheduled { next_attempt_at } => {
                sqlx::query(
                    "UPDATE webhook_deliveries SET attempt = attempt + 1, next_attempt_at = $2, dispatched_at = NULL,
                       last_status = $3, last_error = $4, updated_at = now() WHERE id = $1",
                )
                .bind(report.delivery_id)
                .bind(next_attempt_at)
                .bind(status)
                .bind(error_col)
                .execute(&mut *tx)
                .await?;
            }
            Decision::DeadLettered => {
                // The dead letter and the state change commit together: a dead
                // delivery always has its record.
                sqlx::query(
                    "INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                )
                .bind(Uuid::now_v7())
                .bind(row.environment_id)
                .bind(report.delivery_id)
                .bind(row.endpoint_id)
                .bind(row.event_id)
                .bind(report.attempt as i32)
                .bind(status)
                .bind(error_col)
                .execute(&mut *tx)
                .await?;
                sqlx::query(
                    "UPDATE webhook_deliveries SET state = 'dead', dispatched_at = NULL, last_status = $2, last_error = $3, updated_at = now() WHERE id = $1",
                )
                .bind(report.delivery_id)
                .bind(status)
                .bind(error_col)
                .execute(&mut *tx)
                .await?;
            }
        }
        let mut body = report.response_body;
        body.truncate(MAX_RESPONSE_BODY);
        sqlx::query(
            "INSERT INTO delivery_attempts (delivery_id, generation, attempt, environment_id, http_status, error, latency_ms, response_body, decision, next_attempt_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(report.delivery_id)
        .bind(report.generation as i32)
        .bind(report.attempt as i32)
        .bind(row.environment_id)
        .bind(status)
        .bind(error_col)
        .bind(i64::try_from(report.latency_ms).unwrap_or(i64::MAX))
        .bind(body)
        .bind(decision.as_str())
        .bind(match decision {
            Decision::Rescheduled { next_attempt_at } => Some(next_attempt_at),
            _ => None,
        })
        .execute(&mut *tx)
        .await?;
        tx.commit().await.context("committing an outcome")?;
        self.metrics.attempts.with_label_values(&[decision.as_str()]).inc();
        self.metrics.attempt_latency.with_label_values(&[decision.as_str()]).observe(report.latency_ms as f64 / 1000.0);
        // Every outcome frees the endpoint's slot (the relay caps what an
        // endpoint has outstanding), and a reschedule may be due sooner than
        // the relay's current sleep: wake it either way.
        self.deliveries_wake.wake();
        Ok(decision)
    }

    /// Puts a dead delivery back at attempt 1, due now, in a new generation.
    /// The dead-letter record stays: it is the evidence the attempts ran out.
    /// `tenant` scopes the lookup; the internal seam passes `None`.
    pub async fn replay_dead_letter(&self, tenant: Option<Tenant>, dead_letter_id: Uuid) -> AppResult<Uuid> {
        let mut tx = self.db.begin().await?;
        let (delivery_id, endpoint_id, active): (Uuid, Uuid, bool) = sqlx::query_as(
            "SELECT l.delivery_id, l.endpoint_id, e.enabled AND e.deleted_at IS NULL
             FROM webhook_dead_letters l JOIN webhook_endpoints e ON e.id = l.endpoint_id
             WHERE l.id = $1 AND ($2::uuid IS NULL OR l.environment_id = $2)",
        )
        .bind(dead_letter_id)
        .bind(tenant.map(|t| t.environment_id))
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| AppError::not_found("dead letter"))?;
        if !active {
            return Err(AppError::precondition(
                "endpoint_inactive",
                format!("endpoint {endpoint_id} is disabled or deleted; enable it before replaying its dead letters"),
            ));
        }
        let reset = sqlx::query(
            "UPDATE webhook_deliveries SET state = 'pending', attempt = 1, generation = generation + 1,
               next_attempt_at = now(), dispatched_at = NULL, updated_at = now()
             WHERE id = $1 AND state = 'dead'",
        )
        .bind(delivery_id)
        .execute(&mut *tx)
        .await?;
        if reset.rows_affected() == 0 {
            return Err(AppError::precondition(
                "already_replayed",
                format!("delivery {delivery_id} is no longer dead: it was already replayed"),
            ));
        }
        notify_due(&mut tx).await?;
        tx.commit().await.context("committing a replay")?;
        self.deliveries_wake.wake();
        Ok(delivery_id)
    }

    /// Deletes dead letters older than `retention`; run by the api on a timer.
    pub async fn prune_dead_letters(&self, retention: Duration) -> AppResult<u64> {
        Ok(sqlx::query("DELETE FROM webhook_dead_letters WHERE dead_lettered_at < now() - $1")
            .bind(retention)
            .execute(&self.db)
            .await?
            .rows_affected())
    }

    pub async fn list_dead_letters(&self, tenant: Tenant) -> AppResult<Vec<DeadLetter>> {
        Ok(sqlx::query_as::<_, DeadLetter>(
            "SELECT id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason, dead_lettered_at
             FROM webhook_dead_letters WHERE environment_id = $1 ORDER BY dead_lettered_at DESC, id DESC LIMIT 1000",
        )
        .bind(tenant.environment_id)
        .fetch_all(&self.db)
        .await?)
    }
}
