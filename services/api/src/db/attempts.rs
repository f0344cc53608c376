//! `delivery_attempts`: the attempt log, one row per recorded attempt, keyed
//! by (delivery, generation, attempt) — what makes recording idempotent.

use std::collections::HashMap;

use relay_domain::{DeliveryId, EnvironmentId};
use sqlx::PgConnection;

use relay_signing::Scheme;

use super::models::{Attempt, Decision, Timestamp};
use crate::error::AppResult;

/// Attempt-log rows of one outcome batch, column by column.
#[derive(Default)]
pub struct AttemptRows {
    pub delivery_id: Vec<DeliveryId>,
    pub generation: Vec<i32>,
    pub attempt: Vec<i32>,
    pub environment_id: Vec<EnvironmentId>,
    pub http_status: Vec<Option<i32>>,
    pub error: Vec<Option<String>>,
    pub latency_ms: Vec<i64>,
    pub response_body: Vec<Vec<u8>>,
    pub decision: Vec<&'static str>,
    pub next_attempt_at: Vec<Option<Timestamp>>,
    pub signature_scheme: Vec<Option<&'static str>>,
}

impl AttemptRows {
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        delivery_id: DeliveryId,
        generation: u32,
        attempt: u32,
        environment_id: EnvironmentId,
        http_status: Option<i32>,
        error: Option<String>,
        latency_ms: u64,
        body: Vec<u8>,
        decision: Decision,
        signature_scheme: Option<Scheme>,
    ) {
        self.delivery_id.push(delivery_id);
        self.generation.push(generation as i32);
        self.attempt.push(attempt as i32);
        self.environment_id.push(environment_id);
        self.http_status.push(http_status);
        self.error.push(error);
        self.latency_ms.push(i64::try_from(latency_ms).unwrap_or(i64::MAX));
        self.response_body.push(body);
        self.decision.push(decision.as_str());
        self.next_attempt_at.push(decision.next_attempt_at());
        self.signature_scheme.push(signature_scheme.map(Scheme::as_str));
    }
}

/// One insert for the batch.
pub async fn insert(tx: &mut PgConnection, log: &AttemptRows) -> AppResult<()> {
    if log.delivery_id.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "INSERT INTO delivery_attempts
           (delivery_id, generation, attempt, environment_id, http_status, error, latency_ms, response_body, decision, next_attempt_at,
            signature_scheme)
         SELECT * FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::uuid[], $5::int[], $6::text[], $7::bigint[], $8::bytea[],
                              $9::text[], $10::timestamptz[], $11::text[])",
        &log.delivery_id as _,
        &log.generation,
        &log.attempt,
        &log.environment_id as _,
        &log.http_status as &[Option<i32>],
        &log.error as &[Option<String>],
        &log.latency_ms,
        &log.response_body,
        &log.decision as &[&str],
        &log.next_attempt_at as &[Option<Timestamp>],
        &log.signature_scheme as &[Option<&str>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What the log already holds for these deliveries, by (delivery,
/// generation, attempt): the first answer a repeated report gets again.
pub async fn recorded_decisions(
    tx: &mut PgConnection,
    delivery_ids: &[DeliveryId],
) -> AppResult<HashMap<(DeliveryId, u32, u32), Decision>> {
    let rows = sqlx::query!(
        "SELECT delivery_id, generation, attempt, decision, next_attempt_at FROM delivery_attempts WHERE delivery_id = ANY ($1)",
        delivery_ids as _,
    )
    .fetch_all(&mut *tx)
    .await?;
    rows.into_iter()
        .map(|r| {
            let (id, decision) = (DeliveryId::from(r.delivery_id), r.decision);
            let d = Decision::from_log(&decision, r.next_attempt_at).ok_or_else(|| {
                anyhow::anyhow!("the attempt log of delivery {id} holds a decision this build does not know: {decision:?}")
            })?;
            Ok(((id, r.generation as u32, r.attempt as u32), d))
        })
        .collect()
}

/// The attempt logs of these deliveries, in order.
pub async fn of_deliveries(tx: &mut PgConnection, environment_id: EnvironmentId, delivery_ids: &[DeliveryId]) -> AppResult<Vec<Attempt>> {
    Ok(sqlx::query_as!(
        Attempt,
        "SELECT delivery_id, generation, attempt, attempted_at, http_status, error, latency_ms, response_body, next_attempt_at,
                signature_scheme
         FROM delivery_attempts WHERE delivery_id = ANY ($1) AND environment_id = $2
         ORDER BY generation, attempt",
        delivery_ids as _,
        environment_id as _,
    )
    .fetch_all(&mut *tx)
    .await?)
}
