//! Lanes: an ordered endpoint's deliveries of one ordering key
//! (`relay_domain::ordering`). Only a lane's head is ever pending or held;
//! the rest wait `queued`. A queued row is promoted here and nowhere else,
//! one lane at a time under its `ordering_lanes` row's lock, so a lane never
//! has two heads: whoever writes a queued row or ends a head asks for its
//! lane afterwards, and the upkeep's sweep finds any lane that a crash
//! between the two left without one.

use relay_domain::EndpointId;
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::AppResult;

/// Lanes to look at, column by column, each once.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Lanes {
    pub endpoint_id: Vec<EndpointId>,
    pub ordering_key: Vec<String>,
}

impl Lanes {
    /// Each lane once, in key order (the order their locks are taken in, so
    /// two promotions that share lanes cannot deadlock).
    pub fn of(mut pairs: Vec<(EndpointId, String)>) -> Self {
        pairs.sort();
        pairs.dedup();
        let (endpoint_id, ordering_key) = pairs.into_iter().unzip();
        Self { endpoint_id, ordering_key }
    }

    pub fn is_empty(&self) -> bool {
        self.endpoint_id.is_empty()
    }
}

/// What a promotion did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Promoted {
    /// Heads now pending: the relays must be told.
    pub pending: u64,
    /// Heads now held behind their endpoint's recovery.
    pub held: u64,
}

/// Promotes the next queued row of each lane that has no head: locks the
/// lanes' rows (creating them) and their endpoints' health rows (KEY SHARE,
/// as an expansion does: a circuit change waits for this to commit, or this
/// waits for it), then, in a statement of its own so that it sees every row
/// committed before the locks were granted, picks each headless lane's
/// lowest-ranked queued row, numbers it (the lane's next position) and makes
/// it pending, or held if its endpoint is down. `notify`: tell every api's
/// relay of the new pending heads (else the caller hands them out).
/// `conn`: a hot path's own connection where it has one (no pool round
/// trips), else one from the pool.
pub async fn promote(conn: &mut PgConnection, lanes: &Lanes, notify: bool) -> AppResult<Promoted> {
    if lanes.is_empty() {
        return Ok(Promoted::default());
    }
    let mut tx = conn.begin().await?;
    // The locks in one statement: the lanes' rows FOR UPDATE, then the
    // health rows. Every lane asked for has its row: whoever writes a lane's
    // rows creates it first (the expansion that opens the lane), and none is
    // ever deleted. Committed without waiting for the disk (see
    // `crate::relay`, "cheap commits"): a promotion lost in a Postgres crash
    // leaves its lane headless for the sweep, which promotes the same row
    // again with the same position, so a receiver may see that delivery
    // twice, never out of order (the head's successor can only be promoted
    // after the head's outcome, whose commit waits for the disk and so for
    // everything logged before it, this promotion included).
    sqlx::query!(
        r#"WITH wanted AS (SELECT * FROM UNNEST($1::uuid[], $2::text[]) AS w(endpoint_id, ordering_key)),
             lanes AS (
               SELECT 1 FROM ordering_lanes g
               WHERE (g.endpoint_id, g.ordering_key) IN (SELECT * FROM wanted)
               ORDER BY g.endpoint_id, g.ordering_key FOR UPDATE),
             health AS (
               SELECT 1 FROM endpoint_health WHERE endpoint_id = ANY ($1) ORDER BY endpoint_id FOR KEY SHARE)
         SELECT (SELECT count(*) FROM lanes) + (SELECT count(*) FROM health) AS "locked!"
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit"#,
        &lanes.endpoint_id as _,
        &lanes.ordering_key,
    )
    .fetch_one(&mut *tx)
    .await?;
    let row = sqlx::query!(
        r#"WITH lanes AS (SELECT * FROM UNNEST($1::uuid[], $2::text[]) AS l(endpoint_id, ordering_key)),
             heads AS MATERIALIZED (
               SELECT q.id FROM lanes l
               CROSS JOIN LATERAL (
                 SELECT d.id FROM webhook_deliveries d
                 WHERE d.state = 'queued' AND d.endpoint_id = l.endpoint_id AND d.ordering_key = l.ordering_key
                 ORDER BY d.ordering_rank, d.id LIMIT 1) AS q
               -- The lane has no head: a probe of the head index per lane,
               -- written as a scalar subquery so that it stays one (as NOT
               -- EXISTS it became an anti join reading every lane's head
               -- for each lane asked, the index being near empty when
               -- last analysed).
               WHERE (SELECT 1 FROM webhook_deliveries o
                      WHERE o.ordering_key IS NOT NULL AND o.state IN ('pending', 'held')
                        AND o.endpoint_id = l.endpoint_id AND o.ordering_key = l.ordering_key LIMIT 1) IS NULL),
             -- Each head updated through its own key: every lookup is a
             -- primary key probe per row (no set joined to another, see
             -- JOINS_BY_ESTIMATE in `crate::db`); its number is its lane's
             -- last one plus one, read before this statement's writes.
             promoted AS (
               UPDATE webhook_deliveries d
               -- Held behind its endpoint's recovery if the endpoint is down,
               -- read once per row.
               SET (state, held_since) = (SELECT CASE WHEN down THEN 'held' ELSE 'pending' END, CASE WHEN down THEN now() END
                                          FROM (SELECT hh.circuit IN ('open', 'half_open') OR e.disabled_reason IS NOT NULL AS down
                                                FROM webhook_endpoints e JOIN endpoint_health hh ON hh.endpoint_id = e.id
                                                WHERE e.id = d.endpoint_id) AS s),
                   next_attempt_at = now(), dispatched_at = NULL, updated_at = now(),
                   ordering_position = (SELECT g.last_position + 1 FROM ordering_lanes g
                                        WHERE g.endpoint_id = d.endpoint_id AND g.ordering_key = d.ordering_key)
               -- The state compared with `$3` ('queued') through a scalar
               -- subquery: written as a constant (or bound, in the custom
               -- plans a pool connection makes, which inline it) it lets the
               -- planner walk the whole queue index (its partial predicate)
               -- filtering by id, which it thinks cheap while queues are
               -- short at ANALYZE time (auto_explain: 584 rows read for 8
               -- heads); as a subquery's value it proves no index predicate,
               -- so only the primary key serves (one probe per head).
               WHERE d.id = ANY (ARRAY(SELECT id FROM heads)) AND d.state = (SELECT $3::text)
                 -- A switched-off endpoint's lanes ended with it.
                 AND EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = d.endpoint_id AND e.deleted_at IS NULL
                               AND (e.enabled OR e.disabled_reason IN ('gone', 'failing')))
               RETURNING d.state, (SELECT g.ctid FROM ordering_lanes g WHERE g.endpoint_id = d.endpoint_id AND g.ordering_key = d.ordering_key) AS lane),
             numbered AS (
               UPDATE ordering_lanes SET last_position = last_position + 1 WHERE ctid = ANY (ARRAY(SELECT lane FROM promoted)))
         SELECT count(*) FILTER (WHERE state = 'pending') AS "pending!", count(*) FILTER (WHERE state = 'held') AS "held!" FROM promoted"#,
        &lanes.endpoint_id as _,
        &lanes.ordering_key,
        relay_domain::delivery::DeliveryState::Queued.as_str(),
    )
    .fetch_one(&mut *tx)
    .await?;
    if notify && row.pending > 0 {
        super::notify_due(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(Promoted { pending: row.pending as u64, held: row.held as u64 })
}

/// Lanes with queued rows and no head, at most `limit`: what a crash between
/// ending a head (or writing a queued row) and promoting its lane left
/// behind. One index probe per lane with a queue (a skip scan over the
/// queue index), then the head check.
pub async fn headless(db: &PgPool, limit: i64) -> AppResult<Lanes> {
    let rows = sqlx::query!(
        r#"WITH RECURSIVE walk AS (
             (SELECT endpoint_id, ordering_key FROM webhook_deliveries WHERE state = 'queued' ORDER BY endpoint_id, ordering_key LIMIT 1)
             UNION ALL
             SELECT n.endpoint_id, n.ordering_key FROM walk w CROSS JOIN LATERAL (
               SELECT d.endpoint_id, d.ordering_key FROM webhook_deliveries d
               WHERE d.state = 'queued' AND (d.endpoint_id, d.ordering_key) > (w.endpoint_id, w.ordering_key)
               ORDER BY d.endpoint_id, d.ordering_key LIMIT 1) AS n)
         SELECT w.endpoint_id AS "endpoint_id!: EndpointId", w.ordering_key AS "ordering_key!" FROM walk w
         -- A probe per lane, kept one as in `promote`.
         WHERE (SELECT 1 FROM webhook_deliveries o
                WHERE o.ordering_key IS NOT NULL AND o.state IN ('pending', 'held')
                  AND o.endpoint_id = w.endpoint_id AND o.ordering_key = w.ordering_key LIMIT 1) IS NULL
         LIMIT $1"#,
        limit,
    )
    .fetch_all(db)
    .await?;
    Ok(Lanes::of(rows.into_iter().map(|r| (r.endpoint_id, r.ordering_key)).collect()))
}
