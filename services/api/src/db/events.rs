//! `events` (each row is also the outbox row), as publishing and the
//! outbox relay use them; expansion claims them in its `consumed_events`
//! ledger in `deliveries::expand`.

use std::time::Duration;

use relay_domain::{EndpointId, EnvironmentId, EventId};
use sqlx::{PgConnection, PgPool};

use super::models::{Delivery, DeliveryState, EventFilter, LoggedEvent, Timestamp};
use crate::error::AppResult;

/// An unpublished event as the outbox relay publishes it.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub seq: i64,
    pub id: EventId,
    pub environment_id: EnvironmentId,
    pub event_type: String,
    pub trace_context: Option<String>,
    /// An operational event's one recipient.
    pub target_endpoint_id: Option<EndpointId>,
}

/// Claims up to `limit` unpublished events nobody holds for `claim`, in one
/// statement (committed without waiting for the disk: a claim lost to a
/// crash is a re-publish the broker drops). Fair across environments: each
/// environment's oldest first, round robin (every environment's first, then
/// every environment's second, ...), so a burst in one environment takes
/// its turn beside the others instead of ahead of them.
pub async fn claim_unpublished<'e>(db: impl sqlx::PgExecutor<'e>, limit: i64, claim: Duration) -> AppResult<Vec<OutboxRow>> {
    let claim = super::interval(claim)?;
    Ok(sqlx::query!(
        "WITH RECURSIVE environments(environment_id) AS (
           (SELECT environment_id FROM events WHERE published_at IS NULL ORDER BY environment_id LIMIT 1)
           UNION ALL
           SELECT (SELECT v.environment_id FROM events v
                   WHERE v.published_at IS NULL AND v.environment_id > p.environment_id ORDER BY v.environment_id LIMIT 1)
           FROM environments p WHERE p.environment_id IS NOT NULL),
         turns AS (
           SELECT c.seq, c.turn FROM environments p
           CROSS JOIN LATERAL (
             SELECT v.seq, row_number() OVER (ORDER BY v.seq) AS turn FROM events v
             WHERE v.environment_id = p.environment_id AND v.published_at IS NULL
               AND (v.relay_claim_until IS NULL OR v.relay_claim_until < now())
             ORDER BY v.seq LIMIT $1) c
           WHERE p.environment_id IS NOT NULL
           ORDER BY c.turn, c.seq LIMIT $1),
         claimed AS (
           UPDATE events SET relay_claim_until = now() + $2
           FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit
           WHERE seq IN (SELECT seq FROM events WHERE seq IN (SELECT seq FROM turns) FOR UPDATE SKIP LOCKED)
           RETURNING seq, id, environment_id, event_type, trace_context, target_endpoint_id)
         -- In turns, so they are published in turns too.
         SELECT c.seq AS \"seq!\", c.id AS \"id!\", c.environment_id AS \"environment_id!\", c.event_type AS \"event_type!\",
                c.trace_context, c.target_endpoint_id
         FROM claimed c JOIN turns t USING (seq) ORDER BY t.turn, t.seq",
        limit,
        claim,
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .map(|r| OutboxRow {
        seq: r.seq,
        id: r.id.into(),
        environment_id: r.environment_id.into(),
        event_type: r.event_type,
        trace_context: r.trace_context,
        target_endpoint_id: r.target_endpoint_id.map(Into::into),
    })
    .collect())
}

/// The broker has these: published, claim ended.
pub async fn mark_published<'e>(db: impl sqlx::PgExecutor<'e>, seqs: &[i64]) -> AppResult<u64> {
    Ok(sqlx::query!(
        "UPDATE events SET published_at = now(), relay_claim_until = NULL
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cheap_commit WHERE seq = ANY ($1)",
        seqs,
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// The broker refused these: the next pass may take them at once.
pub async fn release_refused<'e>(db: impl sqlx::PgExecutor<'e>, seqs: &[i64]) -> AppResult<u64> {
    Ok(sqlx::query!("UPDATE events SET relay_claim_until = NULL WHERE seq = ANY ($1) AND published_at IS NULL", seqs)
        .execute(db)
        .await?
        .rows_affected())
}

/// Puts back in the outbox (unpublished, unclaimed) up to `limit` events
/// published between `window` and `min_age` ago that no expansion has
/// taken: the broker acknowledged them and then lost them, or holds them
/// where its consumer will not deliver them. Returns their places.
///
/// Whichever api published them: the one that did may have died before it
/// looked (its replacement remembers nothing). The walk follows `seq` from
/// the lower of `from_seq` (where this process's own publishing in the
/// window began, if it published) and the last `tail` places of the
/// outbox, so it reads a bounded stretch, once per look; it runs only when
/// the broker came back and when an api starts.
pub async fn unpublish_unexpanded<'e>(
    db: impl sqlx::PgExecutor<'e>,
    from_seq: Option<i64>,
    tail: i64,
    window: Duration,
    min_age: Duration,
    limit: i64,
) -> AppResult<Vec<i64>> {
    let (window, min_age) = (super::interval(window)?, super::interval(min_age)?);
    Ok(sqlx::query_scalar!(
        "WITH lost AS (
           SELECT e.seq FROM events e
           WHERE e.seq >= LEAST($1, (SELECT coalesce(max(seq), 0) FROM events) - $2)
             AND e.published_at IS NOT NULL AND e.published_at < now() - $3::interval
             AND e.published_at >= now() - $4::interval
             AND NOT EXISTS (SELECT 1 FROM consumed_events c
                             WHERE c.consumer = 'expand' AND c.environment_id = e.environment_id AND c.event_id = e.id)
           ORDER BY e.seq LIMIT $5)
         UPDATE events SET published_at = NULL, relay_claim_until = NULL
         WHERE seq IN (SELECT seq FROM lost) AND published_at IS NOT NULL
         RETURNING seq",
        from_seq.unwrap_or(i64::MAX),
        tail,
        min_age,
        window,
        limit,
    )
    .fetch_all(db)
    .await?)
}

/// New events, column by column; each is also its outbox row.
#[derive(Default)]
pub struct NewEvents {
    pub id: Vec<EventId>,
    pub environment_id: Vec<EnvironmentId>,
    pub event_type: Vec<String>,
    pub envelope: Vec<Vec<u8>>,
    pub occurred_at: Vec<Timestamp>,
    pub trace_context: Vec<Option<String>>,
    pub ordering_key: Vec<Option<String>>,
}

/// An event this insert wrote.
pub struct Inserted {
    pub environment_id: EnvironmentId,
    pub id: EventId,
    /// Its place in the outbox.
    pub seq: i64,
    pub ordering_key: Option<String>,
    /// Its number in its key's publish order, where this statement gave it
    /// one ([`insert_numbered`]).
    pub ordering_sequence: Option<i64>,
}

/// Inserts the events in one statement; returns each one inserted. An event
/// whose environment already has one with its id (a repeat publish, or the
/// same id twice in the batch) is not.
pub async fn insert(db: &mut PgConnection, events: &NewEvents) -> AppResult<Vec<Inserted>> {
    Ok(sqlx::query!(
        "INSERT INTO events (id, environment_id, event_type, envelope, created_at, trace_context, ordering_key)
         SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::text[], $4::bytea[], $5::timestamptz[], $6::text[], $7::text[])
         ON CONFLICT (environment_id, id) DO NOTHING
         RETURNING environment_id, id, seq, ordering_key, ordering_sequence",
        &events.id as _,
        &events.environment_id as _,
        &events.event_type,
        &events.envelope,
        &events.occurred_at,
        &events.trace_context as &[Option<String>],
        &events.ordering_key as &[Option<String>],
    )
    .fetch_all(&mut *db)
    .await?
    .into_iter()
    .map(|r| Inserted {
        environment_id: r.environment_id.into(),
        id: r.id.into(),
        seq: r.seq,
        ordering_key: r.ordering_key,
        ordering_sequence: r.ordering_sequence,
    })
    .collect())
}

/// Inserts the events numbered, in one statement, after [`lock_keys`] in
/// the same transaction: the events this environment does not have yet
/// (each id's first mention), each keyed one numbered next in its key as it
/// is written, and each key's counter advanced by its events written. One
/// statement where [`insert`] and [`number_by_key`] take two, and each event
/// written once instead of written and then updated with its number.
///
/// The new events are told from repeats before writing, in this statement's
/// snapshot (taken after the keys' locks were granted). A publish of the
/// same id under another key, or none, holds no lock of these keys, so it
/// may commit in between: then a numbered event is not written and its
/// number would be a gap in its key. `None` says so: the caller rolls back
/// and takes the two statements, which number only what was written.
pub async fn insert_numbered(db: &mut PgConnection, events: &NewEvents) -> AppResult<Option<Vec<Inserted>>> {
    let rows = sqlx::query!(
        r#"WITH asked AS (
             SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::text[], $4::bytea[], $5::timestamptz[], $6::text[], $7::text[])
               WITH ORDINALITY AS a(id, environment_id, event_type, envelope, created_at, trace_context, ordering_key, ord)),
           fresh AS (
             SELECT DISTINCT ON (environment_id, id) * FROM asked a
             WHERE NOT EXISTS (SELECT 1 FROM events v WHERE v.environment_id = a.environment_id AND v.id = a.id)
             ORDER BY environment_id, id, ord),
           counts AS (
             SELECT environment_id, ordering_key, count(*) AS n FROM fresh WHERE ordering_key IS NOT NULL
             GROUP BY environment_id, ordering_key),
           -- The keys' rows are this transaction's already (`lock_keys`),
           -- so nothing is inserted: each is advanced through the key's
           -- unique index whatever the statistics say (as an UPDATE joined
           -- to the counts, a keys table small when analysed was read whole
           -- per publish batch: 249 scans, 186,000 rows under `w6`).
           taken AS (
             INSERT INTO ordering_keys AS k (environment_id, ordering_key, last_sequence)
             SELECT environment_id, ordering_key, n FROM counts ORDER BY environment_id, ordering_key
             ON CONFLICT (environment_id, ordering_key) DO UPDATE SET last_sequence = k.last_sequence + excluded.last_sequence
             RETURNING k.environment_id, k.ordering_key, k.last_sequence),
           numbered AS (
             SELECT f.*, t.last_sequence - c.n + row_number() OVER (PARTITION BY f.environment_id, f.ordering_key ORDER BY f.ord) AS number
             FROM fresh f
             LEFT JOIN counts c ON c.environment_id = f.environment_id AND c.ordering_key = f.ordering_key
             LEFT JOIN taken t ON t.environment_id = f.environment_id AND t.ordering_key = f.ordering_key),
           -- In the order asked, so the outbox's order (`seq`) is the
           -- numbers' order within a key.
           written AS (
             INSERT INTO events (id, environment_id, event_type, envelope, created_at, trace_context, ordering_key, ordering_sequence)
             SELECT id, environment_id, event_type, envelope, created_at, trace_context, ordering_key, number FROM numbered ORDER BY ord
             ON CONFLICT (environment_id, id) DO NOTHING
             RETURNING environment_id, id, seq, ordering_key, ordering_sequence)
         SELECT environment_id, id, seq, ordering_key, ordering_sequence, NULL::bigint AS numbered FROM written
         -- The tally the caller checks: every numbered event written.
         UNION ALL
         SELECT NULL, NULL, NULL, NULL, NULL, (SELECT count(*) FROM numbered WHERE number IS NOT NULL)"#,
        &events.id as _,
        &events.environment_id as _,
        &events.event_type,
        &events.envelope,
        &events.occurred_at,
        &events.trace_context as &[Option<String>],
        &events.ordering_key as &[Option<String>],
    )
    .fetch_all(&mut *db)
    .await?;
    let mut numbered = 0;
    let mut inserted = Vec::with_capacity(rows.len());
    for r in rows {
        match (r.environment_id, r.id, r.seq) {
            (Some(environment_id), Some(id), Some(seq)) => inserted.push(Inserted {
                environment_id: environment_id.into(),
                id: id.into(),
                seq,
                ordering_key: r.ordering_key,
                ordering_sequence: r.ordering_sequence,
            }),
            _ => numbered = r.numbered.unwrap_or(0),
        }
    }
    let written_numbered = inserted.iter().filter(|e| e.ordering_sequence.is_some()).count();
    Ok((usize::try_from(numbered).ok() == Some(written_numbered)).then_some(inserted))
}

/// Takes the counter rows of these keys (creating those never used), locked
/// until the transaction ends, in key order so that two batches sharing keys
/// cannot deadlock. Taken before the events are written: a batch that waits
/// for a key writes its events, and takes their outbox places, after the
/// batch holding the key has committed.
pub async fn lock_keys(db: &mut PgConnection, environment_ids: &[EnvironmentId], keys: &[String]) -> AppResult<()> {
    sqlx::query!(
        "INSERT INTO ordering_keys (environment_id, ordering_key, last_sequence)
         SELECT DISTINCT environment_id, ordering_key, 0 FROM UNNEST($1::uuid[], $2::text[]) AS a(environment_id, ordering_key)
         ORDER BY environment_id, ordering_key
         ON CONFLICT (environment_id, ordering_key) DO UPDATE SET last_sequence = ordering_keys.last_sequence",
        environment_ids as _,
        keys,
    )
    .execute(&mut *db)
    .await?;
    Ok(())
}

/// Numbers the keyed events just inserted (in this transaction, after
/// [`lock_keys`]) in their keys' publish order: each key's counter is
/// advanced by its events in the batch, and the events get the numbers in
/// outbox order. Returns (environment, id, number).
pub async fn number_by_key(db: &mut PgConnection, keyed: &[&Inserted]) -> AppResult<Vec<(EnvironmentId, EventId, i64)>> {
    let environment_ids: Vec<EnvironmentId> = keyed.iter().map(|e| e.environment_id).collect();
    let ids: Vec<EventId> = keyed.iter().map(|e| e.id).collect();
    let seqs: Vec<i64> = keyed.iter().map(|e| e.seq).collect();
    let keys: Vec<String> = keyed.iter().map(|e| e.ordering_key.clone().unwrap_or_default()).collect();
    Ok(sqlx::query!(
        r#"WITH asked AS (SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::bigint[], $4::text[]) AS a(environment_id, id, seq, ordering_key)),
             counts AS (SELECT environment_id, ordering_key, count(*) AS n FROM asked GROUP BY environment_id, ordering_key),
             -- In key order: two batches sharing keys lock them in the same order.
             taken AS (
               INSERT INTO ordering_keys (environment_id, ordering_key, last_sequence)
               SELECT environment_id, ordering_key, n FROM counts ORDER BY environment_id, ordering_key
               ON CONFLICT (environment_id, ordering_key) DO UPDATE SET last_sequence = ordering_keys.last_sequence + EXCLUDED.last_sequence
               RETURNING environment_id, ordering_key, last_sequence),
             numbered AS (
               SELECT a.environment_id, a.id,
                      t.last_sequence - c.n + row_number() OVER (PARTITION BY a.environment_id, a.ordering_key ORDER BY a.seq) AS number
               FROM asked a
               JOIN counts c ON c.environment_id = a.environment_id AND c.ordering_key = a.ordering_key
               JOIN taken t ON t.environment_id = a.environment_id AND t.ordering_key = a.ordering_key)
           UPDATE events e SET ordering_sequence = n.number FROM numbered n
           WHERE e.environment_id = n.environment_id AND e.id = n.id
           RETURNING e.environment_id, e.id, e.ordering_sequence AS "number!""#,
        &environment_ids as _,
        &ids as _,
        &seqs,
        &keys,
    )
    .fetch_all(&mut *db)
    .await?
    .into_iter()
    .map(|r| (r.environment_id.into(), r.id.into(), r.number))
    .collect())
}

pub async fn exists(tx: &mut PgConnection, environment_id: EnvironmentId, id: EventId) -> AppResult<bool> {
    Ok(sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM events WHERE id = $1 AND environment_id = $2) AS "exists!""#,
        id as _,
        environment_id as _
    )
    .fetch_one(&mut *tx)
    .await?)
}

/// An event's deliveries, oldest first, without their attempts.
pub async fn deliveries_of(tx: &mut PgConnection, environment_id: EnvironmentId, event_id: EventId) -> AppResult<Vec<Delivery>> {
    Ok(sqlx::query!(
        r#"SELECT id, event_id, endpoint_id, state AS "state: DeliveryState", attempt, next_attempt_at, created_at, last_status,
                  last_error, generation, ordering_key, ordering_position
         FROM webhook_deliveries WHERE event_id = $1 AND environment_id = $2 ORDER BY created_at, id"#,
        event_id as _,
        environment_id as _,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| Delivery {
        id: r.id.into(),
        event_id: r.event_id.into(),
        endpoint_id: r.endpoint_id.into(),
        state: r.state,
        attempt: r.attempt,
        next_attempt_at: r.next_attempt_at,
        created_at: r.created_at,
        last_status: r.last_status,
        last_error: r.last_error,
        generation: r.generation,
        attempts: Vec::new(),
        ordering_key: r.ordering_key,
        ordering_position: r.ordering_position,
    })
    .collect())
}

/// Operational events to write, column by column: the environment, the
/// endpoint the event is about, its id, type and envelope.
#[derive(Default)]
pub struct Operational {
    pub environment_id: Vec<EnvironmentId>,
    pub subject: Vec<EndpointId>,
    pub id: Vec<EventId>,
    pub event_type: Vec<String>,
    pub envelope: Vec<Vec<u8>>,
}

/// The Postgres channel that says "the outbox holds events no relay was
/// offered" (written inside a transaction, not by a publish). Delivered at
/// commit, so the look it asks for finds them: a wake-up sent from inside
/// the transaction could come first, find nothing, and leave them to the
/// relay's backstop look.
pub const OUTBOX_CHANNEL: &str = "relay_outbox_waiting";

/// Asks every api's outbox relay, once `tx` commits, to look at the outbox.
pub async fn notify_outbox(tx: &mut PgConnection) -> AppResult<()> {
    sqlx::query_scalar!(r#"SELECT 1 AS "notified!" FROM pg_notify($1, '')"#, OUTBOX_CHANNEL).fetch_one(&mut *tx).await?;
    Ok(())
}

/// Writes operational events for the environments that name an operations
/// endpoint, each addressed to it, except an event about that endpoint
/// itself (it is not told about its own failures). Returns how many.
pub async fn insert_operational(tx: &mut PgConnection, o: &Operational) -> AppResult<u64> {
    if o.id.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query!(
        "INSERT INTO events (id, environment_id, event_type, envelope, target_endpoint_id)
         SELECT u.id, u.environment_id, u.event_type, u.envelope, v.operations_endpoint_id
         FROM UNNEST($1::uuid[], $2::uuid[], $3::uuid[], $4::text[], $5::bytea[]) AS u(environment_id, subject, id, event_type, envelope)
         JOIN environments v ON v.id = u.environment_id
         WHERE v.operations_endpoint_id IS NOT NULL AND v.operations_endpoint_id <> u.subject",
        &o.environment_id as _,
        &o.subject as _,
        &o.id as _,
        &o.event_type as &[String],
        &o.envelope,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Newest first, `limit` at most, through `events_environment_recent_idx`.
pub async fn list_recent(db: &PgPool, environment_id: EnvironmentId, f: &EventFilter, limit: i64) -> AppResult<Vec<LoggedEvent>> {
    let (before_at, before_seq) = f.before.unzip();
    Ok(sqlx::query_as!(
        LoggedEvent,
        r#"SELECT e.id, e.event_type, e.created_at, e.seq,
                  count(d.id) AS "deliveries!",
                  count(d.id) FILTER (WHERE d.state = 'delivered') AS "delivered!",
                  count(d.id) FILTER (WHERE d.state IN ('pending', 'held')
                                        AND (d.last_status IS NOT NULL OR d.last_error IS NOT NULL)) AS "failing!",
                  count(d.id) FILTER (WHERE d.state = 'dead') AS "dead!"
         FROM (SELECT id, event_type, created_at, seq FROM events
               WHERE environment_id = $1
                 AND ($2::text IS NULL OR event_type = $2)
                 AND ($3::timestamptz IS NULL OR created_at >= $3)
                 AND ($4::timestamptz IS NULL OR created_at < $4)
                 AND ($5::timestamptz IS NULL OR (created_at, seq) < ($5, $6::bigint))
               ORDER BY created_at DESC, seq DESC LIMIT $7) e
         LEFT JOIN webhook_deliveries d ON d.event_id = e.id AND d.environment_id = $1
         GROUP BY e.id, e.event_type, e.created_at, e.seq
         ORDER BY e.created_at DESC, e.seq DESC"#,
        environment_id as _,
        f.event_type.as_deref(),
        f.since,
        f.until,
        before_at,
        before_seq,
        limit,
    )
    .fetch_all(db)
    .await?)
}

/// One event of the environment: its type, when it was written, and the
/// envelope every attempt sends.
pub struct StoredEvent {
    pub id: EventId,
    pub event_type: String,
    pub created_at: Timestamp,
    pub envelope: Vec<u8>,
    /// Its ordering key and its number in the key's publish order.
    pub ordering_key: Option<String>,
    pub ordering_sequence: Option<i64>,
}

pub async fn get(db: &PgPool, environment_id: EnvironmentId, id: EventId) -> AppResult<Option<StoredEvent>> {
    Ok(sqlx::query_as!(
        StoredEvent,
        "SELECT id, event_type, created_at, envelope, ordering_key, ordering_sequence FROM events WHERE environment_id = $1 AND id = $2",
        environment_id as _,
        id as _
    )
    .fetch_optional(db)
    .await?)
}
