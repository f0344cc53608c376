//! Lanes: an ordered endpoint's deliveries of one ordering key
//! (`relay_domain::ordering`). Only a lane's head is ever pending or held;
//! the rest wait `queued`. A queued row is promoted here and nowhere else,
//! one lane at a time under its `ordering_lanes` row's lock, so a lane never
//! has two heads: whoever writes a queued row or ends a head asks for its
//! lane afterwards (an outcome batch only for lanes it could not mark idle,
//! `mark_idle_after_heads`), and the upkeep's sweep finds any lane that a
//! crash between the two left without one. An expansion writes a lane's
//! head itself only where it opens the lane or finds it idle (`idle`, set
//! here when a lane has no head and nothing queued, cleared under the
//! lane's lock by whoever makes a head: see `expansion::expand`).

use relay_domain::{DeliveryId, DispatcherId, EndpointId};
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
/// it pending, or held if its endpoint is down; a lane with no head and
/// nothing queued is marked idle. `notify`: tell every api's
/// relay of the new pending heads (else the caller hands them out).
/// `conn`: a hot path's own connection where it has one (no pool round
/// trips), else one from the pool.
pub async fn promote(conn: &mut PgConnection, lanes: &Lanes, notify: bool) -> AppResult<Promoted> {
    if lanes.is_empty() {
        return Ok(Promoted::default());
    }
    // Sequential scans off for this transaction's statements, set before
    // any is planned (the batchers' connections plan each statement once,
    // `crate::db::batcher`): every lane and every delivery they read is
    // found by key, and the lanes table is small when the plans are made (a
    // new installation, or one analysed while it was empty), so small that
    // the planner read it whole to lock the lanes asked for, and again for
    // each lane (auto_explain under `w6`: 256 scans of it per promotion,
    // 100 ms; the lock 300 buffers a call).
    let mut tx = conn.begin_with("BEGIN; SET LOCAL enable_seqscan = off").await?;
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
             -- Each lane looked at once: whether it has a head (a probe
             -- of the head index, written as a scalar subquery so that it
             -- stays one: as NOT EXISTS it became an anti join reading
             -- every lane's head for each lane asked, the index being near
             -- empty when last analysed) and its first queued row.
             looked AS MATERIALIZED (
               SELECT l.endpoint_id, l.ordering_key,
                      (SELECT 1 FROM webhook_deliveries o
                       WHERE o.ordering_key IS NOT NULL AND o.state IN ('pending', 'held')
                         AND o.endpoint_id = l.endpoint_id AND o.ordering_key = l.ordering_key LIMIT 1) IS NOT NULL AS headed,
                      (SELECT d.id FROM webhook_deliveries d
                       WHERE d.state = 'queued' AND d.endpoint_id = l.endpoint_id AND d.ordering_key = l.ordering_key
                       ORDER BY d.ordering_rank, d.id LIMIT 1) AS next
               FROM lanes l),
             heads AS MATERIALIZED (SELECT next AS id FROM looked WHERE NOT headed AND next IS NOT NULL),
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
               UPDATE ordering_lanes SET last_position = last_position + 1, idle = false WHERE ctid = ANY (ARRAY(SELECT lane FROM promoted))),
             -- Lanes with no head and nothing queued, in the snapshot
             -- taken after their locks: idle, for an expansion to take
             -- (see `expansion::expand`). A row queued after this snapshot
             -- is promoted by its writer, whose promotion waits for this
             -- one; an expansion sees it queued (a key's events commit in
             -- order) and leaves the lane to that promotion. Through the
             -- key's unique index (as the expansion does): every lane asked
             -- for has its row, so nothing is inserted.
             quiet AS (
               INSERT INTO ordering_lanes AS g (endpoint_id, ordering_key)
               SELECT endpoint_id, ordering_key FROM looked WHERE NOT headed AND next IS NULL
               ON CONFLICT (endpoint_id, ordering_key) DO UPDATE SET idle = true WHERE NOT g.idle)
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

/// Lane heads an outcome batch ended (delivered or dead), column by column:
/// each head's lane and its position in it.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct EndedHeads {
    pub endpoint_id: Vec<EndpointId>,
    pub ordering_key: Vec<String>,
    pub position: Vec<i64>,
}

impl EndedHeads {
    /// Each lane once, in key order (the order its lock is taken in).
    pub fn of(mut heads: Vec<(EndpointId, String, i64)>) -> Self {
        heads.sort();
        heads.dedup_by(|later, earlier| (&later.0, &later.1) == (&earlier.0, &earlier.1));
        let mut ended = Self::default();
        for (endpoint_id, ordering_key, position) in heads {
            ended.endpoint_id.push(endpoint_id);
            ended.ordering_key.push(ordering_key);
            ended.position.push(position);
        }
        ended
    }
}

/// After the outcomes that ended these heads have committed: marks idle,
/// in one statement of its own, each of their lanes that has nothing queued
/// and no head numbered since (its last position is still the ended
/// head's), and returns the lanes it marked. Those need no promotion: a row
/// queued in one of them after this statement's snapshot was committed
/// after the head's end, so its writer's own promotion, which starts after
/// that commit, finds the lane headless and promotes it (clearing the mark;
/// and if that promotion got the lane's lock first, the position moved and
/// no mark is made). Every other lane is the caller's to promote, as any
/// lane whose head ended. The lock is the lane row's alone, taken through
/// the key's unique index whatever the statistics say (every lane has its
/// row, so nothing is inserted; a row that were would not be idle). Committed without waiting for the disk: a
/// mark lost in a crash costs the next event of the key a promotion.
pub async fn mark_idle_after_heads(conn: &mut PgConnection, ended: &EndedHeads) -> AppResult<Vec<(EndpointId, String)>> {
    if ended.endpoint_id.is_empty() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query!(
        r#"INSERT INTO ordering_lanes AS g (endpoint_id, ordering_key, last_position)
           SELECT e.endpoint_id, e.ordering_key, e.position
           FROM UNNEST($1::uuid[], $2::text[], $3::bigint[]) AS e(endpoint_id, ordering_key, position)
           CROSS JOIN (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
           ORDER BY e.endpoint_id, e.ordering_key
           ON CONFLICT (endpoint_id, ordering_key) DO UPDATE SET idle = true
             -- The newest version of the lane's row decides (after waiting
             -- for whoever holds it): a head numbered since moved it on.
             WHERE g.last_position = excluded.last_position AND NOT g.idle
               -- The queue probed per lane (a scalar subquery: never
               -- hashed over every lane's queue, see `expansion::expand`).
               AND (SELECT 1 FROM webhook_deliveries q
                    WHERE q.state = 'queued' AND q.endpoint_id = g.endpoint_id AND q.ordering_key = g.ordering_key LIMIT 1) IS NULL
           RETURNING g.endpoint_id AS "endpoint_id!: EndpointId", g.ordering_key AS "ordering_key!", g.idle AS "idle!""#,
        &ended.endpoint_id as _,
        &ended.ordering_key,
        &ended.position,
    )
    .fetch_all(&mut *conn)
    .await?;
    // A row inserted here (a lane that had lost its row, which none
    // should) is not idle: its lane is promoted as any other.
    Ok(rows.into_iter().filter(|r| r.idle).map(|r| (r.endpoint_id, r.ordering_key)).collect())
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

/// The next queued deliveries of each of these lanes, at most `per_lane`
/// each, in lane order (lane by lane), with what sending them needs, as far
/// as `payload_budget` bytes of envelopes go, each claimed for `claimant`
/// for `hold` as a lane head is when handed out: the followers that go
/// with a lane head (`crate::app::lanes`). A follower is on the wire under
/// its claim like any attempt, so a switch-off waits for it (see
/// `switch_off`). Where a row's claim is another's, the lane's followers
/// end before it. Their positions are the caller's to predict. Committed
/// without waiting for the disk (see `crate::relay`): a claim lost in a
/// crash is one the dispatcher also lost.
pub async fn followers(
    conn: &mut PgConnection,
    lanes: &Lanes,
    per_lane: i64,
    payload_budget: i64,
    claimant: DispatcherId,
    hold: std::time::Duration,
) -> AppResult<Vec<super::RefillRow>> {
    let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query_as!(
        super::RefillRow,
        r#"WITH lanes AS (SELECT * FROM UNNEST($1::uuid[], $2::text[]) AS l(endpoint_id, ordering_key)),
             queued AS MATERIALIZED (
               SELECT q.*, v.envelope, sum(octet_length(v.envelope)) OVER (ORDER BY q.endpoint_id, q.ordering_key, q.ordering_rank, q.id) AS upto
               FROM lanes l
               CROSS JOIN LATERAL (
                 SELECT d.id, d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.trace_context, d.ordering_key,
                        d.ordering_rank
                 FROM webhook_deliveries d
                 WHERE d.state = 'queued' AND d.endpoint_id = l.endpoint_id AND d.ordering_key = l.ordering_key
                 ORDER BY d.ordering_rank, d.id LIMIT $3) AS q
               JOIN events v ON v.environment_id = q.environment_id AND v.id = q.event_id),
             wanted AS MATERIALIZED (SELECT * FROM queued WHERE upto <= $4),
             claimed AS (
               INSERT INTO attempt_claims AS c (delivery_id, attempt, generation, claimant, until)
               SELECT id, attempt, generation, $5, now() + $6::bigint * interval '1 millisecond' FROM wanted
               ON CONFLICT (delivery_id) DO UPDATE
                 SET attempt = excluded.attempt, generation = excluded.generation, claimant = excluded.claimant, until = excluded.until
                 WHERE c.claimant = excluded.claimant OR c.until < now()
                    OR (c.generation, c.attempt) <> (excluded.generation, excluded.attempt)
               RETURNING delivery_id),
             -- Each lane's followers up to its first row claimed by another.
             unclaimed AS MATERIALIZED (
               SELECT endpoint_id, ordering_key, min(ordering_rank) AS from_rank FROM wanted
               WHERE id NOT IN (SELECT delivery_id FROM claimed) GROUP BY endpoint_id, ordering_key)
         SELECT q.id AS "id!", q.environment_id AS "environment_id!", q.endpoint_id AS "endpoint_id!", q.event_id AS "event_id!",
                q.attempt AS "attempt!", q.generation AS "generation!", q.trace_context, e.url, e.signature_scheme, e.secret_key_id,
                e.secret_ciphertext,
                e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at, e.headers_key_id, e.headers_ciphertext,
                e.client_tls_key_id, e.client_tls_ciphertext, e.ca_bundle, e.oauth2_key_id, e.oauth2_ciphertext, e.max_in_flight,
                q.ordering_key, NULL::bigint AS ordering_position, q.envelope
         FROM wanted q
         JOIN webhook_endpoints e ON e.id = q.endpoint_id
         CROSS JOIN (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
         WHERE q.ordering_rank < coalesce((SELECT u.from_rank FROM unclaimed u
                                           WHERE u.endpoint_id = q.endpoint_id AND u.ordering_key = q.ordering_key), 9223372036854775807::bigint)
         ORDER BY q.endpoint_id, q.ordering_key, q.ordering_rank, q.id"#,
        &lanes.endpoint_id as _,
        &lanes.ordering_key,
        per_lane,
        payload_budget,
        claimant as _,
        hold_ms,
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// Leases to `claimant` for `hold` those of these lane followers that are
/// pending (promoted by the outcome of their predecessor, which the
/// claimant's run sent them after), extending its claims on them: no relay
/// or refill hands them out while they are on the wire. Also those a relay
/// pass or a refill took in the moment between their promotion and this
/// statement: the claim is what keeps another dispatcher from sending them
/// (the copy a relay published is refused its material while the claim
/// holds), so it is extended whoever leased the row first.
pub async fn lease_next_followers(
    conn: &mut PgConnection,
    ids: &[DeliveryId],
    claimant: DispatcherId,
    hold: std::time::Duration,
) -> AppResult<u64> {
    let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query!(
        // The deliveries locked before their claims, in the order a
        // refill takes them (which locks the rows it reads, then claims
        // them): the other order deadlocks with it.
        "WITH leased AS (
           UPDATE webhook_deliveries d SET dispatched_at = now(), next_attempt_at = now() + $3::bigint * interval '1 millisecond'
           FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
           -- Each delivery by its key: the state compared through a
           -- subquery's value proves no partial index's predicate (see
           -- `promote`), so none is walked for it.
           WHERE d.id = ANY ($1) AND d.state = (SELECT 'pending'::text)
             AND EXISTS (SELECT 1 FROM attempt_claims c WHERE c.delivery_id = d.id AND c.claimant = $2
                           AND (c.generation, c.attempt) = (d.generation, d.attempt))
           RETURNING d.id)
         UPDATE attempt_claims c SET until = now() + $3::bigint * interval '1 millisecond'
         WHERE c.delivery_id = ANY (ARRAY(SELECT id FROM leased)) AND c.claimant = $2",
        ids as _,
        claimant as _,
        hold_ms,
    )
    .execute(&mut *conn)
    .await?
    .rows_affected())
}

/// Lane followers' attempts whose reports waited on their predecessors
/// (answered `predecessor_unrecorded`), column by column.
#[derive(Default, Debug)]
pub struct Deferred {
    pub delivery: Vec<DeliveryId>,
    pub attempt: Vec<i32>,
    pub generation: Vec<i32>,
}

/// Extends `claimant`'s claims on these deferred followers' attempts to
/// `hold` from now (never shortens one). The follower is on the wire or
/// answered already; its report waits only on its predecessor's, and for
/// as long as that takes nobody else may send it: a claim that ran out
/// meanwhile would let another dispatcher send the attempt again once it is
/// promoted (a duplicate no fault explains). So each deferral renews the
/// claim, as a material request by the same claimant would.
pub async fn extend_deferred_claims(
    conn: &mut PgConnection,
    deferred: &Deferred,
    claimant: DispatcherId,
    hold: std::time::Duration,
) -> AppResult<u64> {
    let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query!(
        "UPDATE attempt_claims c SET until = greatest(c.until, now() + $5::bigint * interval '1 millisecond')
         FROM UNNEST($1::uuid[], $2::int[], $3::int[]) AS r(delivery_id, attempt, generation),
              (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
         WHERE c.delivery_id = r.delivery_id AND c.claimant = $4 AND (c.generation, c.attempt) = (r.generation, r.attempt)",
        &deferred.delivery as _,
        &deferred.attempt,
        &deferred.generation,
        claimant as _,
        hold_ms,
    )
    .execute(&mut *conn)
    .await?
    .rows_affected())
}

/// Lane followers whose run stopped before them, each with the attempt
/// whose report said so (the run's last), column by column.
#[derive(Default, Debug)]
pub struct Released {
    pub follower: Vec<DeliveryId>,
    pub reporter: Vec<DeliveryId>,
    pub attempt: Vec<i32>,
    pub generation: Vec<i32>,
}

/// Gives up `claimant`'s claims on these lane followers, still queued, that
/// its run did not send, so that whoever sends them once promoted may claim
/// them. Only while the reporting attempt is still its delivery's current
/// one (not yet recorded): once it is, the followers may have been handed
/// out again with its successor attempt, claimed afresh by the same
/// dispatcher, and a report sent again must not take those claims away.
pub async fn release_followers(conn: &mut PgConnection, released: &Released, claimant: DispatcherId) -> AppResult<u64> {
    Ok(sqlx::query!(
        "DELETE FROM attempt_claims c
         USING UNNEST($1::uuid[], $2::uuid[], $3::int[], $4::int[]) AS r(follower, reporter, attempt, generation)
         WHERE c.delivery_id = r.follower AND c.claimant = $5
           -- By key, the states through a subquery's value (see `promote`).
           AND EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.id = r.follower AND d.state = (SELECT 'queued'::text))
           AND EXISTS (SELECT 1 FROM webhook_deliveries x WHERE x.id = r.reporter
                         AND x.state = ANY (SELECT unnest(ARRAY['pending', 'held', 'queued']::text[]))
                         AND (x.generation, x.attempt) = (r.generation, r.attempt))",
        &released.follower as _,
        &released.reporter as _,
        &released.attempt,
        &released.generation,
        claimant as _,
    )
    .execute(&mut *conn)
    .await?
    .rows_affected())
}

/// Which of these deliveries are queued. The state is tested here, not in
/// the statement: a state named there lets the planner walk the lane queue
/// index (its partial predicate) filtering by id, as `promote` explains;
/// read by id, each is one primary key probe.
pub async fn still_queued(conn: &mut PgConnection, ids: &[DeliveryId]) -> AppResult<Vec<DeliveryId>> {
    let rows = sqlx::query!(
        r#"SELECT d.id AS "id!: DeliveryId", d.state AS "state!: relay_domain::delivery::DeliveryState"
           FROM webhook_deliveries d WHERE d.id = ANY ($1::uuid[])"#,
        ids as _,
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().filter(|r| r.state == relay_domain::delivery::DeliveryState::Queued).map(|r| r.id).collect())
}
