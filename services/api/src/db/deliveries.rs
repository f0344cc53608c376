//! `webhook_deliveries` and `attempt_claims`: every statement that writes a
//! delivery's state, one function each. What the new state is comes from
//! `app::state`; these functions only store it.
//!
//! `INDEXED_LOOKUPS`: a statement that joins a table to an `UNNEST` of ids
//! also says `id = ANY ($ids)`. Joined alone, the plan depends on the table's
//! size when the statement was planned: a plan cached while the table was
//! small (a fresh install, a pooled connection's first minutes) hashes the
//! ids and scans the whole table, and keeps doing so as the table grows
//! until an ANALYZE replaces it (seen: 8,700 rows read per material call at
//! 20,000 deliveries). With the ids as an index condition the primary key
//! serves the lookup at any size.
//!
//! `JOINS_BY_ESTIMATE`: the planner joins two row sets by nested loop when
//! it expects one of them to hold a row, and it expects one row of most
//! intermediate results of these statements: of a CTE joined to another on
//! two keys, of the rows a data-modifying CTE returns, of deliveries read by
//! id and filtered on a state the statistics say is rare. For a batch of n
//! items such a loop compares n² pairs, and re-reads (and re-forms, with
//! whole-row copies for an UPDATE's `FROM`) the inner set n times: 102,080
//! pairs for an expansion of 32 events to 10 endpoints, 65,280 for an
//! outcome batch of 256, most of the database's CPU per delivery under load.
//! So these statements do not join batch-sized sets to each other: each
//! step carries forward what the later ones need (ids minted before the
//! insert that uses them, a report's values in `RETURNING`), and a batch
//! meets a table only through an index.

use std::{collections::HashSet, time::Duration};

use sqlx::{PgConnection, PgPool, postgres::types::PgInterval};
use uuid::Uuid;

use super::models::{Circuit, DeliveryState, DisabledReason, Timestamp};
use crate::error::AppResult;

/// The Postgres channel that says "deliveries are due now". Every api
/// process's delivery relay listens, so a row written by one api wakes the
/// relays of all of them; delivered at commit, so never before the rows exist.
pub const DUE_CHANNEL: &str = "relay_deliveries_due";

pub async fn notify_due(tx: &mut PgConnection) -> AppResult<()> {
    notify(tx, DUE_NOW).await
}

/// Rows were written waiting behind their endpoints' in-flight caps: no
/// relay pass can take them before an outcome frees a slot, and the outcome
/// that does fills it (see `app::outcomes`), so this tells every api to
/// refill rather than waking its relay for a pass that finds nothing.
pub async fn notify_capped(tx: &mut PgConnection) -> AppResult<()> {
    notify(tx, BEHIND_CAPS).await
}

/// What a notification on [`DUE_CHANNEL`] says.
pub const DUE_NOW: &str = "";
pub const BEHIND_CAPS: &str = "capped";

async fn notify(tx: &mut PgConnection, what: &str) -> AppResult<()> {
    sqlx::query_scalar!(r#"SELECT 1 AS "notified!" FROM pg_notify($1, $2)"#, DUE_CHANNEL, what).fetch_one(&mut *tx).await?;
    Ok(())
}

/// Who holds claims an endpoint's switch-off must wait for: the claimant
/// stored on the placeholders that fence the ended attempts (see
/// [`end_pending_of_endpoint`]), never a dispatcher's.
pub const SWITCHED_OFF: Uuid = Uuid::nil();

/// How long a placeholder claim fences its attempt: far longer than a
/// material call that read the attempt before the switch-off committed can
/// take to try to claim it.
const FENCE_MS: i64 = 60_000;

/// A dispatcher's live claim on an attempt that a switch-off ended: that
/// dispatcher may have the attempt queued, about to start, or on the wire.
#[derive(Debug, Clone)]
pub struct HeldClaim {
    pub delivery_id: Uuid,
    pub attempt: i32,
    pub generation: i32,
    pub claimant: Uuid,
    /// Until the claim runs out, by the database's clock; the dispatcher
    /// starts no attempt past its claim, nor has one on the wire then.
    pub remaining_ms: i64,
}

/// Every pending or held delivery of an endpoint being disabled or deleted, in the
/// caller's transaction (the one that switches the endpoint off): each ends
/// as a dead letter with `reason` (why it will not be attempted again), the
/// update and the dead letters in one statement. `attempts` counts the
/// attempts that reported (the current one had not).
///
/// The same statement fences the ended attempts' claims, so that the caller
/// learns of every dispatcher that holds one and no other can take one: a
/// dispatcher's live claim on the attempt is kept and returned, anything else
/// becomes a placeholder of [`SWITCHED_OFF`]'s (which no claim for the same
/// attempt replaces). A claim being taken meanwhile (a material call that
/// read the attempt as current before this commits) either committed first,
/// and is returned here, or meets the placeholder, waits for this
/// transaction and is refused; rows being leased and claimed by an outcome's
/// refill are waited for by the update, and their claims returned.
pub async fn end_pending_of_endpoint(tx: &mut PgConnection, endpoint_id: Uuid, reason: &str) -> AppResult<Vec<HeldClaim>> {
    Ok(sqlx::query_as!(
        HeldClaim,
        r#"WITH ended AS (
           UPDATE webhook_deliveries SET state = 'dead', dispatched_at = NULL, last_error = $2, updated_at = now()
           -- Spelled as the three partial indexes that hold an endpoint's
           -- live rows (waiting, leased, held), so each serves its part.
           WHERE endpoint_id = $1
             AND (state = 'pending' AND dispatched_at IS NULL OR state = 'pending' AND dispatched_at IS NOT NULL OR state = 'held')
           RETURNING id, environment_id, endpoint_id, event_id, attempt, generation, last_status),
         lettered AS (
           INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason)
           SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt - 1, last_status, $2, $2 FROM ended),
         fenced AS (
           INSERT INTO attempt_claims AS c (delivery_id, attempt, generation, claimant, until)
           SELECT id, attempt, generation, $3, now() + $4::bigint * interval '1 millisecond' FROM ended
           ON CONFLICT (delivery_id) DO UPDATE
             SET claimant = CASE WHEN c.until > now() AND (c.generation, c.attempt) = (excluded.generation, excluded.attempt)
                                 THEN c.claimant ELSE excluded.claimant END,
                 until = CASE WHEN c.until > now() AND (c.generation, c.attempt) = (excluded.generation, excluded.attempt)
                              THEN c.until ELSE excluded.until END,
                 attempt = excluded.attempt, generation = excluded.generation
           RETURNING delivery_id, attempt, generation, claimant, until)
         SELECT delivery_id, attempt, generation, claimant,
                ceil(extract(epoch FROM until - now()) * 1000)::bigint AS "remaining_ms!"
         FROM fenced WHERE claimant <> $3"#,
        endpoint_id,
        reason,
        SWITCHED_OFF,
        FENCE_MS,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// The same ending for pending deliveries found by id (see `end_pending_of_endpoint`).
pub async fn end_pending_by_id(db: &PgPool, ids: &[Uuid], reason: &str) -> AppResult<u64> {
    Ok(sqlx::query!(
        "WITH ended AS (
           UPDATE webhook_deliveries SET state = 'dead', dispatched_at = NULL, last_error = $2, updated_at = now()
           WHERE state = 'pending' AND id = ANY ($1)
           RETURNING id, environment_id, endpoint_id, event_id, attempt, last_status)
         INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason)
         SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt - 1, last_status, $2, $2 FROM ended",
        ids,
        reason,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// Events to expand, column by column, in the order they were asked.
pub struct ToExpand {
    pub environment_id: Vec<Uuid>,
    pub event_id: Vec<Uuid>,
    pub event_type: Vec<String>,
    pub trace_context: Vec<Option<String>>,
    /// An operational event's one recipient (`None`: its subscribers).
    pub target: Vec<Option<Uuid>>,
    /// How long the first attempts of each event written already leased are
    /// leased for, in ms.
    pub lease_ms: Vec<i64>,
    /// Who takes each event's leased first attempts in hand (`None`: the broker).
    pub claimant: Vec<Option<Uuid>>,
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
    pub id: Option<Uuid>,
    pub endpoint_id: Option<Uuid>,
    pub trace_context: Option<String>,
    /// Written already leased: this api hands it out itself…
    pub leased: bool,
    /// …into the asking dispatcher's hands, claimed for it (else to the broker).
    pub in_hand: bool,
    /// Written held: its endpoint is down.
    pub held: bool,
    /// For an attempt in hand, what sending it needs from its endpoint…
    pub url: Option<String>,
    pub signature_scheme: Option<String>,
    pub secret_key_id: Option<String>,
    pub secret_ciphertext: Option<Vec<u8>>,
    pub previous_secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
    pub secret_rotated_at: Option<Timestamp>,
    /// …and its body, on the first such row of each event.
    pub envelope: Option<Vec<u8>>,
}

/// Expands events in one statement, so that it commits by itself: checks
/// them, claims each in the `consumed_events` ledger once (its first mention
/// with its stored type, in key order, so two expansions that share events
/// cannot deadlock; an event claimed before is not expanded again), writes
/// one delivery per subscribed, active endpoint of each claimed event
/// (first attempt due now), and claims the attempts handed back.
///
/// Rows within their endpoint's in-flight `cap` (one for an endpoint handed
/// one attempt at a time, see `app::health`) are written already leased for their event's
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
                   SELECT a.*, v.event_type AS stored_type, octet_length(v.envelope) AS size FROM asked a
                   JOIN events v ON v.environment_id = a.environment_id AND v.id = a.event_id
                   -- The keys as an index condition too (INDEXED_LOOKUPS).
                   WHERE v.environment_id = ANY ($1::uuid[]) AND v.id = ANY ($2::uuid[])),
                 -- Each event's first mention that names its stored type.
                 first AS (
                   SELECT DISTINCT ON (environment_id, event_id) * FROM found WHERE stored_type = event_type
                   ORDER BY environment_id, event_id, ord),
                 consumed AS (
                   INSERT INTO consumed_events (consumer, environment_id, event_id)
                   SELECT 'expand', environment_id, event_id FROM first ORDER BY environment_id, event_id
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
                          e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at,
                          h.circuit IN ('open', 'half_open') OR e.disabled_reason IS NOT NULL AS holding,
                          CASE WHEN h.one_at_a_time THEN 1 ELSE $8::bigint END AS cap
                   FROM webhook_endpoints e JOIN endpoint_health h ON h.endpoint_id = e.id
                   WHERE e.environment_id = ANY ($1::uuid[]) AND (e.event_types && $3::text[] OR e.id = ANY ($5::uuid[]))
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
                 marked AS MATERIALIZED (
                   SELECT relay_uuid_v7() AS id, c.environment_id, e.id AS endpoint_id, c.event_id, c.trace_context, c.lease_ms,
                          c.claimant, c.ord, c.size, e.holding, e.url, e.signature_scheme, e.secret_key_id, e.secret_ciphertext,
                          e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at,
                          NOT e.holding AND row_number() OVER (PARTITION BY e.id ORDER BY c.ord) + e.n <= e.cap AS leased
                   FROM fresh c
                   JOIN counted e ON e.environment_id = c.environment_id
                     AND CASE WHEN c.target IS NULL THEN e.event_types @> ARRAY[c.event_type] ELSE e.id = c.target END),
                 -- An endpoint that is down gets its deliveries held: no
                 -- relay pass looks at them until it recovers. No conflict
                 -- is expected: the ledger claim makes this the event's only
                 -- expansion, so a row already there would be a broken
                 -- invariant, and it fails the statement rather than be
                 -- answered for as written.
                 created AS (
                   INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id, trace_context, state, dispatched_at, next_attempt_at,
                                                   held_since)
                   SELECT id, environment_id, endpoint_id, event_id, trace_context, CASE WHEN holding THEN 'held' ELSE 'pending' END,
                          CASE WHEN leased THEN now() END,
                          CASE WHEN leased THEN now() + lease_ms * interval '1 millisecond' ELSE now() END,
                          CASE WHEN holding THEN now() END
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
          SELECT a.ord AS "ord!", f.stored_type AS "stored_type?", fr.ord IS NOT NULL AS "fresh!", NULL::uuid AS "id?",
                 NULL::uuid AS "endpoint_id?", NULL::text AS "trace_context?", false AS "leased!", false AS "in_hand!", false AS "held!",
                 NULL::text AS "url?", NULL::text AS "signature_scheme?", NULL::text AS "secret_key_id?", NULL::bytea AS "secret_ciphertext?",
                 NULL::text AS "previous_secret_key_id?", NULL::bytea AS "previous_secret_ciphertext?",
                 NULL::timestamptz AS "secret_rotated_at?", NULL::bytea AS "envelope?"
          FROM asked a LEFT JOIN found f ON f.ord = a.ord LEFT JOIN fresh fr ON fr.ord = a.ord
          UNION ALL
          SELECT h.ord, NULL, true, h.id, h.endpoint_id, h.trace_context, h.leased, h.in_hand, h.holding,
                 CASE WHEN h.in_hand THEN h.url END, CASE WHEN h.in_hand THEN h.signature_scheme END, CASE WHEN h.in_hand THEN h.secret_key_id END,
                 CASE WHEN h.in_hand THEN h.secret_ciphertext END, CASE WHEN h.in_hand THEN h.previous_secret_key_id END,
                 CASE WHEN h.in_hand THEN h.previous_secret_ciphertext END, CASE WHEN h.in_hand THEN h.secret_rotated_at END,
                 -- The body once per event, on its first row in hand.
                 CASE WHEN h.in_hand AND h.nth = 1 THEN
                   (SELECT v.envelope FROM events v WHERE v.environment_id = h.environment_id AND v.id = h.event_id) END
          FROM (SELECT *, row_number() OVER (PARTITION BY ord, in_hand ORDER BY id) AS nth FROM handed) h
          ORDER BY 1, 4 NULLS FIRST"#,
        &events.environment_id,
        &events.event_id,
        &events.event_type,
        &events.trace_context as &[Option<String>],
        &events.target as &[Option<Uuid>],
        &events.lease_ms,
        &events.claimant as &[Option<Uuid>],
        cap,
        payload_budget,
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// First attempts the broker did not take: due now, unleased, for the relay.
pub async fn release_unsent_first_attempts(db: &PgPool, ids: &[Uuid]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET dispatched_at = NULL, next_attempt_at = now()
         WHERE id = ANY ($1) AND state = 'pending' AND generation = 0 AND attempt = 1 AND dispatched_at IS NOT NULL",
        ids,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// What the material of one asked-for attempt is read from.
pub struct MaterialRow {
    /// The position of the request this row answers (from 1).
    pub ord: i64,
    /// The attempt is current and its endpoint active: it will be sent.
    pub servable: bool,
    pub id: Uuid,
    pub environment_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub attempt: i32,
    pub generation: i32,
    pub state: DeliveryState,
    pub url: String,
    pub enabled: bool,
    pub disabled_reason: Option<DisabledReason>,
    pub deleted: bool,
    pub signature_scheme: String,
    pub secret_key_id: String,
    pub secret_ciphertext: Vec<u8>,
    pub previous_secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
    pub secret_rotated_at: Option<Timestamp>,
    /// Absent when the reply's payload budget was spent on earlier items.
    pub envelope: Option<Vec<u8>>,
}

/// The attempts asked for, with their endpoints and events, in one read.
/// Payloads are carried, in request order over the servable rows, up to
/// `payload_budget` bytes (the first servable row's always).
pub async fn read_material(
    db: &PgPool,
    ids: &[Uuid],
    attempts: &[i32],
    generations: &[i32],
    payload_budget: i64,
) -> AppResult<Vec<MaterialRow>> {
    Ok(sqlx::query_as!(
        MaterialRow,
        r#"WITH asked AS (
           SELECT w.ord, d.id, d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.state,
                  e.url, e.enabled, e.disabled_reason, e.deleted_at IS NOT NULL AS deleted,
                  e.signature_scheme, e.secret_key_id, e.secret_ciphertext, e.previous_secret_key_id, e.previous_secret_ciphertext,
                  e.secret_rotated_at, v.envelope,
                  d.state = 'pending' AND d.attempt = w.attempt AND d.generation = w.generation
                    AND (e.enabled OR e.disabled_reason = 'failing') AND e.deleted_at IS NULL AS servable
           FROM UNNEST($1::uuid[], $2::int[], $3::int[]) WITH ORDINALITY AS w(id, attempt, generation, ord)
           JOIN webhook_deliveries d ON d.id = w.id
           JOIN webhook_endpoints e ON e.id = d.endpoint_id
           JOIN events v ON v.environment_id = d.environment_id AND v.id = d.event_id
           -- The ids as an index condition too (see `INDEXED_LOOKUPS`).
           WHERE d.id = ANY ($1::uuid[])),
         sized AS (
           SELECT *, octet_length(envelope) AS size,
                  sum(CASE WHEN servable THEN octet_length(envelope) ELSE 0 END) OVER (ORDER BY ord) AS upto
           FROM asked)
         SELECT ord AS "ord!", servable AS "servable!", id AS "id!", environment_id AS "environment_id!",
                endpoint_id AS "endpoint_id!", event_id AS "event_id!", attempt AS "attempt!", generation AS "generation!",
                state AS "state!: DeliveryState", url AS "url!", enabled AS "enabled!",
                disabled_reason AS "disabled_reason?: DisabledReason", deleted AS "deleted!",
                signature_scheme AS "signature_scheme!", secret_key_id AS "secret_key_id!", secret_ciphertext AS "secret_ciphertext!",
                previous_secret_key_id AS "previous_secret_key_id?", previous_secret_ciphertext AS "previous_secret_ciphertext?",
                secret_rotated_at AS "secret_rotated_at?",
                CASE WHEN servable AND (upto = size OR upto <= $4) THEN envelope END AS "envelope?"
         FROM sized"#,
        ids,
        attempts,
        generations,
        payload_budget,
    )
    .fetch_all(db)
    .await?)
}

/// A waiting delivery handed to a dispatcher whose outcome freed its slot.
pub struct RefillRow {
    pub id: Uuid,
    pub environment_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub attempt: i32,
    pub generation: i32,
    pub trace_context: Option<String>,
    pub url: String,
    pub signature_scheme: String,
    pub secret_key_id: String,
    pub secret_ciphertext: Vec<u8>,
    pub previous_secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
    pub secret_rotated_at: Option<Timestamp>,
    pub envelope: Vec<u8>,
}

/// Fills the free slots of these endpoints (each within its in-flight cap,
/// as the relay counts it: one for an endpoint handed one at a time) with their oldest due waiting deliveries, in one statement: each
/// locked as it is read (rows another pass holds are passed over), claimed
/// for `claimant` for `hold`, and leased where the claim was taken, up to
/// `payload_budget` bytes of envelopes (the first row's always); returns the
/// leased ones with what sending them needs. The caller holds the lease guard, as a relay pass does. Leases
/// and claims are committed without waiting for the disk (a cheap commit,
/// see `relay`): lost, each is only a lease that runs out.
pub async fn refill<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoints: &[Uuid],
    cap: i64,
    claimant: Uuid,
    hold: Duration,
    payload_budget: i64,
) -> AppResult<Vec<RefillRow>> {
    let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query_as!(
        RefillRow,
        r#"WITH capped AS MATERIALIZED (
             SELECT h.endpoint_id, CASE WHEN h.one_at_a_time THEN 1 ELSE $2::bigint END AS cap
             FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id
             WHERE h.endpoint_id = ANY ($1::uuid[]) AND e.deleted_at IS NULL AND (e.enabled OR e.disabled_reason = 'failing')),
           counted AS MATERIALIZED (
             SELECT c.endpoint_id, c.cap,
                    (SELECT count(*) FROM (SELECT 1 FROM webhook_deliveries l
                                           WHERE l.state = 'pending' AND l.dispatched_at IS NOT NULL AND l.endpoint_id = c.endpoint_id
                                           LIMIT c.cap) AS s) AS n
             FROM capped c),
           -- Each endpoint's first waiting rows in due order, as many as it
           -- has free slots, locked as they are read (a relay pass or
           -- another refill taking some meanwhile: those are passed over),
           -- then those of them that are due (written as in
           -- `due_candidates`, so only the waiting index serves the order)…
           chosen AS (
             SELECT d.id, d.environment_id, d.event_id, d.attempt, d.generation, d.next_attempt_at FROM counted c CROSS JOIN LATERAL (
               SELECT id, environment_id, event_id, attempt, generation, next_attempt_at FROM webhook_deliveries d
               WHERE d.state = 'pending' AND d.dispatched_at IS NULL
                 AND d.endpoint_id >= c.endpoint_id AND d.endpoint_id <= c.endpoint_id
               ORDER BY d.endpoint_id, d.next_attempt_at LIMIT c.cap - c.n
               FOR UPDATE SKIP LOCKED) AS d
             WHERE c.n < c.cap AND d.next_attempt_at <= now()),
           -- …as far as the reply's budget for bodies goes (the first row's always)…
           sized AS (
             SELECT ch.id, ch.attempt, ch.generation, octet_length(v.envelope) AS size,
                    sum(octet_length(v.envelope)) OVER (ORDER BY ch.next_attempt_at, ch.id) AS upto
             FROM chosen ch JOIN events v ON v.environment_id = ch.environment_id AND v.id = ch.event_id),
           -- …claimed for the dispatcher (an attempt nobody else holds)…
           claimed AS (
             INSERT INTO attempt_claims AS c (delivery_id, attempt, generation, claimant, until)
             SELECT id, attempt, generation, $3, now() + $4::bigint * interval '1 millisecond' FROM sized WHERE upto <= $5 OR upto = size
             ON CONFLICT (delivery_id) DO UPDATE
               SET attempt = excluded.attempt, generation = excluded.generation, claimant = excluded.claimant, until = excluded.until
               WHERE c.claimant = excluded.claimant OR c.until < now()
                  OR (c.generation, c.attempt) <> (excluded.generation, excluded.attempt)
             RETURNING delivery_id),
           -- …and leased, those claimed: the lease's rows come back with
           -- what the answer needs, so no set is joined to another
           -- (JOINS_BY_ESTIMATE). As arrays, so that each set is looked up
           -- by its ids whatever the planner thinks of their sizes.
           leased AS (
             UPDATE webhook_deliveries d SET dispatched_at = now(), next_attempt_at = now() + $4::bigint * interval '1 millisecond'
             FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
             WHERE d.id = ANY (ARRAY(SELECT delivery_id FROM claimed))
             RETURNING d.id, d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.trace_context)
         SELECT l.id AS "id!", l.environment_id AS "environment_id!", l.endpoint_id AS "endpoint_id!", l.event_id AS "event_id!",
                l.attempt AS "attempt!", l.generation AS "generation!", l.trace_context, e.url, e.signature_scheme, e.secret_key_id,
                e.secret_ciphertext,
                e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at, v.envelope
         FROM leased l
         JOIN webhook_endpoints e ON e.id = l.endpoint_id
         JOIN events v ON v.environment_id = l.environment_id AND v.id = l.event_id"#,
        endpoints,
        cap,
        claimant,
        hold_ms,
        payload_budget,
    )
    .fetch_all(db)
    .await?)
}

/// Claims to take: one attempt each, for a claimant, for `hold_ms`.
#[derive(Default)]
pub struct ClaimsAsked {
    pub delivery_id: Vec<Uuid>,
    pub attempt: Vec<i32>,
    pub generation: Vec<i32>,
    pub claimant: Vec<Uuid>,
    pub hold_ms: Vec<i64>,
}

/// Takes the attempts nobody else holds (or whose holder's claim ran out),
/// in one statement; returns the deliveries claimed.
pub async fn claim_attempts<'e>(db: impl sqlx::PgExecutor<'e>, asked: &ClaimsAsked) -> AppResult<HashSet<Uuid>> {
    // A claim for an earlier attempt or generation of the delivery is
    // replaced; one for this attempt only by its own claimant, or once it
    // has run out.
    Ok(sqlx::query_scalar!(
        "INSERT INTO attempt_claims AS c (delivery_id, attempt, generation, claimant, until)
         SELECT u.id, u.attempt, u.generation, u.claimant, now() + u.hold_ms * interval '1 millisecond'
         FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::uuid[], $5::bigint[]) AS u(id, attempt, generation, claimant, hold_ms)
         ON CONFLICT (delivery_id) DO UPDATE
           SET attempt = excluded.attempt, generation = excluded.generation, claimant = excluded.claimant, until = excluded.until
           WHERE c.claimant = excluded.claimant OR c.until < now()
              OR (c.generation, c.attempt) <> (excluded.generation, excluded.attempt)
         RETURNING delivery_id",
        &asked.delivery_id,
        &asked.attempt,
        &asked.generation,
        &asked.claimant,
        &asked.hold_ms,
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .collect())
}

/// Claims that ran out long ago: a claim matters only while it holds.
pub async fn prune_attempt_claims(db: &PgPool) -> AppResult<u64> {
    Ok(sqlx::query!("DELETE FROM attempt_claims WHERE until < now() - interval '10 minutes'").execute(db).await?.rows_affected())
}

/// Outcomes to apply where they are for the delivery's current attempt,
/// column by column, with what the attempt log keeps of each.
#[derive(Default)]
pub struct CurrentOutcomes {
    pub id: Vec<Uuid>,
    pub generation: Vec<i32>,
    pub attempt: Vec<i32>,
    pub state: Vec<DeliveryState>,
    pub next_attempt: Vec<i32>,
    pub next_attempt_at: Vec<Option<Timestamp>>,
    pub status: Vec<Option<i32>>,
    /// The report's error: the attempt log's, and the delivery's unless delivered.
    pub error: Vec<Option<String>>,
    pub latency_ms: Vec<i64>,
    pub response_body: Vec<Vec<u8>>,
    pub decision: Vec<&'static str>,
    pub signature_scheme: Vec<Option<&'static str>>,
}

/// A delivery an outcome applied to, with its endpoint's health as it
/// stood before this statement.
pub struct AppliedOutcome {
    pub id: Uuid,
    pub environment_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub circuit: Circuit,
    pub consecutive_failures: i32,
    pub last_success_at: Option<Timestamp>,
    pub disabled_reason: Option<DisabledReason>,
    /// The window's length, current bucket and failures in it and the
    /// previous one: whether a failure is still inside the window.
    pub window_ms: i64,
    pub window_bucket: i64,
    pub window_failures: i32,
    pub previous_failures: i32,
}

/// Applies each outcome only where it is for the current attempt (pending,
/// or held since it was sent; same generation and attempt), logs the
/// attempts it applied and writes the dead letters of those that ran out,
/// in one statement; returns the deliveries it applied to, with their
/// endpoints' health (what the circuit rules need next). One statement, so
/// a batch of successes needs no transaction around it.
pub async fn record_current_outcomes(conn: &mut PgConnection, o: &CurrentOutcomes) -> AppResult<Vec<AppliedOutcome>> {
    let states: Vec<&str> = o.state.iter().map(|s| s.as_str()).collect();
    Ok(sqlx::query_as!(
        AppliedOutcome,
        r#"WITH applied AS (
             UPDATE webhook_deliveries d SET state = u.state, attempt = u.next_attempt, next_attempt_at = coalesce(u.next_attempt_at, d.next_attempt_at),
               dispatched_at = NULL, last_status = u.status, last_error = CASE WHEN u.state = 'delivered' THEN NULL ELSE u.error END,
               updated_at = now()
             FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::text[], $5::int[], $6::timestamptz[], $7::int[], $8::text[],
                         $9::bigint[], $10::bytea[], $11::text[], $12::text[])
               AS u(id, generation, attempt, state, next_attempt, next_attempt_at, status, error, latency_ms, body, decision, scheme)
             -- The ids as an index condition too (INDEXED_LOOKUPS). The state
             -- test names the report so that it stays a join condition
             -- (JOINS_BY_ESTIMATE): the rows read by id are then as many as
             -- the reports, not the one a pending-state estimate predicts.
             WHERE d.id = ANY ($1::uuid[]) AND d.id = u.id AND d.generation = u.generation AND d.attempt = u.attempt
               AND (d.state IN ('pending', 'held') OR u.id IS NULL)
             -- What the log and the dead letters need comes with each row:
             -- nothing joins the applied rows to the reports again.
             RETURNING d.id, d.environment_id, d.endpoint_id, d.event_id, u.generation, u.attempt, u.state AS reported_state,
                       u.status, u.error, u.latency_ms, u.body, u.decision, u.next_attempt_at, u.scheme),
           logged AS (
             INSERT INTO delivery_attempts
               (delivery_id, generation, attempt, environment_id, http_status, error, latency_ms, response_body, decision, next_attempt_at,
                signature_scheme)
             SELECT id, generation, attempt, environment_id, status, error, latency_ms, body, decision, next_attempt_at, scheme FROM applied),
           -- The dead letter and the state change commit together: a dead
           -- delivery always has its record.
           exhausted AS (
             INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error)
             SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt, status, error
             FROM applied WHERE reported_state = 'dead')
         SELECT a.id AS "id!", a.environment_id AS "environment_id!", a.endpoint_id AS "endpoint_id!", a.event_id AS "event_id!",
                h.circuit AS "circuit!: Circuit", h.consecutive_failures AS "consecutive_failures!", h.last_success_at,
                e.disabled_reason AS "disabled_reason?: DisabledReason", h.window_ms AS "window_ms!", h.window_bucket AS "window_bucket!",
                h.window_failures AS "window_failures!", h.previous_failures AS "previous_failures!"
         FROM applied a JOIN endpoint_health h ON h.endpoint_id = a.endpoint_id JOIN webhook_endpoints e ON e.id = a.endpoint_id"#,
        &o.id,
        &o.generation,
        &o.attempt,
        &states as &[&str],
        &o.next_attempt,
        &o.next_attempt_at as &[Option<Timestamp>],
        &o.status as &[Option<i32>],
        &o.error as &[Option<String>],
        &o.latency_ms,
        &o.response_body,
        &o.decision as &[&str],
        &o.signature_scheme as &[Option<&str>],
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// A delivery as the careful outcome path reads and rewrites it.
#[derive(Clone)]
pub struct OutcomeRow {
    pub id: Uuid,
    pub environment_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub attempt: i32,
    pub generation: i32,
    pub state: DeliveryState,
    pub next_attempt_at: Timestamp,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
}

/// The deliveries locked for update, in id order (so two batches that share
/// a delivery lock in the same order).
pub async fn lock_for_outcome(tx: &mut PgConnection, ids: &[Uuid]) -> AppResult<Vec<OutcomeRow>> {
    Ok(sqlx::query_as!(
        OutcomeRow,
        r#"SELECT id, environment_id, endpoint_id, event_id, attempt, generation, state AS "state: DeliveryState", next_attempt_at,
                  last_status, last_error
         FROM webhook_deliveries WHERE id = ANY ($1) ORDER BY id FOR UPDATE"#,
        ids,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Writes back rows the careful path changed.
pub async fn rewrite_after_outcome(tx: &mut PgConnection, rows: &[&OutcomeRow]) -> AppResult<()> {
    let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
    let states: Vec<&str> = rows.iter().map(|r| r.state.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempt).collect();
    let due: Vec<Timestamp> = rows.iter().map(|r| r.next_attempt_at).collect();
    let statuses: Vec<Option<i32>> = rows.iter().map(|r| r.last_status).collect();
    let errors: Vec<Option<String>> = rows.iter().map(|r| r.last_error.clone()).collect();
    sqlx::query!(
        "UPDATE webhook_deliveries d SET state = u.state, attempt = u.attempt, next_attempt_at = u.next_attempt_at,
           dispatched_at = NULL, last_status = u.last_status, last_error = u.last_error, updated_at = now()
         FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::timestamptz[], $5::int[], $6::text[])
           AS u(id, state, attempt, next_attempt_at, last_status, last_error)
         WHERE d.id = ANY ($1::uuid[]) AND d.id = u.id",
        &ids,
        &states as &[&str],
        &attempts,
        &due,
        &statuses as &[Option<i32>],
        &errors as &[Option<String>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A dead delivery back at attempt 1, due now, in a new generation. False
/// when it is no longer dead (already replayed).
pub async fn reset_for_replay(tx: &mut PgConnection, delivery_id: Uuid) -> AppResult<bool> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries SET state = 'pending', attempt = 1, generation = generation + 1,
           next_attempt_at = now(), dispatched_at = NULL, updated_at = now()
         WHERE id = $1 AND state = 'dead'",
        delivery_id,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1)
}

/// The earliest due time of any pending delivery: the earliest lease to
/// run out, or the earliest waiting row, found endpoint by endpoint through
/// the waiting index (one probe each, as the relay's walk does; no index
/// orders every pending row by time, so that rows waiting and leased are
/// each written into two indexes instead of three).
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
           (SELECT min(next_attempt_at) FROM walk),
           (SELECT min(next_attempt_at) FROM webhook_deliveries WHERE state = 'pending' AND dispatched_at IS NOT NULL))"
    )
    .fetch_one(db)
    .await?)
}

/// A row this pass locked and hands to the broker.
pub struct Claimed {
    pub id: Uuid,
    pub environment_id: Uuid,
    pub endpoint_id: Uuid,
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
/// or its retries fail too; see `app::health`) gets one slot, not `cap`: no
/// use handing a receiver that is timing out more work to time out on.
/// Returns the rows' ids: each endpoint's rows are already within its free
/// slots, so every one may be claimed.
pub async fn due_candidates<'e>(db: impl sqlx::PgExecutor<'e>, limit: i64, cap: i64) -> AppResult<Vec<Uuid>> {
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
           SELECT w.endpoint_id, CASE WHEN h.one_at_a_time THEN 1 ELSE $2::bigint END AS cap
           FROM walk w JOIN endpoint_health h ON h.endpoint_id = w.endpoint_id
           -- Only endpoints with something due: one whose retries are all
           -- later costs its probe and nothing more.
           WHERE w.next_attempt_at <= now()),
         counted AS MATERIALIZED (
           SELECT c.endpoint_id, c.cap,
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
             ORDER BY d.endpoint_id, d.next_attempt_at LIMIT c.cap - c.n) AS d
           WHERE c.n < c.cap AND d.next_attempt_at <= now()
           UNION ALL
           (SELECT id, endpoint_id, true, next_attempt_at FROM webhook_deliveries
            WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at <= now()
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
    .await?)
}

/// Claims the chosen rows that are still due and unclaimed, and leases them
/// for `lease`, in one statement: no row lock or transaction is held while
/// the broker is asked. Committed without waiting for the disk: a claim lost
/// to a Postgres crash is a re-publish the broker drops.
pub async fn claim_and_lease<'e>(db: impl sqlx::PgExecutor<'e>, chosen: &[Uuid], lease: Duration) -> AppResult<Vec<Claimed>> {
    let lease = PgInterval::try_from(lease).map_err(|e| anyhow::anyhow!("a lease of {lease:?} is not an interval: {e}"))?;
    Ok(sqlx::query_as!(
        Claimed,
        r#"UPDATE webhook_deliveries d SET dispatched_at = now(), next_attempt_at = now() + $2
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
         WHERE d.id IN (SELECT id FROM webhook_deliveries
                        WHERE id = ANY ($1) AND state = 'pending' AND next_attempt_at <= now()
                        ORDER BY id FOR UPDATE SKIP LOCKED)
         RETURNING d.id, d.environment_id, d.endpoint_id, d.attempt, d.generation, d.trace_context, d.dispatched_at AS "dispatched_at!""#,
        chosen,
        lease,
    )
    .fetch_all(db)
    .await?)
}

/// Releases rows the broker refused, where still under the claim made at
/// `claimed_at` (compare-and-set on the claim's instant).
pub async fn release_refused<'e>(db: impl sqlx::PgExecutor<'e>, ids: &[Uuid], claimed_at: &[Timestamp]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE webhook_deliveries d SET dispatched_at = NULL, next_attempt_at = now()
         FROM UNNEST($1::uuid[], $2::timestamptz[]) AS u(id, at)
         WHERE d.id = ANY ($1::uuid[]) AND d.id = u.id AND d.state = 'pending' AND d.dispatched_at = u.at",
        ids,
        claimed_at,
    )
    .execute(db)
    .await?
    .rows_affected())
}
