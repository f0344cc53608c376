//! Retention: events past `RELAY_RETENTION_DAYS` whose deliveries have all
//! ended go, with their deliveries, their attempt log and their expansion
//! claim, so storage follows the traffic of the retention window instead
//! of growing for ever. Dead letters have their own, shorter retention
//! (`db::dead_letters::prune`); an event keeps everything while one of its
//! deliveries is pending or held, or still has a dead letter to replay.

use std::time::Duration;

use sqlx::PgPool;

use crate::error::AppResult;

/// What one pass over a stretch of the outbox's order removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    /// The last `seq` looked at (where the next pass goes on from).
    pub last_seq: Option<i64>,
    /// The pass reached events younger than the retention: the walk over
    /// old events is done until the next round.
    pub reached_young: bool,
    pub events: i64,
    pub deliveries: i64,
    pub attempts: i64,
}

/// Looks at the next `batch` events after `after_seq` in the outbox's order
/// (which is the order they were written in, so old events come first, and
/// the walk stops at the first young one) and removes those past
/// `retention` whose deliveries have all ended. One statement: either all
/// of a pass's removals commit or none.
///
/// A delivery revived while this runs (a dead letter's replay, a recovery)
/// is not removed — its row's state is checked again as it is deleted — and
/// then its event stays too: an event goes only when every delivery it had
/// went with it.
pub async fn prune_events(db: &PgPool, retention: Duration, after_seq: i64, batch: i64) -> AppResult<Pruned> {
    let retention = super::interval(retention)?;
    let row = sqlx::query!(
        r#"WITH scanned AS (
             SELECT environment_id, id, seq, created_at < now() - $3::interval AND published_at IS NOT NULL AS old
             FROM events WHERE seq > $1 ORDER BY seq LIMIT $2),
           old AS (SELECT environment_id, id FROM scanned WHERE old),
           deliveries AS (
             SELECT d.id, d.environment_id, d.event_id, d.state FROM webhook_deliveries d
             JOIN old o ON d.event_id = o.id AND d.environment_id = o.environment_id),
           -- Events with a delivery not ended, or a dead letter still kept.
           blocked AS (
             SELECT DISTINCT d.environment_id, d.event_id FROM deliveries d
             WHERE d.state NOT IN ('delivered', 'dead') OR EXISTS (SELECT 1 FROM webhook_dead_letters l WHERE l.delivery_id = d.id)),
           gone_deliveries AS (
             DELETE FROM webhook_deliveries w USING deliveries d
             WHERE w.id = d.id AND w.state IN ('delivered', 'dead')
               AND NOT EXISTS (SELECT 1 FROM blocked b WHERE b.environment_id = d.environment_id AND b.event_id = d.event_id)
             RETURNING w.id, w.environment_id, w.event_id),
           gone_attempts AS (
             DELETE FROM delivery_attempts a USING gone_deliveries g WHERE a.delivery_id = g.id RETURNING 1),
           had AS (SELECT environment_id, event_id, count(*) AS n FROM deliveries GROUP BY environment_id, event_id),
           went AS (SELECT environment_id, event_id, count(*) AS n FROM gone_deliveries GROUP BY environment_id, event_id),
           removable AS (
             SELECT o.environment_id, o.id FROM old o
             LEFT JOIN had h ON h.environment_id = o.environment_id AND h.event_id = o.id
             LEFT JOIN went w ON w.environment_id = o.environment_id AND w.event_id = o.id
             WHERE coalesce(h.n, 0) = coalesce(w.n, 0)),
           gone_claims AS (
             DELETE FROM consumed_events c USING removable r
             WHERE c.consumer = 'expand' AND c.environment_id = r.environment_id AND c.event_id = r.id RETURNING 1),
           gone_events AS (
             DELETE FROM events e USING removable r WHERE e.environment_id = r.environment_id AND e.id = r.id RETURNING 1)
           SELECT (SELECT max(seq) FROM scanned) AS last_seq,
                  (SELECT count(*) FROM scanned) AS "scanned!",
                  EXISTS (SELECT 1 FROM scanned WHERE NOT old) AS "reached_young!",
                  (SELECT count(*) FROM gone_events) AS "events!",
                  (SELECT count(*) FROM gone_deliveries) AS "deliveries!",
                  (SELECT count(*) FROM gone_attempts) AS "attempts!""#,
        after_seq,
        batch,
        retention,
    )
    .fetch_one(db)
    .await?;
    Ok(Pruned {
        last_seq: row.last_seq,
        // Fewer rows than asked for: the end of the outbox, young or not.
        reached_young: row.reached_young || row.scanned < batch,
        events: row.events,
        deliveries: row.deliveries,
        attempts: row.attempts,
    })
}
