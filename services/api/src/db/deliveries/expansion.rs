//! An event's expansion into one delivery per subscriber, and giving back
//! first attempts a dispatcher took in hand but could not send.

use relay_domain::{DeliveryId, DispatcherId, EndpointId, EnvironmentId, EventId};
use sqlx::{PgConnection, PgPool};

use crate::{db::models::Timestamp, error::AppResult};

/// Events to expand, column by column, in the order they were asked.
pub struct ToExpand {
    pub environment_id: Vec<EnvironmentId>,
    pub event_id: Vec<EventId>,
    pub event_type: Vec<String>,
    pub trace_context: Vec<Option<String>>,
    /// An operational event's one recipient (`None`: its subscribers).
    pub target: Vec<Option<EndpointId>>,
    /// How long the first attempts of each event written already leased are
    /// leased for, in ms.
    pub lease_ms: Vec<i64>,
    /// Who takes each event's leased first attempts in hand (`None`: the broker).
    pub claimant: Vec<Option<DispatcherId>>,
    /// (item position from 1, endpoint) pairs a payload filter refused:
    /// no delivery is written for them.
    pub refused_ord: Vec<i64>,
    pub refused_endpoint: Vec<EndpointId>,
}

/// One row of an expansion's answer: an item as asked (by position, from 1)
/// and what became of it (its first row, with no delivery), then one row for
/// each delivery it created.
pub struct ExpandedRow {
    pub ord: i64,
    /// The event's stored type; `None` when no such event exists.
    pub stored_type: Option<String>,
    /// This item claimed the event: it was the first mention of the event,
    /// with its type, and the event had not been expanded before.
    pub fresh: bool,
    pub id: Option<DeliveryId>,
    pub endpoint_id: Option<EndpointId>,
    pub trace_context: Option<String>,
    /// Written already leased: this api hands it out itself…
    pub leased: bool,
    /// …into the asking dispatcher's hands, claimed for it (else to the broker).
    pub in_hand: bool,
    /// Written held: its endpoint is down.
    pub held: bool,
    /// Written queued in its lane (an ordered endpoint's deliveries of the
    /// event's ordering key): the lane must be asked to promote
    /// (`lanes::promote`).
    pub queued: bool,
    /// Written as its lane's head (a lane it opened, or an idle one it
    /// took), sent as any first attempt is.
    pub lane_head: bool,
    /// A lane head's position in its lane: 1 where the lane was opened
    /// here, one after the lane's last where it was taken idle.
    pub lane_position: Option<i64>,
    /// The event's ordering key, on a row in a lane.
    pub ordering_key: Option<String>,
    /// Not expanded now: an earlier event of its ordering key has not been
    /// expanded yet (on the item's own row).
    pub deferred: bool,
    /// Written waiting for its endpoint's rate gate, which only a relay
    /// pass opens: the relays must be told.
    pub gated: bool,
    /// For an attempt in hand, what sending it needs from its endpoint…
    pub url: Option<String>,
    pub signature_scheme: Option<String>,
    pub secret_key_id: Option<String>,
    pub secret_ciphertext: Option<Vec<u8>>,
    pub previous_secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
    pub secret_rotated_at: Option<Timestamp>,
    pub headers_key_id: Option<String>,
    pub headers_ciphertext: Option<Vec<u8>>,
    pub client_tls_key_id: Option<String>,
    pub client_tls_ciphertext: Option<Vec<u8>>,
    pub ca_bundle: Option<String>,
    pub oauth2_key_id: Option<String>,
    pub oauth2_ciphertext: Option<Vec<u8>>,
    /// The endpoint's own in-flight cap, if it set one.
    pub max_in_flight: Option<i32>,
    /// …and its body, on the first such row of each event.
    pub envelope: Option<Vec<u8>>,
}

/// Expands events in one statement, so that it commits by itself: checks
/// them, claims each in the `consumed_events` ledger once (its first mention
/// with its stored type, in key order, so two expansions that share events
/// cannot deadlock; an event claimed before is not expanded again), writes
/// one delivery per subscribed, active endpoint of each claimed event whose
/// payload filter did not refuse it (first attempt due now), and claims the
/// attempts handed back.
///
/// Rows within their endpoint's in-flight `cap` (one for an endpoint handed
/// one attempt at a time, see `relay_domain::health`) are written already leased for their event's
/// `lease_ms`; those of an event with a claimant are also claimed for it, in
/// the order asked, as far as `payload_budget` bytes of envelopes go, and
/// come back with their material. The rest wait, due, for the relay.
pub async fn expand(conn: &mut PgConnection, events: &ToExpand, cap: i64, payload_budget: i64) -> AppResult<Vec<ExpandedRow>> {
    Ok(sqlx::query_as!(
        ExpandedRow,
        r#"WITH asked AS (
                   SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::uuid[], $6::bigint[], $7::uuid[])
                     WITH ORDINALITY AS a(environment_id, event_id, event_type, trace_context, target, lease_ms, claimant, ord)),
                 -- Each item whose event exists, with the event's stored type
                 -- and the size of its body.
                 found AS (
                   SELECT a.*, v.event_type AS stored_type, octet_length(v.envelope) AS size, v.ordering_key AS okey,
                          v.ordering_sequence AS oseq
                   FROM asked a
                   JOIN events v ON v.environment_id = a.environment_id AND v.id = a.event_id
                   -- The keys as an index condition too (INDEXED_LOOKUPS).
                   WHERE v.environment_id = ANY ($1::uuid[]) AND v.id = ANY ($2::uuid[])),
                 -- Each event's first mention that names its stored type.
                 first AS (
                   SELECT DISTINCT ON (environment_id, event_id) * FROM found WHERE stored_type = event_type
                   ORDER BY environment_id, event_id, ord),
                 -- A key's events are expanded in their publish order, so a
                 -- lane's rows are written in it: an event waits (deferred,
                 -- unclaimed) while the event numbered before it is neither
                 -- expanded (or gone with retention) nor before it in this
                 -- batch's unbroken run of the key.
                 keyed_low AS (
                   SELECT environment_id, okey, min(oseq) AS low FROM first WHERE okey IS NOT NULL GROUP BY environment_id, okey),
                 blocked_keys AS (
                   SELECT k.* FROM keyed_low k
                   WHERE k.low > 1 AND EXISTS (
                     SELECT 1 FROM events p WHERE p.environment_id = k.environment_id AND p.ordering_key = k.okey
                       AND p.ordering_sequence = k.low - 1
                       AND NOT EXISTS (SELECT 1 FROM consumed_events c
                                       WHERE c.consumer = 'expand' AND c.environment_id = p.environment_id AND c.event_id = p.id))),
                 deferred AS (
                   SELECT f.ord, f.environment_id, f.event_id FROM first f JOIN keyed_low k ON k.environment_id = f.environment_id AND k.okey = f.okey
                   WHERE NOT EXISTS (SELECT 1 FROM consumed_events c
                                     WHERE c.consumer = 'expand' AND c.environment_id = f.environment_id AND c.event_id = f.event_id)
                     AND (EXISTS (SELECT 1 FROM blocked_keys b WHERE b.environment_id = f.environment_id AND b.okey = f.okey)
                          OR (SELECT count(*) FROM first g WHERE g.environment_id = f.environment_id AND g.okey = f.okey
                                AND g.oseq <= f.oseq) < f.oseq - k.low + 1)),
                 consumed AS (
                   INSERT INTO consumed_events (consumer, environment_id, event_id)
                   SELECT 'expand', environment_id, event_id FROM first
                   WHERE NOT EXISTS (SELECT 1 FROM deferred x WHERE x.environment_id = first.environment_id AND x.event_id = first.event_id)
                   ORDER BY environment_id, event_id
                   ON CONFLICT DO NOTHING RETURNING environment_id, event_id),
                 fresh AS (
                   SELECT f.* FROM first f JOIN consumed c ON c.environment_id = f.environment_id AND c.event_id = f.event_id),
                 -- The subscribers, share-locked: a disable or delete of one
                 -- of them waits for this expansion to commit (and then ends
                 -- the rows it wrote), or this expansion waits for it and
                 -- re-reads the endpoint as disabled. Either way no pending
                 -- delivery of an inactive endpoint is ever committed.
                 live AS (
                   SELECT e.id, e.environment_id, e.event_types, e.url, e.signature_scheme, e.secret_key_id, e.secret_ciphertext,
                          e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at, e.headers_key_id, e.headers_ciphertext,
                          e.client_tls_key_id, e.client_tls_ciphertext, e.ca_bundle, e.oauth2_key_id, e.oauth2_ciphertext, e.max_in_flight,
                          e.ordering = 'per_key' AS ordered,
                          h.circuit IN ('open', 'half_open') OR e.disabled_reason IS NOT NULL AS holding,
                          e.rate_per_second IS NOT NULL AS gated,
                          CASE WHEN h.one_at_a_time THEN 1 ELSE LEAST(COALESCE(e.max_in_flight, $8::bigint), $8::bigint) END AS cap
                   FROM webhook_endpoints e JOIN endpoint_health h ON h.endpoint_id = e.id
                   -- Found through the event types' index (and the targets
                   -- by id) before they are locked in id order: asked for
                   -- in one set, the planner walked the primary key in lock
                   -- order through every endpoint of the environment,
                   -- 10,000 rows a batch beside a large one (W3-10M).
                   WHERE e.id = ANY (ARRAY(SELECT s.id FROM webhook_endpoints s
                                           WHERE s.environment_id = ANY ($1::uuid[]) AND s.event_types && $3::text[]
                                             AND s.deleted_at IS NULL) || $5::uuid[])
                     AND e.environment_id = ANY ($1::uuid[]) AND (e.event_types && $3::text[] OR e.id = ANY ($5::uuid[]))
                     AND e.deleted_at IS NULL
                     AND (e.enabled OR e.disabled_reason IN ('gone', 'failing'))
                   -- KEY SHARE on the health row: a change of circuit (FOR
                   -- UPDATE) waits for this expansion, or this expansion for
                   -- it, so a row is never written pending behind an open
                   -- circuit or held behind a closed one unseen.
                   ORDER BY e.id FOR SHARE OF e FOR KEY SHARE OF h),
                 -- Attempts each sending subscriber has handed out, counted
                 -- only up to its cap (all the answer needs): the cost is its
                 -- own few index entries, not every lease of every endpoint.
                 counted AS MATERIALIZED (
                   SELECT l.*, CASE WHEN l.holding THEN 0 ELSE
                            (SELECT count(*) FROM (SELECT 1 FROM webhook_deliveries d
                                                   WHERE d.state = 'pending' AND d.dispatched_at IS NOT NULL AND d.endpoint_id = l.id
                                                   LIMIT l.cap) AS s) END AS n
                   FROM live l),
                 -- One delivery per fresh event and subscriber, its id minted
                 -- here so that nothing after the insert has to find the rows
                 -- again (JOINS_BY_ESTIMATE); those within their endpoint's
                 -- cap are written leased. An operational event goes to its
                 -- target alone, a tenant's event to its subscribers.
                 matched AS MATERIALIZED (
                   SELECT relay_uuid_v7() AS id, c.environment_id, e.id AS endpoint_id, c.event_id, c.trace_context, c.lease_ms,
                          c.claimant, c.ord, c.size, e.holding, e.url, e.signature_scheme, e.secret_key_id, e.secret_ciphertext,
                          e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at, e.headers_key_id, e.headers_ciphertext,
                          e.client_tls_key_id, e.client_tls_ciphertext, e.ca_bundle, e.oauth2_key_id, e.oauth2_ciphertext, e.max_in_flight,
                          e.gated, e.n, e.cap, e.ordered AND c.okey IS NOT NULL AS lane, c.okey, c.oseq
                   FROM fresh c
                   JOIN counted e ON e.environment_id = c.environment_id
                     AND CASE WHEN c.target IS NULL THEN e.event_types @> ARRAY[c.event_type] ELSE e.id = c.target END
                   WHERE NOT EXISTS (SELECT 1 FROM UNNEST($10::bigint[], $11::uuid[]) AS r(ord, endpoint_id)
                                     WHERE r.ord = c.ord AND r.endpoint_id = e.id)),
                 -- The lanes this expansion opens or takes, each with the
                 -- position its head here gets. A lane whose row it creates
                 -- has no other delivery anywhere (every writer of a lane's
                 -- rows creates or finds its row first, and a concurrent
                 -- creator is waited for): its first row here is its head,
                 -- numbered 1. An idle lane (its last promotion found no
                 -- head and nothing queued, under the lane's lock; whoever
                 -- makes a head clears it under the same lock) with nothing
                 -- queued now (a key's earlier events are expanded and
                 -- committed before this one is, so their rows are in this
                 -- statement's snapshot) is taken: its first row here is its
                 -- head, numbered after its last. The row's newest version
                 -- decides, after waiting for a promotion that holds it
                 -- (which locks lanes before anything else, so never waits
                 -- for this). Any other lane's rows are queued for its
                 -- promotion (`lanes::promote`). Through the key's unique
                 -- index whatever the statistics say (a small lanes table
                 -- planned as empty was read whole for each lane).
                 opened AS (
                   INSERT INTO ordering_lanes AS g (endpoint_id, ordering_key, last_position)
                   SELECT DISTINCT endpoint_id, okey, 1 FROM matched WHERE lane ORDER BY endpoint_id, okey
                   -- The queue probed per lane as a scalar subquery: as
                   -- NOT EXISTS the planner hashed every queued row of
                   -- every endpoint once per statement that met an idle
                   -- lane (a short queue when planned; 200 rows queued
                   -- behind one hanging receiver were read 30 times over).
                   ON CONFLICT (endpoint_id, ordering_key) DO UPDATE SET last_position = g.last_position + 1, idle = false
                     WHERE g.idle AND (SELECT 1 FROM webhook_deliveries q
                                       WHERE q.state = 'queued' AND q.endpoint_id = g.endpoint_id
                                         AND q.ordering_key = g.ordering_key LIMIT 1) IS NULL
                   RETURNING g.endpoint_id, g.ordering_key, g.last_position),
                 -- Each lane opened or taken here with its head's position,
                 -- keyed by endpoint (36 characters) and key: looked up once
                 -- per row in a map, not by a scan of `opened` per row (a
                 -- subquery the planner cannot hash, estimating one row
                 -- each: 100,000 comparisons for 320 ordered deliveries,
                 -- 12 ms of a 36 ms expansion under `w6`).
                 head_positions AS MATERIALIZED (
                   SELECT jsonb_object_agg(endpoint_id::text || ordering_key, last_position) AS of_lane FROM opened),
                 marked AS MATERIALIZED (
                   SELECT m.*, m.lane AND NOT m.lane_head AS queued,
                          m.gated AND NOT m.holding AND NOT (m.lane AND NOT m.lane_head) AS gated_now,
                          -- A rate-limited endpoint's rows wait for its gate
                          -- (see `claim_and_lease`): none is leased here.
                          NOT m.holding AND NOT m.gated AND NOT (m.lane AND NOT m.lane_head)
                            AND row_number() OVER (PARTITION BY m.endpoint_id ORDER BY m.ord) + m.n <= m.cap AS leased
                   FROM (SELECT y.*, y.lane AND y.nth_in_lane = 1 AND y.head_position IS NOT NULL AS lane_head
                         FROM (SELECT x.*, row_number() OVER (PARTITION BY x.endpoint_id, x.okey ORDER BY x.oseq) AS nth_in_lane,
                                      ((SELECT of_lane FROM head_positions) -> (x.endpoint_id::text || x.okey))::bigint AS head_position
                               FROM matched x) y) m),
                 -- An endpoint that is down gets its deliveries held: no
                 -- relay pass looks at them until it recovers. No conflict
                 -- is expected: the ledger claim makes this the event's only
                 -- expansion, so a row already there would be a broken
                 -- invariant, and it fails the statement rather than be
                 -- answered for as written.
                 created AS (
                   INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id, trace_context, state, dispatched_at, next_attempt_at,
                                                   held_since, ordering_key, ordering_rank, ordering_position)
                   SELECT id, environment_id, endpoint_id, event_id, trace_context,
                          CASE WHEN queued THEN 'queued' WHEN holding THEN 'held' ELSE 'pending' END,
                          CASE WHEN leased THEN now() END,
                          CASE WHEN leased THEN now() + lease_ms * interval '1 millisecond' ELSE now() END,
                          CASE WHEN holding AND NOT queued THEN now() END,
                          CASE WHEN lane THEN okey END, CASE WHEN lane THEN oseq * 2 END, CASE WHEN lane_head THEN head_position END
                   FROM marked),
                 -- The leased first attempts of a claimant's events go into
                 -- its hands in the order asked, as far as the bodies fit.
                 handed AS (
                   SELECT m.*, m.leased AND m.claimant IS NOT NULL
                            AND sum(m.size) FILTER (WHERE m.leased AND m.claimant IS NOT NULL) OVER (ORDER BY m.ord, m.endpoint_id) <= $9
                            AS in_hand
                   FROM marked m),
                 claimed AS (
                   INSERT INTO attempt_claims (delivery_id, attempt, generation, claimant, until)
                   SELECT id, 1, 0, claimant, now() + lease_ms * interval '1 millisecond' FROM handed WHERE in_hand)
          -- A row for each item as asked, then one for each delivery it created.
          SELECT a.ord AS "ord!", f.stored_type AS "stored_type?", fr.ord IS NOT NULL AS "fresh!", NULL::uuid AS "id?: DeliveryId",
                 NULL::uuid AS "endpoint_id?: EndpointId", NULL::text AS "trace_context?", false AS "leased!", false AS "in_hand!", false AS "held!",
                 false AS "queued!", false AS "lane_head!", NULL::bigint AS "lane_position?", NULL::text AS "ordering_key?", EXISTS (SELECT 1 FROM deferred x WHERE x.environment_id = a.environment_id AND x.event_id = a.event_id) AS "deferred!",
                 false AS "gated!",
                 NULL::text AS "url?", NULL::text AS "signature_scheme?", NULL::text AS "secret_key_id?", NULL::bytea AS "secret_ciphertext?",
                 NULL::text AS "previous_secret_key_id?", NULL::bytea AS "previous_secret_ciphertext?",
                 NULL::timestamptz AS "secret_rotated_at?", NULL::text AS "headers_key_id?", NULL::bytea AS "headers_ciphertext?",
                 NULL::text AS "client_tls_key_id?", NULL::bytea AS "client_tls_ciphertext?", NULL::text AS "ca_bundle?",
                 NULL::text AS "oauth2_key_id?", NULL::bytea AS "oauth2_ciphertext?", NULL::int AS "max_in_flight?",
                 NULL::bytea AS "envelope?"
          FROM asked a LEFT JOIN found f ON f.ord = a.ord LEFT JOIN fresh fr ON fr.ord = a.ord
          UNION ALL
          SELECT h.ord, NULL, true, h.id, h.endpoint_id, h.trace_context, h.leased, h.in_hand, h.holding AND NOT h.queued, h.queued,
                 h.lane_head, CASE WHEN h.lane_head THEN h.head_position END, CASE WHEN h.lane THEN h.okey END, false, h.gated_now,
                 CASE WHEN h.in_hand THEN h.url END, CASE WHEN h.in_hand THEN h.signature_scheme END, CASE WHEN h.in_hand THEN h.secret_key_id END,
                 CASE WHEN h.in_hand THEN h.secret_ciphertext END, CASE WHEN h.in_hand THEN h.previous_secret_key_id END,
                 CASE WHEN h.in_hand THEN h.previous_secret_ciphertext END, CASE WHEN h.in_hand THEN h.secret_rotated_at END,
                 CASE WHEN h.in_hand THEN h.headers_key_id END, CASE WHEN h.in_hand THEN h.headers_ciphertext END,
                 CASE WHEN h.in_hand THEN h.client_tls_key_id END, CASE WHEN h.in_hand THEN h.client_tls_ciphertext END,
                 CASE WHEN h.in_hand THEN h.ca_bundle END, CASE WHEN h.in_hand THEN h.oauth2_key_id END,
                 CASE WHEN h.in_hand THEN h.oauth2_ciphertext END, CASE WHEN h.in_hand THEN h.max_in_flight END,
                 -- The body once per event, on its first row in hand.
                 CASE WHEN h.in_hand AND h.nth = 1 THEN
                   (SELECT v.envelope FROM events v WHERE v.environment_id = h.environment_id AND v.id = h.event_id) END
          FROM (SELECT *, row_number() OVER (PARTITION BY ord, in_hand ORDER BY id) AS nth FROM handed) h
          ORDER BY 1, 4 NULLS FIRST"#,
        &events.environment_id as _,
        &events.event_id as _,
        &events.event_type,
        &events.trace_context as &[Option<String>],
        &events.target as _,
        &events.lease_ms,
        &events.claimant as _,
        cap,
        payload_budget,
        &events.refused_ord,
        &events.refused_endpoint as _,
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// First attempts the broker did not take: due now, unleased, for the relay.
pub async fn release_unsent_first_attempts(db: &PgPool, ids: &[DeliveryId]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET dispatched_at = NULL, next_attempt_at = now()
         WHERE id = ANY ($1) AND state = 'pending' AND generation = 0 AND attempt = 1 AND dispatched_at IS NOT NULL",
        ids as _,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// First attempts claimed for a dispatcher that could not take them (see
/// `app::at_publish`): unclaimed, due now and unleased, for the relay. Only
/// while still that dispatcher's first attempt: one sent meanwhile by
/// whoever took it is left alone.
pub async fn release_untaken_first_attempts(db: &PgPool, ids: &[DeliveryId], claimant: DispatcherId) -> AppResult<u64> {
    Ok(sqlx::query!(
        "WITH unclaimed AS (
           DELETE FROM attempt_claims WHERE delivery_id = ANY ($1) AND claimant = $2 AND generation = 0 AND attempt = 1
           RETURNING delivery_id)
         UPDATE webhook_deliveries SET dispatched_at = NULL, next_attempt_at = now()
         WHERE id IN (SELECT delivery_id FROM unclaimed)
           AND state = 'pending' AND generation = 0 AND attempt = 1 AND dispatched_at IS NOT NULL",
        ids as _,
        claimant as _,
    )
    .execute(db)
    .await?
    .rows_affected())
}
