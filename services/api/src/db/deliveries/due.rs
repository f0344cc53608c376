//! Due work for the delivery relay: when the next delivery falls due, the
//! due rows within their endpoints' caps, leasing and claiming them, and
//! giving back what the broker refused.

use std::time::Duration;

use relay_domain::{DeliveryId, EndpointId, EnvironmentId};

use crate::{db::models::Timestamp, error::AppResult};

/// The earliest due time of any pending delivery: the earliest lease to
/// run out, or the earliest waiting row, found endpoint by endpoint through
/// the waiting index (one probe each, as the relay's walk does; no index
/// orders every pending row by time, so that rows waiting and leased are
/// each written into two indexes instead of three). A rate-limited
/// endpoint's rows are due no sooner than its gate opens (`relay_domain::rate`),
/// so the relay sleeps until then instead of finding them due and untakable.
pub async fn earliest_due<'e>(db: impl sqlx::PgExecutor<'e>) -> AppResult<Option<Timestamp>> {
    Ok(sqlx::query_scalar!(
        "WITH RECURSIVE walk AS (
           (SELECT endpoint_id, next_attempt_at FROM webhook_deliveries
            WHERE state = 'pending' AND dispatched_at IS NULL ORDER BY endpoint_id, next_attempt_at LIMIT 1)
           UNION ALL
           SELECT n.endpoint_id, n.next_attempt_at
           FROM walk w CROSS JOIN LATERAL (
             SELECT d.endpoint_id, d.next_attempt_at FROM webhook_deliveries d
             WHERE d.state = 'pending' AND d.dispatched_at IS NULL AND d.endpoint_id > w.endpoint_id
             ORDER BY d.endpoint_id, d.next_attempt_at LIMIT 1) AS n)
         SELECT least(
           (SELECT min(CASE WHEN e.rate_per_second IS NULL THEN w.next_attempt_at
                            ELSE greatest(w.next_attempt_at,
                                          h.rate_tat - (e.rate_burst - 1) * interval '1 second' / e.rate_per_second) END)
            FROM walk w JOIN webhook_endpoints e ON e.id = w.endpoint_id JOIN endpoint_health h ON h.endpoint_id = w.endpoint_id),
           -- The expiry index, asked for by its own clause (see the migration
           -- `lease_expiry_index_by_name`).
           (SELECT min(next_attempt_at) FROM webhook_deliveries
            WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > '-infinity'))"
    )
    .fetch_one(db)
    .await?)
}

/// A row this pass locked and hands to the broker.
pub struct Claimed {
    pub id: DeliveryId,
    pub environment_id: EnvironmentId,
    pub endpoint_id: EndpointId,
    pub attempt: i32,
    pub generation: i32,
    pub trace_context: Option<String>,
    /// The instant of this pass's claim, which later writes compare against.
    pub dispatched_at: Timestamp,
}

/// Due rows, found endpoint by endpoint and taken in turns across them,
/// without locking: a walk over the endpoints with unleased pending rows (one
/// index probe each, which also gives the endpoint's earliest row), and for
/// each one with something due and a free slot its oldest due rows, as many
/// as it has free slots. An endpoint at its cap (a hanging one holds every
/// slot for a timeout each) thus costs a probe and a bounded count per pass,
/// not a read of its whole parked backlog; a pass costs O(endpoints with
/// waiting rows). Rows whose lease ran out come from their own index. An
/// endpoint handed one attempt at a time (its last failure went unanswered,
/// or its retries fail too; see `relay_domain::health`) gets one slot, not `cap`: no
/// use handing a receiver that is timing out more work to time out on.
/// A rate-limited endpoint gets no more rows than its gate lets through now
/// (`claim_and_lease` takes them from the gate under its lock).
/// Returns the rows' ids: each endpoint's rows are already within its free
/// slots, so every one may be claimed.
pub async fn due_candidates<'e>(db: impl sqlx::PgExecutor<'e>, limit: i64, cap: i64) -> AppResult<Vec<DeliveryId>> {
    Ok(sqlx::query_scalar!(
        r#"WITH RECURSIVE walk AS (
           -- Each endpoint with unleased pending rows, with its earliest
           -- one: one probe of the waiting index per endpoint.
           (SELECT endpoint_id, next_attempt_at FROM webhook_deliveries
            WHERE state = 'pending' AND dispatched_at IS NULL ORDER BY endpoint_id, next_attempt_at LIMIT 1)
           UNION ALL
           SELECT n.endpoint_id, n.next_attempt_at
           FROM walk w CROSS JOIN LATERAL (
             SELECT d.endpoint_id, d.next_attempt_at FROM webhook_deliveries d
             WHERE d.state = 'pending' AND d.dispatched_at IS NULL AND d.endpoint_id > w.endpoint_id
             ORDER BY d.endpoint_id, d.next_attempt_at LIMIT 1) AS n),
         capped AS MATERIALIZED (
           SELECT w.endpoint_id, CASE WHEN h.one_at_a_time THEN 1 ELSE LEAST(COALESCE(e.max_in_flight, $2::bigint), $2::bigint) END AS cap,
                  CASE WHEN e.rate_per_second IS NULL THEN $2::bigint ELSE
                    greatest(0, floor(extract(epoch FROM now() - greatest(h.rate_tat, now())) * e.rate_per_second) + e.rate_burst)::bigint
                  END AS tokens
           FROM walk w JOIN endpoint_health h ON h.endpoint_id = w.endpoint_id JOIN webhook_endpoints e ON e.id = w.endpoint_id
           -- Only endpoints with something due: one whose retries are all
           -- later costs its probe and nothing more.
           WHERE w.next_attempt_at <= now()),
         counted AS MATERIALIZED (
           SELECT c.endpoint_id, c.cap, c.tokens,
                  (SELECT count(*) FROM (SELECT 1 FROM webhook_deliveries l
                                         WHERE l.state = 'pending' AND l.dispatched_at IS NOT NULL AND l.endpoint_id = c.endpoint_id
                                         LIMIT c.cap) AS s) AS n
           FROM capped c)
         SELECT id AS "id!"
         FROM (
           SELECT d.id, d.endpoint_id, false AS released, d.next_attempt_at
           -- Its first rows in due order, then those of them that are due
           -- (the same rows as asking for due ones). Written as a range on
           -- the endpoint and no time bound so that only the waiting index
           -- serves the order: with `=` the planner may walk the global due
           -- index, filtering by endpoint, through every parked backlog.
           FROM counted c CROSS JOIN LATERAL (
             SELECT id, endpoint_id, next_attempt_at FROM webhook_deliveries d
             WHERE d.state = 'pending' AND d.dispatched_at IS NULL
               AND d.endpoint_id >= c.endpoint_id AND d.endpoint_id <= c.endpoint_id
             ORDER BY d.endpoint_id, d.next_attempt_at LIMIT LEAST(c.cap - c.n, c.tokens)) AS d
           WHERE c.n < c.cap AND c.tokens > 0 AND d.next_attempt_at <= now()
           UNION ALL
           (SELECT id, endpoint_id, true, next_attempt_at FROM webhook_deliveries
            WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at <= now() AND next_attempt_at > '-infinity'
            ORDER BY next_attempt_at LIMIT $1)) AS due
         -- Turns across endpoints (every endpoint's oldest row, then every
         -- one's second…), not oldest first overall: a batch cut short by
         -- the limit leaves out the tail of a big backlog, not a small
         -- endpoint's one row. Lost leases go first.
         ORDER BY CASE WHEN released THEN 0 ELSE row_number() OVER (PARTITION BY endpoint_id, released ORDER BY next_attempt_at) END,
                  next_attempt_at
         LIMIT $1"#,
        limit,
        cap,
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .map(DeliveryId::from)
    .collect())
}

/// Claims the chosen rows that are still due and unclaimed, and leases them
/// for `lease`, in one statement: no row lock or transaction is held while
/// the broker is asked. Committed without waiting for the disk: a claim lost
/// to a Postgres crash is a re-publish the broker drops.
///
/// A rate-limited endpoint's new attempts are taken from its gate: its
/// health row is locked (in endpoint order, after the delivery rows, which
/// are never waited for), as many rows are leased as the gate lets through
/// now, and the gate moves on by as many intervals. Two apis leasing for
/// one endpoint thus take turns at its gate, and the limit is the
/// endpoint's, not a process's. Rows left out stay due; the relay's next
/// due time is when the gate opens again. A lease that ran out is published
/// again without passing the gate (its attempt already did).
pub async fn claim_and_lease<'e>(db: impl sqlx::PgExecutor<'e>, chosen: &[DeliveryId], lease: Duration) -> AppResult<Vec<Claimed>> {
    let lease = crate::db::interval(lease)?;
    Ok(sqlx::query_as!(
        Claimed,
        r#"WITH picked AS MATERIALIZED (
              SELECT id, endpoint_id, next_attempt_at, dispatched_at IS NOT NULL AS relapsed FROM webhook_deliveries
              WHERE id = ANY ($1) AND state = 'pending' AND next_attempt_at <= now()
              ORDER BY id FOR UPDATE SKIP LOCKED),
            gates AS MATERIALIZED (
              SELECT h.endpoint_id, e.rate_per_second AS rate, greatest(h.rate_tat, now()) AS opened,
                     greatest(0, floor(extract(epoch FROM now() - greatest(h.rate_tat, now())) * e.rate_per_second) + e.rate_burst) AS tokens
              FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id
              WHERE h.endpoint_id IN (SELECT endpoint_id FROM picked WHERE NOT relapsed) AND e.rate_per_second IS NOT NULL
              ORDER BY h.endpoint_id FOR NO KEY UPDATE OF h),
            allowed AS MATERIALIZED (
              SELECT p.id, p.endpoint_id, p.relapsed FROM (
                SELECT p.*, row_number() OVER (PARTITION BY p.endpoint_id, p.relapsed ORDER BY p.next_attempt_at, p.id) AS k FROM picked p) p
              LEFT JOIN gates g ON g.endpoint_id = p.endpoint_id
              WHERE p.relapsed OR g.endpoint_id IS NULL OR p.k <= g.tokens),
            spent AS (
              UPDATE endpoint_health h
              SET rate_tat = g.opened + (SELECT count(*) FROM allowed a WHERE a.endpoint_id = g.endpoint_id AND NOT a.relapsed)
                                        * interval '1 second' / g.rate
              FROM gates g WHERE h.endpoint_id = g.endpoint_id)
         UPDATE webhook_deliveries d SET dispatched_at = now(), next_attempt_at = now() + $2
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
         WHERE d.id IN (SELECT id FROM allowed)
         RETURNING d.id, d.environment_id, d.endpoint_id, d.attempt, d.generation, d.trace_context, d.dispatched_at AS "dispatched_at!""#,
        chosen as _,
        lease,
    )
    .fetch_all(db)
    .await?)
}

/// Releases rows the broker refused, where still under the claim made at
/// `claimed_at` (compare-and-set on the claim's instant).
pub async fn release_refused<'e>(db: impl sqlx::PgExecutor<'e>, ids: &[DeliveryId], claimed_at: &[Timestamp]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries d SET dispatched_at = NULL, next_attempt_at = now()
         FROM UNNEST($1::uuid[], $2::timestamptz[]) AS u(id, at)
         WHERE d.id = ANY ($1::uuid[]) AND d.id = u.id AND d.state = 'pending' AND d.dispatched_at = u.at",
        ids as _,
        claimed_at,
    )
    .execute(db)
    .await?
    .rows_affected())
}
