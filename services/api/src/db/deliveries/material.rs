//! What sending an attempt needs: its material (url, secrets, the stored
//! body) read under a claim, the refill of an endpoint's freed slots, and
//! the attempt claims themselves (`attempt_claims`).

use std::{collections::HashSet, time::Duration};

use relay_domain::{DeliveryId, DispatcherId, EndpointId, EnvironmentId, EventId};
use sqlx::PgPool;

use crate::{
    db::models::{DeliveryState, DisabledReason, Timestamp},
    error::AppResult,
};

/// What the material of one asked-for attempt is read from.
pub struct MaterialRow {
    /// The position of the request this row answers (from 1).
    pub ord: i64,
    /// The attempt is current and its endpoint active: it will be sent.
    pub servable: bool,
    pub id: DeliveryId,
    pub environment_id: EnvironmentId,
    pub endpoint_id: EndpointId,
    pub event_id: EventId,
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
    pub headers_key_id: Option<String>,
    pub headers_ciphertext: Option<Vec<u8>>,
    pub client_tls_key_id: Option<String>,
    pub client_tls_ciphertext: Option<Vec<u8>>,
    pub ca_bundle: Option<String>,
    pub oauth2_key_id: Option<String>,
    pub oauth2_ciphertext: Option<Vec<u8>>,
    pub max_in_flight: Option<i32>,
    /// In a lane: its key and position (the sequence header).
    pub ordering_key: Option<String>,
    pub ordering_position: Option<i64>,
    /// Absent when the reply's payload budget was spent on earlier items.
    pub envelope: Option<Vec<u8>>,
}

/// The attempts asked for, with their endpoints and events, in one read.
/// Payloads are carried, in request order over the servable rows, up to
/// `payload_budget` bytes (the first servable row's always).
pub async fn read_material(
    db: &PgPool,
    ids: &[DeliveryId],
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
                  e.secret_rotated_at, e.headers_key_id, e.headers_ciphertext, e.client_tls_key_id, e.client_tls_ciphertext, e.ca_bundle,
                  e.oauth2_key_id, e.oauth2_ciphertext, e.max_in_flight, d.ordering_key, d.ordering_position, v.envelope,
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
                secret_rotated_at AS "secret_rotated_at?", headers_key_id AS "headers_key_id?", headers_ciphertext AS "headers_ciphertext?",
                client_tls_key_id AS "client_tls_key_id?", client_tls_ciphertext AS "client_tls_ciphertext?", ca_bundle AS "ca_bundle?",
                oauth2_key_id AS "oauth2_key_id?", oauth2_ciphertext AS "oauth2_ciphertext?", max_in_flight AS "max_in_flight?",
                ordering_key AS "ordering_key?", ordering_position AS "ordering_position?",
                CASE WHEN servable AND (upto = size OR upto <= $4) THEN envelope END AS "envelope?"
         FROM sized"#,
        ids as _,
        attempts,
        generations,
        payload_budget,
    )
    .fetch_all(db)
    .await?)
}

/// A waiting delivery handed to a dispatcher whose outcome freed its slot.
pub struct RefillRow {
    pub id: DeliveryId,
    pub environment_id: EnvironmentId,
    pub endpoint_id: EndpointId,
    pub event_id: EventId,
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
    pub headers_key_id: Option<String>,
    pub headers_ciphertext: Option<Vec<u8>>,
    pub client_tls_key_id: Option<String>,
    pub client_tls_ciphertext: Option<Vec<u8>>,
    pub ca_bundle: Option<String>,
    pub oauth2_key_id: Option<String>,
    pub oauth2_ciphertext: Option<Vec<u8>>,
    pub max_in_flight: Option<i32>,
    pub ordering_key: Option<String>,
    pub ordering_position: Option<i64>,
    pub envelope: Vec<u8>,
}

/// Fills the free slots of these endpoints but rate-limited ones (each within its in-flight cap,
/// as the relay counts it: one for an endpoint handed one at a time) with their oldest due waiting deliveries, in one statement: each
/// locked as it is read (rows another pass holds are passed over), claimed
/// for `claimant` for `hold`, and leased where the claim was taken, up to
/// `payload_budget` bytes of envelopes (the first row's always); returns the
/// leased ones with what sending them needs. The caller holds the lease guard, as a relay pass does. Leases
/// and claims are committed without waiting for the disk (a cheap commit,
/// see `relay`): lost, each is only a lease that runs out.
pub async fn refill<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoints: &[EndpointId],
    cap: i64,
    claimant: DispatcherId,
    hold: Duration,
    payload_budget: i64,
) -> AppResult<Vec<RefillRow>> {
    let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query_as!(
        RefillRow,
        r#"WITH capped AS MATERIALIZED (
             SELECT h.endpoint_id, CASE WHEN h.one_at_a_time THEN 1 ELSE LEAST(COALESCE(e.max_in_flight, $2::bigint), $2::bigint) END AS cap
             FROM endpoint_health h JOIN webhook_endpoints e ON e.id = h.endpoint_id
             WHERE h.endpoint_id = ANY ($1::uuid[]) AND e.deleted_at IS NULL AND (e.enabled OR e.disabled_reason = 'failing')
               -- A rate-limited endpoint's rows pass its gate, which only
               -- the relay's claim opens (`claim_and_lease`).
               AND e.rate_per_second IS NULL),
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
             RETURNING d.id, d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.trace_context, d.ordering_key,
                       d.ordering_position)
         SELECT l.id AS "id!", l.environment_id AS "environment_id!", l.endpoint_id AS "endpoint_id!", l.event_id AS "event_id!",
                l.attempt AS "attempt!", l.generation AS "generation!", l.trace_context, e.url, e.signature_scheme, e.secret_key_id,
                e.secret_ciphertext,
                e.previous_secret_key_id, e.previous_secret_ciphertext, e.secret_rotated_at, e.headers_key_id, e.headers_ciphertext,
                e.client_tls_key_id, e.client_tls_ciphertext, e.ca_bundle, e.oauth2_key_id, e.oauth2_ciphertext, e.max_in_flight,
                l.ordering_key, l.ordering_position, v.envelope
         FROM leased l
         JOIN webhook_endpoints e ON e.id = l.endpoint_id
         JOIN events v ON v.environment_id = l.environment_id AND v.id = l.event_id"#,
        endpoints as _,
        cap,
        claimant as _,
        hold_ms,
        payload_budget,
    )
    .fetch_all(db)
    .await?)
}

/// Claims to take: one attempt each, for a claimant, for `hold_ms`.
#[derive(Default)]
pub struct ClaimsAsked {
    pub delivery_id: Vec<DeliveryId>,
    pub attempt: Vec<i32>,
    pub generation: Vec<i32>,
    pub claimant: Vec<DispatcherId>,
    pub hold_ms: Vec<i64>,
}

/// Takes the attempts nobody else holds (or whose holder's claim ran out),
/// in one statement; returns the deliveries claimed.
pub async fn claim_attempts<'e>(db: impl sqlx::PgExecutor<'e>, asked: &ClaimsAsked) -> AppResult<HashSet<DeliveryId>> {
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
        &asked.delivery_id as _,
        &asked.attempt,
        &asked.generation,
        &asked.claimant as _,
        &asked.hold_ms,
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .map(DeliveryId::from)
    .collect())
}

/// Claims that ran out long ago: a claim matters only while it holds.
pub async fn prune_attempt_claims(db: &PgPool) -> AppResult<u64> {
    Ok(sqlx::query!("DELETE FROM attempt_claims WHERE until < now() - interval '10 minutes'").execute(db).await?.rows_affected())
}
