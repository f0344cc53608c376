//! How much work is waiting where, read for operators and metrics.

use anyhow::Context;
use relay_domain::EndpointId;
use sqlx::PgPool;

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
             + (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at <= now() AND next_attempt_at > '-infinity')
             AS "deliveries_due!",
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > now() AND next_attempt_at > '-infinity')
             AS "deliveries_in_flight!",
           (SELECT count(*) FROM webhook_dead_letters) AS "dead_letters!""#,
    )
    .fetch_one(db)
    .await
    .context("reading queue depths")?)
}

/// Attempts handed out and not yet reported, per endpoint (the small
/// partial index of leased rows).
pub async fn in_flight_by_endpoint(db: &PgPool) -> AppResult<Vec<(EndpointId, i64)>> {
    Ok(sqlx::query!(
        r#"SELECT endpoint_id, count(*) AS "n!" FROM webhook_deliveries
         WHERE state = 'pending' AND dispatched_at IS NOT NULL GROUP BY endpoint_id"#,
    )
    .fetch_all(db)
    .await
    .context("reading in-flight attempts")?
    .into_iter()
    .map(|r| (r.endpoint_id.into(), r.n))
    .collect())
}

/// What an operator's alerts watch besides the queues: deliveries held
/// behind open circuits, how long the oldest unpublished event has waited
/// (a broker that is away shows here first), and endpoints whose circuit is
/// not closed.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    pub deliveries_held: i64,
    pub oldest_unpublished_secs: f64,
    pub circuits_open: i64,
    pub circuits_half_open: i64,
    pub circuits_recovering: i64,
}

pub async fn operational_gauges(db: &PgPool) -> AppResult<Gauges> {
    let r = sqlx::query!(
        r#"SELECT
           (SELECT count(*) FROM webhook_deliveries WHERE state = 'held') AS "held!",
           coalesce((SELECT extract(epoch FROM now() - min(created_at))::float8 FROM events WHERE published_at IS NULL), 0) AS "oldest!",
           (SELECT count(*) FROM endpoint_health WHERE circuit = 'open') AS "open!",
           (SELECT count(*) FROM endpoint_health WHERE circuit = 'half_open') AS "half_open!",
           (SELECT count(*) FROM endpoint_health WHERE circuit = 'recovering') AS "recovering!""#,
    )
    .fetch_one(db)
    .await
    .context("reading operational gauges")?;
    Ok(Gauges {
        deliveries_held: r.held,
        oldest_unpublished_secs: r.oldest,
        circuits_open: r.open,
        circuits_half_open: r.half_open,
        circuits_recovering: r.recovering,
    })
}
