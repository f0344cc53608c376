//! How much work is waiting where, read for operators and metrics.

use anyhow::Context;
use sqlx::PgPool;
use uuid::Uuid;

use super::models::QueueDepths;
use crate::error::AppResult;

pub async fn queue_depths(db: &PgPool) -> AppResult<QueueDepths> {
    Ok(sqlx::query_as!(
        QueueDepths,
        r#"SELECT
           (SELECT count(*) FROM events WHERE published_at IS NULL) AS "outbox_unpublished!",
           -- Pending rows are counted as the partial indexes hold them:
           -- waiting (not handed out) and leased.
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NULL)
             + (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL) AS "deliveries_pending!",
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NULL AND next_attempt_at <= now())
             + (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at <= now())
             AS "deliveries_due!",
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > now())
             AS "deliveries_in_flight!",
           (SELECT count(*) FROM webhook_dead_letters) AS "dead_letters!""#,
    )
    .fetch_one(db)
    .await
    .context("reading queue depths")?)
}

/// Attempts handed out and not yet reported, per endpoint (the small
/// partial index of leased rows).
pub async fn in_flight_by_endpoint(db: &PgPool) -> AppResult<Vec<(Uuid, i64)>> {
    Ok(sqlx::query!(
        r#"SELECT endpoint_id, count(*) AS "n!" FROM webhook_deliveries
         WHERE state = 'pending' AND dispatched_at IS NOT NULL GROUP BY endpoint_id"#,
    )
    .fetch_all(db)
    .await
    .context("reading in-flight attempts")?
    .into_iter()
    .map(|r| (r.endpoint_id, r.n))
    .collect())
}
