//! How much work is waiting where, read for operators and metrics.

use anyhow::Context;
use sqlx::PgPool;
use uuid::Uuid;

use super::models::QueueDepths;
use crate::error::AppResult;

pub async fn queue_depths(db: &PgPool) -> AppResult<QueueDepths> {
    let (outbox, pending, due, in_flight, dead): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT
           (SELECT count(*) FROM events WHERE published_at IS NULL),
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'),
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_at <= now()),
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > now()),
           (SELECT count(*) FROM webhook_dead_letters)",
    )
    .fetch_one(db)
    .await
    .context("reading queue depths")?;
    Ok(QueueDepths {
        outbox_unpublished: outbox,
        deliveries_pending: pending,
        deliveries_due: due,
        deliveries_in_flight: in_flight,
        dead_letters: dead,
    })
}

/// Attempts handed out and not yet reported, per endpoint (the small
/// partial index of leased rows).
pub async fn in_flight_by_endpoint(db: &PgPool) -> AppResult<Vec<(Uuid, i64)>> {
    Ok(sqlx::query_as(
        "SELECT endpoint_id, count(*) FROM webhook_deliveries
         WHERE state = 'pending' AND dispatched_at IS NOT NULL GROUP BY endpoint_id",
    )
    .fetch_all(db)
    .await
    .context("reading in-flight attempts")?)
}
