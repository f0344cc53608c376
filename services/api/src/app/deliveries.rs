//! The delivery state machine: expand, material, outcome, replay, and the
//! dead-letter store. Every transition is one transaction.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use anyhow::Context;
use chrono::{SubsecRound, Utc};
use relay_signing::SigningSecret;
use uuid::Uuid;

use super::{App, Tenant, Timestamp};
use crate::error::{AppError, AppResult, ErrorCode};

/// The ledger name expansion claims events under.
const EXPAND_CONSUMER: &str = "expand";
/// How long a rotated-out secret keeps signing. A promise recipients code
/// against, not a tuning knob.
pub const ROTATION_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The lease first attempts are written with when this api hands them to
/// the broker itself, after the commit. Short, because it stands for "the
/// publish may not have happened": if this process dies between the commit
/// and the broker's ack, the relay re-publishes them this soon. It is well
/// inside the broker's duplicate window, so re-publishing one that did land
/// is dropped by the broker; the relay's re-publish then extends the lease
/// to the full length for attempts still in progress.
const DIRECT_PUBLISH_LEASE: Duration = Duration::from_secs(10);
const _: () = assert!(DIRECT_PUBLISH_LEASE.as_secs() * 4 <= crate::broker::DUPLICATE_WINDOW.as_secs(), "re-publishes must be deduplicated");
/// The attempt log keeps this much of a response body.
pub const MAX_RESPONSE_BODY: usize = 4096;
const MAX_ERROR_LEN: usize = 2000;

#[derive(Debug, Clone, Copy)]
pub struct Expanded {
    pub created: u32,
    pub duplicate: bool,
}

/// Everything one attempt needs. The secrets are decrypted for this attempt
/// only; `SigningSecret`'s `Debug` keeps them out of logs.
#[derive(Debug)]
pub struct Material {
    pub delivery_id: Uuid,
    pub endpoint_id: Uuid,
    pub environment_id: Uuid,
    pub event_id: Uuid,
    pub url: String,
    pub attempt: u32,
    pub generation: u32,
    pub secrets: Vec<SigningSecret>,
    pub payload: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct AttemptReport {
    pub delivery_id: Uuid,
    pub generation: u32,
    pub attempt: u32,
    pub http_status: Option<u32>,
    pub error: String,
    pub latency_ms: u64,
    pub response_body: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Delivered,
    Rescheduled { next_attempt_at: Timestamp },
    DeadLettered,
}

impl Decision {
    /// The delivery's state once this decision is applied.
    fn new_state(&self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Rescheduled { .. } => "pending",
            Self::DeadLettered => "dead",
        }
    }

    fn next_attempt_at(&self) -> Option<Timestamp> {
        match self {
            Self::Rescheduled { next_attempt_at } => Some(*next_attempt_at),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Rescheduled { .. } => "rescheduled",
            Self::DeadLettered => "dead_lettered",
        }
    }
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DeadLetter {
    pub id: Uuid,
    pub delivery_id: Uuid,
    pub endpoint_id: Uuid,
    pub event_id: Uuid,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub reason: String,
    pub dead_lettered_at: Timestamp,
}

/// One event to expand. `trace_context` is the traceparent its deliveries
/// carry, so their attempts continue the event's trace.
#[derive(Debug, Clone)]
pub struct ExpandItem {
    pub event_id: Uuid,
    pub environment_id: Uuid,
    pub event_type: String,
    pub trace_context: Option<String>,
}

/// A delivery row an expansion created.
#[derive(sqlx::FromRow)]
struct CreatedRow {
    id: Uuid,
    environment_id: Uuid,
    endpoint_id: Uuid,
    event_id: Uuid,
    trace_context: Option<String>,
    /// Written already leased: this api hands it to the broker itself.
    leased: bool,
}

/// One attempt of one delivery, as the dispatcher names it.
#[derive(Debug, Clone, Copy)]
pub struct AttemptRef {
    pub delivery_id: Uuid,
    pub generation: u32,
    pub attempt: u32,
    /// Who will send it, for how long: the material is handed out only to
    /// the holder of the attempt's claim. `None` reads without claiming.
    pub claim: Option<Claim>,
}

/// A dispatcher's claim on an attempt it is about to send.
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub claimant: Uuid,
    pub hold: Duration,
}

/// The longest claim a dispatcher may take.
pub const MAX_CLAIM_HOLD: Duration = Duration::from_secs(600);

#[derive(sqlx::FromRow)]
struct MaterialRow {
    /// The position of the request this row answers (from 1).
    ord: i64,
    /// The attempt is current and its endpoint active: it will be sent.
    servable: bool,
    id: Uuid,
    environment_id: Uuid,
    endpoint_id: Uuid,
    event_id: Uuid,
    attempt: i32,
    generation: i32,
    state: String,
    url: String,
    enabled: bool,
    deleted: bool,
    secret_key_id: String,
    secret_ciphertext: Vec<u8>,
    previous_secret_key_id: Option<String>,
    previous_secret_ciphertext: Option<Vec<u8>>,
    secret_rotated_at: Option<Timestamp>,
    /// Absent when the reply's payload budget was spent on earlier items.
    envelope: Option<Vec<u8>>,
}

#[derive(sqlx::FromRow)]
struct OutcomeRow {
    id: Uuid,
    environment_id: Uuid,
    endpoint_id: Uuid,
    event_id: Uuid,
    attempt: i32,
    generation: i32,
    state: String,
    next_attempt_at: Timestamp,
    last_status: Option<i32>,
    last_error: Option<String>,
}

/// Dead letters of one outcome batch, column by column for one `UNNEST` insert.
#[derive(Default)]
struct DeadLetterRows {
    id: Vec<Uuid>,
    environment_id: Vec<Uuid>,
    delivery_id: Vec<Uuid>,
    endpoint_id: Vec<Uuid>,
    event_id: Vec<Uuid>,
    attempts: Vec<i32>,
    last_status: Vec<Option<i32>>,
    last_error: Vec<Option<String>>,
}

impl DeadLetterRows {
    #[allow(clippy::too_many_arguments)]
    fn push_parts(
        &mut self,
        delivery_id: Uuid,
        environment_id: Uuid,
        endpoint_id: Uuid,
        event_id: Uuid,
        attempts: i32,
        last_status: Option<i32>,
        last_error: Option<String>,
    ) {
        self.id.push(Uuid::now_v7());
        self.environment_id.push(environment_id);
        self.delivery_id.push(delivery_id);
        self.endpoint_id.push(endpoint_id);
        self.event_id.push(event_id);
        self.attempts.push(attempts);
        self.last_status.push(last_status);
        self.last_error.push(last_error);
    }

    fn push(&mut self, row: &OutcomeRow, attempts: i32) {
        self.push_parts(row.id, row.environment_id, row.endpoint_id, row.event_id, attempts, row.last_status, row.last_error.clone());
    }
}

/// Attempt-log rows of one outcome batch, column by column.
#[derive(Default)]
struct AttemptRows {
    delivery_id: Vec<Uuid>,
    generation: Vec<i32>,
    attempt: Vec<i32>,
    environment_id: Vec<Uuid>,
    http_status: Vec<Option<i32>>,
    error: Vec<Option<String>>,
    latency_ms: Vec<i64>,
    response_body: Vec<Vec<u8>>,
    decision: Vec<&'static str>,
    next_attempt_at: Vec<Option<Timestamp>>,
}

impl AttemptRows {
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        delivery_id: &Uuid,
        generation: u32,
        attempt: u32,
        environment_id: Uuid,
        http_status: Option<i32>,
        error: Option<String>,
        latency_ms: u64,
        body: Vec<u8>,
        decision: Decision,
    ) {
        self.delivery_id.push(*delivery_id);
        self.generation.push(generation as i32);
        self.attempt.push(attempt as i32);
        self.environment_id.push(environment_id);
        self.http_status.push(http_status);
        self.error.push(error);
        self.latency_ms.push(i64::try_from(latency_ms).unwrap_or(i64::MAX));
        self.response_body.push(body);
        self.decision.push(decision.as_str());
        self.next_attempt_at.push(decision.next_attempt_at());
    }
}

/// A report's error text as the attempt log keeps it: bounded, and `None`
/// when the attempt got a response.
fn report_error(error: &str) -> Option<String> {
    let error = truncate(error.to_owned(), MAX_ERROR_LEN);
    (!error.is_empty()).then_some(error)
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// Ends deliveries still pending as dead letters with `reason` (why they
/// will not be attempted again); the update and the dead letters are one
/// statement. `attempts` counts the attempts that reported (the current one
/// had not).
macro_rules! end_as_dead_letters {
    ($filter:literal) => {
        concat!(
            "WITH ended AS (
               UPDATE webhook_deliveries SET state = 'dead', dispatched_at = NULL, last_error = $2, updated_at = now()
               WHERE state = 'pending' AND ",
            $filter,
            " RETURNING id, environment_id, endpoint_id, event_id, attempt, last_status)
             INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason)
             SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt - 1, last_status, $2, $2 FROM ended"
        )
    };
}

/// Every pending delivery of an endpoint being disabled or deleted, in the
/// caller's transaction (the one that switches the endpoint off).
pub(crate) async fn end_pending_deliveries(tx: &mut sqlx::PgConnection, endpoint_id: Uuid, reason: &str) -> AppResult<u64> {
    Ok(sqlx::query(end_as_dead_letters!("endpoint_id = $1")).bind(endpoint_id).bind(reason).execute(&mut *tx).await?.rows_affected())
}

async fn end_deliveries_by_id(db: &sqlx::PgPool, ids: &[Uuid], reason: &str) -> AppResult<u64> {
    Ok(sqlx::query(end_as_dead_letters!("id = ANY ($1)")).bind(ids).bind(reason).execute(db).await?.rows_affected())
}

/// The Postgres channel that says "deliveries are due now". Every api
/// process's delivery relay listens, so a row written by one api wakes the
/// relays of all of them; delivered at commit, so never before the rows exist.
pub const DUE_CHANNEL: &str = "relay_deliveries_due";

async fn notify_due(tx: &mut sqlx::PgConnection) -> AppResult<()> {
    sqlx::query("SELECT pg_notify($1, '')").bind(DUE_CHANNEL).execute(&mut *tx).await?;
    Ok(())
}

impl App {
    /// One delivery per matching endpoint, exactly once per event: the ledger
    /// claims and the rows commit together, so a redelivered event is a no-op.
    /// Many events go in one transaction: the events are checked with
    /// one read, claimed with one insert, and their deliveries written with
    /// one insert. Each item answers as `expand` would, in order.
    pub async fn expand_batch(&self, items: Vec<ExpandItem>) -> AppResult<Vec<AppResult<Expanded>>> {
        // Pre-leasing counts in-flight attempts like a relay pass does; the
        // two take turns (released at the commit, before publishing).
        let leasing = match &self.direct {
            Some(_) => Some(self.lease_guard.lock().await),
            None => None,
        };
        let mut tx = self.db.begin().await?;
        let (envs, ids): (Vec<Uuid>, Vec<Uuid>) = items.iter().map(|i| (i.environment_id, i.event_id)).unzip();
        let stored: HashMap<(Uuid, Uuid), String> = sqlx::query_as::<_, (Uuid, Uuid, String)>(
            "SELECT v.environment_id, v.id, v.event_type FROM events v
             JOIN UNNEST($1::uuid[], $2::uuid[]) AS k(environment_id, id) ON v.environment_id = k.environment_id AND v.id = k.id",
        )
        .bind(&envs)
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|(env, id, t)| ((env, id), t))
        .collect();

        // Which items may claim: the event exists as described, and it is
        // the first mention of that event in this batch. Claims are taken in
        // key order, so two batches that share events cannot deadlock.
        let mut out: Vec<Option<AppResult<Expanded>>> = Vec::with_capacity(items.len());
        let mut claimants: Vec<usize> = Vec::new();
        let mut seen: HashSet<(Uuid, Uuid)> = HashSet::new();
        for (i, item) in items.iter().enumerate() {
            let key = (item.environment_id, item.event_id);
            match stored.get(&key) {
                None => out.push(Some(Err(AppError::not_found("event")))),
                Some(t) if *t != item.event_type => out.push(Some(Err(AppError::invalid(
                    "event_mismatch",
                    format!("event {} does not have that environment and type", item.event_id),
                )))),
                Some(_) if !seen.insert(key) => out.push(Some(Ok(Expanded { created: 0, duplicate: true }))),
                Some(_) => {
                    out.push(None);
                    claimants.push(i);
                }
            }
        }
        claimants.sort_by_key(|&i| (items[i].environment_id, items[i].event_id));
        let claimed: HashSet<(Uuid, Uuid)> = if claimants.is_empty() {
            HashSet::new()
        } else {
            let (envs, ids): (Vec<Uuid>, Vec<Uuid>) = claimants.iter().map(|&i| (items[i].environment_id, items[i].event_id)).unzip();
            sqlx::query_as::<_, (Uuid, Uuid)>(
                "INSERT INTO consumed_events (consumer, environment_id, event_id)
                 SELECT $1, * FROM UNNEST($2::uuid[], $3::uuid[])
                 ON CONFLICT DO NOTHING RETURNING environment_id, event_id",
            )
            .bind(EXPAND_CONSUMER)
            .bind(&envs)
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect()
        };
        // Subscription filtering happens here, not at send time: a row that
        // exists is a row that will be sent. Every attempt of a delivery
        // continues its event's expansion trace. With direct dispatch, rows
        // within their endpoint's in-flight cap are written already leased
        // and handed to the broker after the commit; the rest wait, due, for
        // the relay.
        let mut created: HashMap<(Uuid, Uuid), u32> = HashMap::new();
        let mut leased: Vec<CreatedRow> = Vec::new();
        let mut waiting = false;
        let fresh: Vec<usize> =
            claimants.iter().copied().filter(|&i| claimed.contains(&(items[i].environment_id, items[i].event_id))).collect();
        if !fresh.is_empty() {
            let cap = self.direct.as_ref().map_or(0, |d| d.endpoint_cap);
            let rows: Vec<CreatedRow> = sqlx::query_as(
                "WITH busy AS MATERIALIZED (
                   SELECT endpoint_id, count(*) AS n FROM webhook_deliveries
                   WHERE state = 'pending' AND dispatched_at IS NOT NULL GROUP BY endpoint_id),
                 -- The subscribers, share-locked: a disable or delete of one
                 -- of them waits for this expansion to commit (and then ends
                 -- the rows it wrote), or this expansion waits for it and
                 -- re-reads the endpoint as disabled. Either way no pending
                 -- delivery of an inactive endpoint is ever committed.
                 live AS (
                   SELECT e.id, e.environment_id, e.event_types FROM webhook_endpoints e
                   WHERE e.environment_id = ANY ($1::uuid[]) AND e.event_types && $3::text[] AND e.enabled AND e.deleted_at IS NULL
                   ORDER BY e.id FOR SHARE),
                 matched AS (
                   SELECT e.environment_id, e.id AS endpoint_id, c.event_id, c.trace_context,
                          row_number() OVER (PARTITION BY e.id ORDER BY c.ord) AS rn
                   FROM UNNEST($1::uuid[], $2::uuid[], $3::text[], $4::text[])
                          WITH ORDINALITY AS c(environment_id, event_id, event_type, trace_context, ord)
                   JOIN live e ON e.event_types @> ARRAY[c.event_type] AND e.environment_id = c.environment_id),
                 marked AS (
                   SELECT m.*, m.rn + coalesce(b.n, 0) <= $5 AS leased FROM matched m LEFT JOIN busy b ON b.endpoint_id = m.endpoint_id)
                 INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id, trace_context, dispatched_at, next_attempt_at)
                 SELECT relay_uuid_v7(), environment_id, endpoint_id, event_id, trace_context,
                        CASE WHEN leased THEN now() END, CASE WHEN leased THEN now() + $6 ELSE now() END
                 FROM marked
                 ON CONFLICT (event_id, endpoint_id) DO NOTHING
                 RETURNING id, environment_id, endpoint_id, event_id, trace_context, dispatched_at IS NOT NULL AS leased",
            )
            .bind(fresh.iter().map(|&i| items[i].environment_id).collect::<Vec<_>>())
            .bind(fresh.iter().map(|&i| items[i].event_id).collect::<Vec<_>>())
            .bind(fresh.iter().map(|&i| items[i].event_type.clone()).collect::<Vec<_>>())
            .bind(fresh.iter().map(|&i| items[i].trace_context.clone()).collect::<Vec<_>>())
            .bind(cap)
            .bind(DIRECT_PUBLISH_LEASE)
            .fetch_all(&mut *tx)
            .await?;
            for row in rows {
                *created.entry((row.environment_id, row.event_id)).or_default() += 1;
                if row.leased {
                    leased.push(row);
                } else {
                    waiting = true;
                }
            }
        }
        if waiting {
            notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing an expansion batch")?;
        drop(leasing);
        if !leased.is_empty() {
            self.dispatch_leased(&leased).await;
        }
        if waiting {
            self.deliveries_wake.wake();
        }
        for &i in &claimants {
            let key = (items[i].environment_id, items[i].event_id);
            out[i] = Some(Ok(if claimed.contains(&key) {
                Expanded { created: created.get(&key).copied().unwrap_or(0), duplicate: false }
            } else {
                Expanded { created: 0, duplicate: true }
            }));
        }
        Ok(out.into_iter().map(|o| o.expect("every item answered")).collect())
    }

    /// Hands first attempts written already leased to the broker. Whatever
    /// the broker did not take is released at once (due now, unleased) for
    /// the relay; if this process dies first, the lease expires and the relay
    /// takes it then. The message id is the one the relay would use, so a
    /// publish that did land is never sent twice.
    async fn dispatch_leased(&self, rows: &[CreatedRow]) {
        let Some(direct) = &self.direct else { return };
        let messages = rows
            .iter()
            .map(|r| {
                crate::relay::deliveries::job_message(
                    &direct.names,
                    &crate::relay::deliveries::Job {
                        delivery_id: r.id,
                        endpoint_id: r.endpoint_id,
                        environment_id: r.environment_id,
                        attempt: 1,
                        generation: 0,
                        trace_context: r.trace_context.as_deref(),
                    },
                )
            })
            .collect();
        let (stored, first_error) = crate::broker::publish_all(&direct.js, messages).await;
        let unsent: Vec<Uuid> = rows.iter().zip(stored).filter_map(|(r, ok)| (!ok).then_some(r.id)).collect();
        if unsent.is_empty() {
            return;
        }
        tracing::warn!(count = unsent.len(), error = ?first_error, "the broker did not take some first attempts; the relay will");
        let released = sqlx::query(
            "UPDATE webhook_deliveries SET dispatched_at = NULL, next_attempt_at = now()
             WHERE id = ANY ($1) AND state = 'pending' AND generation = 0 AND attempt = 1 AND dispatched_at IS NOT NULL",
        )
        .bind(&unsent)
        .execute(&self.db)
        .await;
        if let Err(e) = released {
            tracing::warn!(error = %e, "releasing unsent first attempts failed; their leases will expire");
        }
        self.deliveries_wake.wake();
    }

    /// What one attempt needs, if that attempt is still the delivery's current one.
    pub async fn material(&self, wanted: AttemptRef) -> AppResult<Material> {
        self.material_batch(&[wanted]).await?.pop().expect("one answer per request")
    }

    /// Material for many attempts with one query. The outer error is the
    /// batch failing as a whole (the database); each item answers on its own.
    pub async fn material_batch(&self, wanted: &[AttemptRef]) -> AppResult<Vec<AppResult<Material>>> {
        // One reply carries at most the budget's worth of payloads, counted
        // in request order over the items that will be sent: the first such
        // item always fits (an event is far smaller than the budget), the
        // rest past the budget are answered `deferred`, for the next call.
        // So a batch of large events never makes a reply the seam refuses,
        // and never fails the other items it shares a call with.
        let rows = sqlx::query_as::<_, MaterialRow>(
            "WITH asked AS (
               SELECT w.ord, d.id, d.environment_id, d.endpoint_id, d.event_id, d.attempt, d.generation, d.state,
                      e.url, e.enabled, e.deleted_at IS NOT NULL AS deleted,
                      e.secret_key_id, e.secret_ciphertext, e.previous_secret_key_id, e.previous_secret_ciphertext,
                      e.secret_rotated_at, v.envelope,
                      d.state = 'pending' AND d.attempt = w.attempt AND d.generation = w.generation
                        AND e.enabled AND e.deleted_at IS NULL AS servable
               FROM UNNEST($1::uuid[], $2::int[], $3::int[]) WITH ORDINALITY AS w(id, attempt, generation, ord)
               JOIN webhook_deliveries d ON d.id = w.id
               JOIN webhook_endpoints e ON e.id = d.endpoint_id
               JOIN events v ON v.environment_id = d.environment_id AND v.id = d.event_id),
             sized AS (
               SELECT *, octet_length(envelope) AS size,
                      sum(CASE WHEN servable THEN octet_length(envelope) ELSE 0 END) OVER (ORDER BY ord) AS upto
               FROM asked)
             SELECT ord, servable, id, environment_id, endpoint_id, event_id, attempt, generation, state, url, enabled, deleted,
                    secret_key_id, secret_ciphertext, previous_secret_key_id, previous_secret_ciphertext, secret_rotated_at,
                    CASE WHEN servable AND (upto = size OR upto <= $4) THEN envelope END AS envelope
             FROM sized",
        )
        .bind(wanted.iter().map(|w| w.delivery_id).collect::<Vec<_>>())
        .bind(wanted.iter().map(|w| i32::try_from(w.attempt).unwrap_or(i32::MAX)).collect::<Vec<_>>())
        .bind(wanted.iter().map(|w| i32::try_from(w.generation).unwrap_or(i32::MAX)).collect::<Vec<_>>())
        .bind(relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64)
        .fetch_all(&self.db)
        .await?;
        let by_ord: HashMap<i64, MaterialRow> = rows.into_iter().map(|r| (r.ord, r)).collect();
        let claimed = self.claim_attempts(wanted, &by_ord).await?;
        // Secrets are decrypted once per endpoint per batch, not per attempt.
        let mut secrets_of: HashMap<Uuid, Vec<SigningSecret>> = HashMap::new();
        let now = Utc::now();
        let mut out = Vec::with_capacity(wanted.len());
        let mut switched_off: Vec<(Uuid, &'static str)> = Vec::new();
        for (ord, w) in (1..).zip(wanted) {
            let row = match by_ord.get(&ord) {
                Some(r) => r,
                None => {
                    out.push(Err(AppError::not_found("delivery")));
                    continue;
                }
            };
            if row.servable && row.envelope.is_none() {
                out.push(Err(AppError::new(
                    ErrorCode::Unavailable,
                    relay_contracts::reasons::DEFERRED,
                    "this reply's payload budget is spent; ask for this attempt again",
                )));
                continue;
            }
            if row.servable && w.claim.is_some() && !claimed.contains(&row.id) {
                out.push(Err(AppError::new(
                    ErrorCode::Unavailable,
                    relay_contracts::reasons::IN_HAND_ELSEWHERE,
                    format!("another dispatcher holds attempt {attempt} of delivery {}; ask again later", row.id, attempt = w.attempt),
                )));
                continue;
            }
            if row.state == "pending" && (!row.enabled || row.deleted) {
                switched_off.push((row.id, if row.deleted { "endpoint_deleted" } else { "endpoint_disabled" }));
            }
            out.push(self.material_from(row, w, now, &mut secrets_of));
        }
        // Disabling or deleting an endpoint ends its pending deliveries in the
        // same transaction, and expansion cannot write new ones behind it, so
        // none should get here; if one ever does, it ends now rather than
        // waiting on a lease for an attempt that will never be made.
        for reason in ["endpoint_disabled", "endpoint_deleted"] {
            let ids: Vec<Uuid> = switched_off.iter().filter(|(_, r)| *r == reason).map(|(id, _)| *id).collect();
            if !ids.is_empty() {
                let ended = end_deliveries_by_id(&self.db, &ids, reason).await?;
                tracing::warn!(ended, reason, "pending deliveries of an inactive endpoint found at material time; dead-lettered");
            }
        }
        Ok(out)
    }

    /// Claims the attempts of a material batch that will be answered (the
    /// read just found them current), for their claimants: one statement,
    /// taking only attempts nobody else holds (or whose holder's claim ran
    /// out). A claim outlives its attempt's outcome on purpose: a second copy
    /// of the job asking before it runs out is refused, and asking after
    /// finds the attempt no longer current. Returns the deliveries claimed.
    async fn claim_attempts(&self, wanted: &[AttemptRef], rows: &HashMap<i64, MaterialRow>) -> AppResult<HashSet<Uuid>> {
        let mut seen: HashSet<Uuid> = HashSet::new();
        let asked: Vec<(&AttemptRef, Claim)> = (1..)
            .zip(wanted)
            .filter_map(|(ord, w)| {
                let row = rows.get(&ord)?;
                let claim = w.claim?;
                (row.servable && row.envelope.is_some() && seen.insert(w.delivery_id)).then_some((w, claim))
            })
            .collect();
        if asked.is_empty() {
            return Ok(HashSet::new());
        }
        Ok(sqlx::query_scalar(
            // A claim for an earlier attempt or generation of the delivery is
            // replaced; one for this attempt only by its own claimant, or once
            // it has run out.
            "INSERT INTO attempt_claims AS c (delivery_id, attempt, generation, claimant, until)
             SELECT u.id, u.attempt, u.generation, u.claimant, now() + u.hold_ms * interval '1 millisecond'
             FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::uuid[], $5::bigint[]) AS u(id, attempt, generation, claimant, hold_ms)
             ON CONFLICT (delivery_id) DO UPDATE
               SET attempt = excluded.attempt, generation = excluded.generation, claimant = excluded.claimant, until = excluded.until
               WHERE c.claimant = excluded.claimant OR c.until < now()
                  OR (c.generation, c.attempt) <> (excluded.generation, excluded.attempt)
             RETURNING delivery_id",
        )
        .bind(asked.iter().map(|(w, _)| w.delivery_id).collect::<Vec<_>>())
        .bind(asked.iter().map(|(w, _)| w.attempt as i32).collect::<Vec<_>>())
        .bind(asked.iter().map(|(w, _)| w.generation as i32).collect::<Vec<_>>())
        .bind(asked.iter().map(|(_, c)| c.claimant).collect::<Vec<_>>())
        .bind(asked.iter().map(|(_, c)| c.hold.as_millis() as i64).collect::<Vec<_>>())
        .fetch_all(&self.db)
        .await?
        .into_iter()
        .collect())
    }

    fn material_from(
        &self,
        row: &MaterialRow,
        w: &AttemptRef,
        now: Timestamp,
        secrets_of: &mut HashMap<Uuid, Vec<SigningSecret>>,
    ) -> AppResult<Material> {
        let AttemptRef { delivery_id, generation, attempt, .. } = *w;
        if row.state != "pending" || row.attempt as u32 != attempt || row.generation as u32 != generation {
            return Err(AppError::precondition(
                "stale_attempt",
                format!(
                    "delivery {delivery_id} is {} at attempt {} (generation {}); attempt {attempt} (generation {generation}) is not current",
                    row.state, row.attempt, row.generation
                ),
            ));
        }
        if !row.enabled || row.deleted {
            return Err(AppError::precondition("endpoint_inactive", format!("endpoint {} is disabled or deleted", row.endpoint_id)));
        }
        let secrets = match secrets_of.get(&row.endpoint_id) {
            Some(s) => s.clone(),
            None => {
                let mut secrets =
                    vec![self.keyring.decrypt(&row.secret_key_id, &row.secret_ciphertext).context("decrypting a signing secret")?];
                if let (Some(key_id), Some(ct), Some(at)) =
                    (&row.previous_secret_key_id, &row.previous_secret_ciphertext, row.secret_rotated_at)
                {
                    let window = chrono::Duration::from_std(ROTATION_WINDOW).expect("24 h fits");
                    if now < at + window {
                        secrets.push(self.keyring.decrypt(key_id, ct).context("decrypting a previous signing secret")?);
                    }
                }
                secrets_of.insert(row.endpoint_id, secrets.clone());
                secrets
            }
        };
        Ok(Material {
            delivery_id,
            endpoint_id: row.endpoint_id,
            environment_id: row.environment_id,
            event_id: row.event_id,
            url: row.url.clone(),
            attempt,
            generation,
            secrets,
            payload: row.envelope.clone().context("a servable row carries its envelope")?,
        })
    }

    /// Records an attempt and decides what comes next, in one transaction.
    /// Idempotent on (delivery, generation, attempt): a repeat returns the
    /// first decision and changes nothing, so the schedule never advances
    /// twice for one attempt.
    pub async fn record_outcome(&self, report: AttemptReport) -> AppResult<Decision> {
        self.record_outcomes(vec![report]).await?.pop().expect("one answer per report")
    }

    /// Records many attempts in one transaction: the deliveries are locked
    /// (in id order, so concurrent batches cannot deadlock), every decision
    /// is made in memory, then each table gets one set-based write and the
    /// batch one commit. The idempotency of `record_outcome` holds per item,
    /// including for a report repeated inside the batch.
    pub async fn record_outcomes(&self, reports: Vec<AttemptReport>) -> AppResult<Vec<AppResult<Decision>>> {
        let mut tx = self.db.begin().await?;
        let now = Utc::now();
        // The common case in one statement: each delivery's first report in
        // the batch is taken to be for its current attempt, decided from the
        // report alone, and applied only where that holds (pending, same
        // generation and attempt). RETURNING says which did.
        let mut first_seen: HashSet<Uuid> = HashSet::new();
        let mut candidates: Vec<(usize, Decision)> = Vec::new();
        for (i, r) in reports.iter().enumerate() {
            if first_seen.insert(r.delivery_id) {
                candidates.push((i, self.decide(r, now)?));
            }
        }
        // In id order, so two batches that share a delivery (a repeated
        // report) lock in the same order.
        candidates.sort_by_key(|&(i, _)| reports[i].delivery_id);
        let mut answers: Vec<Option<AppResult<Decision>>> = (0..reports.len()).map(|_| None).collect();
        let mut log = AttemptRows::default();
        let mut dead = DeadLetterRows::default();
        let errors: Vec<Option<String>> = reports.iter().map(|r| report_error(&r.error)).collect();
        let applied: Vec<(Uuid, Uuid, Uuid, Uuid)> = sqlx::query_as(
            "UPDATE webhook_deliveries d SET state = u.state, attempt = u.next_attempt, next_attempt_at = coalesce(u.next_attempt_at, d.next_attempt_at),
               dispatched_at = NULL, last_status = u.status, last_error = u.error, updated_at = now()
             FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::text[], $5::int[], $6::timestamptz[], $7::int[], $8::text[])
               AS u(id, generation, attempt, state, next_attempt, next_attempt_at, status, error)
             WHERE d.id = u.id AND d.state = 'pending' AND d.generation = u.generation AND d.attempt = u.attempt
             RETURNING d.id, d.environment_id, d.endpoint_id, d.event_id",
        )
        .bind(candidates.iter().map(|&(i, _)| reports[i].delivery_id).collect::<Vec<_>>())
        .bind(candidates.iter().map(|&(i, _)| reports[i].generation as i32).collect::<Vec<_>>())
        .bind(candidates.iter().map(|&(i, _)| reports[i].attempt as i32).collect::<Vec<_>>())
        .bind(candidates.iter().map(|(_, d)| d.new_state()).collect::<Vec<_>>())
        .bind(candidates.iter().map(|&(i, d)| reports[i].attempt as i32 + i32::from(matches!(d, Decision::Rescheduled { .. }))).collect::<Vec<_>>())
        .bind(candidates.iter().map(|(_, d)| d.next_attempt_at()).collect::<Vec<_>>())
        .bind(candidates.iter().map(|&(i, _)| reports[i].http_status.map(|s| s as i32)).collect::<Vec<_>>())
        .bind(candidates.iter().map(|&(i, d)| if d == Decision::Delivered { None } else { errors[i].clone() }).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;
        let candidate_of: HashMap<Uuid, (usize, Decision)> = candidates.iter().map(|&(i, d)| (reports[i].delivery_id, (i, d))).collect();
        for (id, environment_id, endpoint_id, event_id) in applied {
            let Some(&(i, decision)) = candidate_of.get(&id) else { continue };
            let r = &reports[i];
            let status = r.http_status.map(|s| s as i32);
            if decision == Decision::DeadLettered {
                dead.push_parts(id, environment_id, endpoint_id, event_id, r.attempt as i32, status, errors[i].clone());
            }
            let mut body = r.response_body.clone();
            body.truncate(MAX_RESPONSE_BODY);
            log.push(&id, r.generation, r.attempt, environment_id, status, errors[i].clone(), r.latency_ms, body, decision);
            answers[i] = Some(Ok(decision));
        }
        self.write_outcome_rows(&mut tx, &dead, &log).await?;
        let mut decisions: Vec<(&'static str, i64)> = log.decision.iter().copied().zip(log.latency_ms.iter().copied()).collect();

        // Everything else — repeats, stragglers from before a replay, unknown
        // deliveries — the careful way, rows locked.
        let rest: Vec<usize> = (0..reports.len()).filter(|&i| answers[i].is_none()).collect();
        if !rest.is_empty() {
            let (slow, slow_decisions) =
                self.record_outcomes_locked(&mut tx, rest.iter().map(|&i| reports[i].clone()).collect(), now).await?;
            for (i, a) in rest.into_iter().zip(slow) {
                answers[i] = Some(a);
            }
            decisions.extend(slow_decisions);
        }
        tx.commit().await.context("committing outcomes")?;
        for (decision, latency_ms) in &decisions {
            self.metrics.attempts.with_label_values(&[decision]).inc();
            self.metrics.attempt_latency.with_label_values(&[decision]).observe(*latency_ms as f64 / 1000.0);
        }
        // Every outcome frees the endpoint's slot (the relay caps what an
        // endpoint has outstanding), and a reschedule may be due sooner than
        // the relay's current sleep: wake it either way.
        if !decisions.is_empty() {
            self.deliveries_wake.wake();
        }
        Ok(answers.into_iter().map(|a| a.expect("every report answered")).collect())
    }

    /// What an attempt's result means, were it the delivery's current one.
    fn decide(&self, report: &AttemptReport, now: Timestamp) -> AppResult<Decision> {
        if matches!(report.http_status, Some(200..=299)) {
            return Ok(Decision::Delivered);
        }
        Ok(match self.schedule.delay_before(report.attempt + 1) {
            // Truncated to Postgres's microseconds, so a repeated report
            // answers with exactly the instant the first one did.
            Some(delay) => Decision::Rescheduled {
                next_attempt_at: (now + chrono::Duration::from_std(delay).context("tier fits a chrono duration")?).trunc_subsecs(6),
            },
            None => Decision::DeadLettered,
        })
    }

    /// The dead letters and attempt-log rows of an outcome batch, one insert each.
    async fn write_outcome_rows(&self, tx: &mut sqlx::PgConnection, dead: &DeadLetterRows, log: &AttemptRows) -> AppResult<()> {
        if !dead.id.is_empty() {
            sqlx::query(
                "INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error)
                 SELECT * FROM UNNEST($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::uuid[], $6::int[], $7::int[], $8::text[])",
            )
            .bind(&dead.id)
            .bind(&dead.environment_id)
            .bind(&dead.delivery_id)
            .bind(&dead.endpoint_id)
            .bind(&dead.event_id)
            .bind(&dead.attempts)
            .bind(&dead.last_status)
            .bind(&dead.last_error)
            .execute(&mut *tx)
            .await?;
        }
        if !log.delivery_id.is_empty() {
            sqlx::query(
                "INSERT INTO delivery_attempts
                   (delivery_id, generation, attempt, environment_id, http_status, error, latency_ms, response_body, decision, next_attempt_at)
                 SELECT * FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::uuid[], $5::int[], $6::text[], $7::bigint[], $8::bytea[],
                                      $9::text[], $10::timestamptz[])",
            )
            .bind(&log.delivery_id)
            .bind(&log.generation)
            .bind(&log.attempt)
            .bind(&log.environment_id)
            .bind(&log.http_status)
            .bind(&log.error)
            .bind(&log.latency_ms)
            .bind(&log.response_body)
            .bind(&log.decision)
            .bind(&log.next_attempt_at)
            .execute(&mut *tx)
            .await?;
        }
        Ok(())
    }

    /// The careful path for reports the one-statement path did not apply:
    /// the deliveries locked in id order, repeats answered from the attempt
    /// log, stale reports with where the delivery stands. Returns the
    /// answers and, for metrics, the decisions it recorded.
    async fn record_outcomes_locked(
        &self,
        tx: &mut sqlx::PgConnection,
        reports: Vec<AttemptReport>,
        now: Timestamp,
    ) -> AppResult<(Vec<AppResult<Decision>>, Vec<(&'static str, i64)>)> {
        let ids: Vec<Uuid> = reports.iter().map(|r| r.delivery_id).collect();
        let rows = sqlx::query_as::<_, OutcomeRow>(
            "SELECT id, environment_id, endpoint_id, event_id, attempt, generation, state, next_attempt_at, last_status, last_error
             FROM webhook_deliveries WHERE id = ANY ($1) ORDER BY id FOR UPDATE",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        let mut current: HashMap<Uuid, OutcomeRow> = rows.into_iter().map(|r| (r.id, r)).collect();
        // A report for the delivery's current attempt cannot have been
        // recorded (recording moves the attempt on or ends the delivery), so
        // the attempt log is read only for the rare repeats and stragglers.
        let is_current = |r: &AttemptReport| {
            current
                .get(&r.delivery_id)
                .is_some_and(|row| row.state == "pending" && row.attempt as u32 == r.attempt && row.generation as u32 == r.generation)
        };
        let stragglers: Vec<Uuid> = reports.iter().filter(|r| !is_current(r)).map(|r| r.delivery_id).collect();
        let mut recorded: HashMap<(Uuid, u32, u32), Decision> = HashMap::new();
        if !stragglers.is_empty() {
            let wanted: HashSet<(Uuid, u32, u32)> = reports.iter().map(|r| (r.delivery_id, r.generation, r.attempt)).collect();
            let rows: Vec<(Uuid, i32, i32, String, Option<Timestamp>)> = sqlx::query_as(
                "SELECT delivery_id, generation, attempt, decision, next_attempt_at FROM delivery_attempts WHERE delivery_id = ANY ($1)",
            )
            .bind(&stragglers)
            .fetch_all(&mut *tx)
            .await?;
            for (id, g, a, decision, next) in rows {
                let key = (id, g as u32, a as u32);
                if wanted.contains(&key) {
                    let d = match (decision.as_str(), next) {
                        ("delivered", _) => Decision::Delivered,
                        ("rescheduled", Some(next_attempt_at)) => Decision::Rescheduled { next_attempt_at },
                        _ => Decision::DeadLettered,
                    };
                    recorded.insert(key, d);
                }
            }
        }
        // Deliveries ended because their endpoint was disabled or deleted
        // while an attempt was on the wire: that attempt's result still
        // counts (a 2xx means the receiver has the event).
        let switched_off: HashSet<Uuid> = if stragglers.is_empty() {
            HashSet::new()
        } else {
            sqlx::query_scalar(
                "SELECT l.delivery_id FROM webhook_dead_letters l JOIN webhook_deliveries d ON d.id = l.delivery_id
                 WHERE l.delivery_id = ANY ($1) AND l.reason IN ('endpoint_disabled', 'endpoint_deleted')
                   AND d.state = 'dead' AND l.attempts = d.attempt - 1",
            )
            .bind(&stragglers)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect()
        };
        let mut revived: Vec<Uuid> = Vec::new();
        let mut late_failures = DeadLetterRows::default();

        let mut out = Vec::with_capacity(reports.len());
        let mut touched: Vec<Uuid> = Vec::new();
        let mut dead = DeadLetterRows::default();
        let mut log = AttemptRows::default();
        for report in reports {
            let key = (report.delivery_id, report.generation, report.attempt);
            if let Some(d) = recorded.get(&key) {
                out.push(Ok(*d));
                continue;
            }
            let Some(row) = current.get_mut(&report.delivery_id) else {
                out.push(Err(AppError::not_found("delivery")));
                continue;
            };
            let same_attempt = row.attempt as u32 == report.attempt && row.generation as u32 == report.generation;
            let status = report.http_status.map(|s| s as i32);
            let error = report_error(&report.error);
            let decision = if row.state == "dead" && same_attempt && switched_off.contains(&row.id) {
                // The attempt in flight when the endpoint was switched off.
                if matches!(report.http_status, Some(200..=299)) {
                    row.state = "delivered".into();
                    row.last_error = None;
                    revived.push(row.id);
                    Decision::Delivered
                } else {
                    row.last_error = error.clone();
                    late_failures.push_parts(
                        row.id,
                        row.environment_id,
                        row.endpoint_id,
                        row.event_id,
                        report.attempt as i32,
                        status,
                        error.clone(),
                    );
                    Decision::DeadLettered
                }
            } else if row.state != "pending" || !same_attempt {
                // Not the current attempt and never recorded: a report from before
                // a replay, say. Answer with where the delivery stands; change nothing.
                out.push(Ok(match row.state.as_str() {
                    "delivered" => Decision::Delivered,
                    "dead" => Decision::DeadLettered,
                    _ => Decision::Rescheduled { next_attempt_at: row.next_attempt_at },
                }));
                continue;
            } else {
                let decision = self.decide(&report, now)?;
                match decision {
                    Decision::Delivered => {
                        row.state = "delivered".into();
                        row.last_error = None;
                    }
                    Decision::Rescheduled { next_attempt_at } => {
                        row.attempt += 1;
                        row.next_attempt_at = next_attempt_at;
                        row.last_error = error.clone();
                    }
                    Decision::DeadLettered => {
                        // The dead letter and the state change commit together: a
                        // dead delivery always has its record.
                        row.state = "dead".into();
                        row.last_error = error.clone();
                        dead.push(row, report.attempt as i32);
                    }
                }
                decision
            };
            row.last_status = status;
            if !touched.contains(&row.id) {
                touched.push(row.id);
            }
            let mut body = report.response_body;
            body.truncate(MAX_RESPONSE_BODY);
            log.push(
                &report.delivery_id,
                report.generation,
                report.attempt,
                row.environment_id,
                status,
                error,
                report.latency_ms,
                body,
                decision,
            );
            recorded.insert(key, decision);
            out.push(Ok(decision));
        }

        if !touched.is_empty() {
            let rows: Vec<&OutcomeRow> = touched.iter().map(|id| &current[id]).collect();
            sqlx::query(
                "UPDATE webhook_deliveries d SET state = u.state, attempt = u.attempt, next_attempt_at = u.next_attempt_at,
                   dispatched_at = NULL, last_status = u.last_status, last_error = u.last_error, updated_at = now()
                 FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::timestamptz[], $5::int[], $6::text[])
                   AS u(id, state, attempt, next_attempt_at, last_status, last_error)
                 WHERE d.id = u.id",
            )
            .bind(rows.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.state.clone()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.attempt).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.next_attempt_at).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.last_status).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.last_error.clone()).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        }
        if !revived.is_empty() {
            // Delivered after all: the provisional dead letter goes, so a
            // replay cannot send the receiver an event it already has.
            sqlx::query(
                "DELETE FROM webhook_dead_letters WHERE delivery_id = ANY ($1) AND reason IN ('endpoint_disabled', 'endpoint_deleted')",
            )
            .bind(&revived)
            .execute(&mut *tx)
            .await?;
        }
        if !late_failures.delivery_id.is_empty() {
            sqlx::query(
                "UPDATE webhook_dead_letters l SET attempts = u.attempts, last_status = u.last_status, last_error = u.last_error
                 FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::text[]) AS u(delivery_id, attempts, last_status, last_error)
                 WHERE l.delivery_id = u.delivery_id AND l.reason IN ('endpoint_disabled', 'endpoint_deleted')",
            )
            .bind(&late_failures.delivery_id)
            .bind(&late_failures.attempts)
            .bind(&late_failures.last_status)
            .bind(&late_failures.last_error)
            .execute(&mut *tx)
            .await?;
        }
        self.write_outcome_rows(&mut *tx, &dead, &log).await?;
        let decisions = log.decision.iter().copied().zip(log.latency_ms.iter().copied()).collect();
        Ok((out, decisions))
    }

    /// Puts a dead delivery back at attempt 1, due now, in a new generation.
    /// The dead-letter record stays: it is the evidence the attempts ran out.
    /// `tenant` scopes the lookup; the internal seam passes `None`.
    pub async fn replay_dead_letter(&self, tenant: Option<Tenant>, dead_letter_id: Uuid) -> AppResult<Uuid> {
        let mut tx = self.db.begin().await?;
        let (delivery_id, endpoint_id, active): (Uuid, Uuid, bool) = sqlx::query_as(
            "SELECT l.delivery_id, l.endpoint_id, e.enabled AND e.deleted_at IS NULL
             FROM webhook_dead_letters l JOIN webhook_endpoints e ON e.id = l.endpoint_id
             WHERE l.id = $1 AND ($2::uuid IS NULL OR l.environment_id = $2)",
        )
        .bind(dead_letter_id)
        .bind(tenant.map(|t| t.environment_id))
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| AppError::not_found("dead letter"))?;
        if !active {
            return Err(AppError::precondition(
                "endpoint_inactive",
                format!("endpoint {endpoint_id} is disabled or deleted; enable it before replaying its dead letters"),
            ));
        }
        let reset = sqlx::query(
            "UPDATE webhook_deliveries SET state = 'pending', attempt = 1, generation = generation + 1,
               next_attempt_at = now(), dispatched_at = NULL, updated_at = now()
             WHERE id = $1 AND state = 'dead'",
        )
        .bind(delivery_id)
        .execute(&mut *tx)
        .await?;
        if reset.rows_affected() == 0 {
            return Err(AppError::precondition(
                "already_replayed",
                format!("delivery {delivery_id} is no longer dead: it was already replayed"),
            ));
        }
        notify_due(&mut tx).await?;
        tx.commit().await.context("committing a replay")?;
        self.deliveries_wake.wake();
        Ok(delivery_id)
    }

    /// Deletes claims on attempts that ran out long ago: a claim matters
    /// only while it holds (see `claim_attempts`). Run with the pruning of
    /// dead letters.
    pub async fn prune_attempt_claims(&self) -> AppResult<u64> {
        Ok(sqlx::query("DELETE FROM attempt_claims WHERE until < now() - interval '10 minutes'").execute(&self.db).await?.rows_affected())
    }

    /// Deletes dead letters older than `retention`; run by the api on a timer.
    pub async fn prune_dead_letters(&self, retention: Duration) -> AppResult<u64> {
        Ok(sqlx::query("DELETE FROM webhook_dead_letters WHERE dead_lettered_at < now() - $1")
            .bind(retention)
            .execute(&self.db)
            .await?
            .rows_affected())
    }

    pub async fn list_dead_letters(&self, tenant: Tenant) -> AppResult<Vec<DeadLetter>> {
        Ok(sqlx::query_as::<_, DeadLetter>(
            "SELECT id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason, dead_lettered_at
             FROM webhook_dead_letters WHERE environment_id = $1 ORDER BY dead_lettered_at DESC, id DESC LIMIT 1000",
        )
        .bind(tenant.environment_id)
        .fetch_all(&self.db)
        .await?)
    }
}
