//! The delivery state machine: expand, material, outcome, replay, and the
//! dead-letter store. Every transition is one transaction.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use anyhow::Context;
use chrono::Utc;
use relay_signing::SigningSecret;
use uuid::Uuid;

pub use super::state::Decision;
use super::{
    App, Tenant, Timestamp,
    state::{self, DeliveryState, Reported, Standing, Step},
};
pub use crate::db::dead_letters::DeadLetter;
use crate::{
    db,
    error::{AppError, AppResult, ErrorCode},
};

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

/// One event to expand. `trace_context` is the traceparent its deliveries
/// carry, so their attempts continue the event's trace.
#[derive(Debug, Clone)]
pub struct ExpandItem {
    pub event_id: Uuid,
    pub environment_id: Uuid,
    pub event_type: String,
    pub trace_context: Option<String>,
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
        let stored = db::events::types_of(&mut tx, &envs, &ids).await?;

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
            db::events::mark_consumed(&mut tx, EXPAND_CONSUMER, &envs, &ids).await?
        };
        // Subscription filtering happens here, not at send time: a row that
        // exists is a row that will be sent. Every attempt of a delivery
        // continues its event's expansion trace. With direct dispatch, rows
        // within their endpoint's in-flight cap are written already leased
        // and handed to the broker after the commit; the rest wait, due, for
        // the relay.
        let mut created: HashMap<(Uuid, Uuid), u32> = HashMap::new();
        let mut leased: Vec<db::deliveries::CreatedRow> = Vec::new();
        let mut waiting = false;
        let fresh: Vec<usize> =
            claimants.iter().copied().filter(|&i| claimed.contains(&(items[i].environment_id, items[i].event_id))).collect();
        if !fresh.is_empty() {
            let cap = self.direct.as_ref().map_or(0, |d| d.endpoint_cap);
            let events = db::deliveries::ToExpand {
                environment_id: fresh.iter().map(|&i| items[i].environment_id).collect(),
                event_id: fresh.iter().map(|&i| items[i].event_id).collect(),
                event_type: fresh.iter().map(|&i| items[i].event_type.clone()).collect(),
                trace_context: fresh.iter().map(|&i| items[i].trace_context.clone()).collect(),
            };
            // Subscribers are share-locked by the insert: a disable or delete
            // of one waits for this expansion to commit (and then ends the
            // rows it wrote), or this expansion waits for it and reads the
            // endpoint as disabled. No pending delivery of an inactive
            // endpoint is ever committed.
            let rows = db::deliveries::create_for_subscribers(&mut tx, &events, cap, DIRECT_PUBLISH_LEASE).await?;
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
            db::deliveries::notify_due(&mut tx).await?;
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
    async fn dispatch_leased(&self, rows: &[db::deliveries::CreatedRow]) {
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
        let released = db::deliveries::release_unsent_first_attempts(&self.db, &unsent).await;
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
        let rows = db::deliveries::read_material(
            &self.db,
            &wanted.iter().map(|w| w.delivery_id).collect::<Vec<_>>(),
            &wanted.iter().map(|w| i32::try_from(w.attempt).unwrap_or(i32::MAX)).collect::<Vec<_>>(),
            &wanted.iter().map(|w| i32::try_from(w.generation).unwrap_or(i32::MAX)).collect::<Vec<_>>(),
            relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64,
        )
        .await?;
        let by_ord: HashMap<i64, db::deliveries::MaterialRow> = rows.into_iter().map(|r| (r.ord, r)).collect();
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
            if row.state == DeliveryState::Pending && (!row.enabled || row.deleted) {
                switched_off
                    .push((row.id, if row.deleted { db::dead_letters::ENDPOINT_DELETED } else { db::dead_letters::ENDPOINT_DISABLED }));
            }
            out.push(self.material_from(row, w, now, &mut secrets_of));
        }
        // Disabling or deleting an endpoint ends its pending deliveries in the
        // same transaction, and expansion cannot write new ones behind it, so
        // none should get here; if one ever does, it ends now rather than
        // waiting on a lease for an attempt that will never be made.
        for reason in [db::dead_letters::ENDPOINT_DISABLED, db::dead_letters::ENDPOINT_DELETED] {
            let ids: Vec<Uuid> = switched_off.iter().filter(|(_, r)| *r == reason).map(|(id, _)| *id).collect();
            if !ids.is_empty() {
                let ended = db::deliveries::end_pending_by_id(&self.db, &ids, reason).await?;
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
    async fn claim_attempts(&self, wanted: &[AttemptRef], rows: &HashMap<i64, db::deliveries::MaterialRow>) -> AppResult<HashSet<Uuid>> {
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
        let mut claims = db::deliveries::ClaimsAsked::default();
        for (w, c) in asked {
            claims.delivery_id.push(w.delivery_id);
            claims.attempt.push(w.attempt as i32);
            claims.generation.push(w.generation as i32);
            claims.claimant.push(c.claimant);
            claims.hold_ms.push(c.hold.as_millis() as i64);
        }
        db::deliveries::claim_attempts(&self.db, &claims).await
    }

    fn material_from(
        &self,
        row: &db::deliveries::MaterialRow,
        w: &AttemptRef,
        now: Timestamp,
        secrets_of: &mut HashMap<Uuid, Vec<SigningSecret>>,
    ) -> AppResult<Material> {
        let AttemptRef { delivery_id, generation, attempt, .. } = *w;
        if row.state != DeliveryState::Pending || row.attempt as u32 != attempt || row.generation as u32 != generation {
            return Err(AppError::precondition(
                "stale_attempt",
                format!(
                    "delivery {delivery_id} is {} at attempt {} (generation {}); attempt {attempt} (generation {generation}) is not current",
                    row.state.as_str(),
                    row.attempt,
                    row.generation
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
                candidates.push((i, state::decide(&self.schedule, r.attempt, r.http_status, now)));
            }
        }
        // In id order, so two batches that share a delivery (a repeated
        // report) lock in the same order.
        candidates.sort_by_key(|&(i, _)| reports[i].delivery_id);
        let mut answers: Vec<Option<AppResult<Decision>>> = (0..reports.len()).map(|_| None).collect();
        let mut log = db::attempts::AttemptRows::default();
        let mut dead = db::dead_letters::DeadLetterRows::default();
        let errors: Vec<Option<String>> = reports.iter().map(|r| report_error(&r.error)).collect();
        let current = db::deliveries::CurrentOutcomes {
            id: candidates.iter().map(|&(i, _)| reports[i].delivery_id).collect(),
            generation: candidates.iter().map(|&(i, _)| reports[i].generation as i32).collect(),
            attempt: candidates.iter().map(|&(i, _)| reports[i].attempt as i32).collect(),
            state: candidates.iter().map(|(_, d)| d.state()).collect(),
            next_attempt: candidates.iter().map(|&(i, d)| d.next_attempt(reports[i].attempt) as i32).collect(),
            next_attempt_at: candidates.iter().map(|(_, d)| d.next_attempt_at()).collect(),
            status: candidates.iter().map(|&(i, _)| reports[i].http_status.map(|s| s as i32)).collect(),
            error: candidates.iter().map(|&(i, d)| if d == Decision::Delivered { None } else { errors[i].clone() }).collect(),
        };
        let applied = db::deliveries::apply_current_outcomes(&mut tx, &current).await?;
        let candidate_of: HashMap<Uuid, (usize, Decision)> = candidates.iter().map(|&(i, d)| (reports[i].delivery_id, (i, d))).collect();
        for (id, environment_id, endpoint_id, event_id) in applied {
            let Some(&(i, decision)) = candidate_of.get(&id) else { continue };
            let r = &reports[i];
            let status = r.http_status.map(|s| s as i32);
            if decision == Decision::DeadLettered {
                dead.push(id, environment_id, endpoint_id, event_id, r.attempt as i32, status, errors[i].clone());
            }
            let mut body = r.response_body.clone();
            body.truncate(MAX_RESPONSE_BODY);
            log.push(id, r.generation, r.attempt, environment_id, status, errors[i].clone(), r.latency_ms, body, decision);
            answers[i] = Some(Ok(decision));
        }
        write_outcome_rows(&mut tx, &dead, &log).await?;
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
        let rows = db::deliveries::lock_for_outcome(&mut *tx, &ids).await?;
        let mut current: HashMap<Uuid, db::deliveries::OutcomeRow> = rows.into_iter().map(|r| (r.id, r)).collect();
        // A report for the delivery's current attempt cannot have been
        // recorded (recording moves the attempt on or ends the delivery), so
        // the attempt log is read only for the rare repeats and stragglers.
        let is_current = |r: &AttemptReport| {
            current.get(&r.delivery_id).is_some_and(|row| {
                row.state == DeliveryState::Pending && row.attempt as u32 == r.attempt && row.generation as u32 == r.generation
            })
        };
        let stragglers: Vec<Uuid> = reports.iter().filter(|r| !is_current(r)).map(|r| r.delivery_id).collect();
        let mut recorded: HashMap<(Uuid, u32, u32), Decision> = HashMap::new();
        if !stragglers.is_empty() {
            let wanted: HashSet<(Uuid, u32, u32)> = reports.iter().map(|r| (r.delivery_id, r.generation, r.attempt)).collect();
            recorded = db::attempts::recorded_decisions(&mut *tx, &stragglers).await?;
            recorded.retain(|key, _| wanted.contains(key));
        }
        // Deliveries ended because their endpoint was disabled or deleted
        // while an attempt was on the wire: that attempt's result still
        // counts (a 2xx means the receiver has the event).
        let switched_off: HashSet<Uuid> =
            if stragglers.is_empty() { HashSet::new() } else { db::dead_letters::switched_off_in_flight(&mut *tx, &stragglers).await? };
        let mut revived: Vec<Uuid> = Vec::new();
        let mut late_failures = db::dead_letters::DeadLetterRows::default();

        let mut out = Vec::with_capacity(reports.len());
        let mut touched: Vec<Uuid> = Vec::new();
        let mut dead = db::dead_letters::DeadLetterRows::default();
        let mut log = db::attempts::AttemptRows::default();
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
            let status = report.http_status.map(|s| s as i32);
            let error = report_error(&report.error);
            let standing = Standing {
                state: row.state,
                generation: row.generation as u32,
                attempt: row.attempt as u32,
                next_attempt_at: row.next_attempt_at,
                switched_off_in_flight: switched_off.contains(&row.id),
            };
            let reported = Reported { generation: report.generation, attempt: report.attempt, http_status: report.http_status };
            let step = standing.step(&reported, None, || state::decide(&self.schedule, report.attempt, report.http_status, now));
            let decision = match step {
                Step::Answer(d) => {
                    out.push(Ok(d));
                    continue;
                }
                Step::Advance(d) | Step::Settle(d) => d,
            };
            let moved = standing.after(step);
            row.state = moved.state;
            row.attempt = moved.attempt as i32;
            row.next_attempt_at = moved.next_attempt_at;
            row.last_error = if decision == Decision::Delivered { None } else { error.clone() };
            row.last_status = status;
            match (step, decision) {
                // The attempt in flight when the endpoint was switched off:
                // a 2xx means the receiver has the event after all.
                (Step::Settle(_), Decision::Delivered) => revived.push(row.id),
                (Step::Settle(_), _) => late_failures.push(
                    row.id,
                    row.environment_id,
                    row.endpoint_id,
                    row.event_id,
                    report.attempt as i32,
                    status,
                    error.clone(),
                ),
                // The dead letter and the state change commit together: a
                // dead delivery always has its record.
                (_, Decision::DeadLettered) => {
                    dead.push(row.id, row.environment_id, row.endpoint_id, row.event_id, report.attempt as i32, status, error.clone())
                }
                _ => {}
            }
            if !touched.contains(&row.id) {
                touched.push(row.id);
            }
            let mut body = report.response_body;
            body.truncate(MAX_RESPONSE_BODY);
            log.push(
                report.delivery_id,
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
            let rows: Vec<&db::deliveries::OutcomeRow> = touched.iter().map(|id| &current[id]).collect();
            db::deliveries::rewrite_after_outcome(&mut *tx, &rows).await?;
        }
        db::dead_letters::withdraw_switch_off(&mut *tx, &revived).await?;
        db::dead_letters::complete_switch_off(&mut *tx, &late_failures).await?;
        write_outcome_rows(&mut *tx, &dead, &log).await?;
        let decisions = log.decision.iter().copied().zip(log.latency_ms.iter().copied()).collect();
        Ok((out, decisions))
    }

    /// Puts a dead delivery back at attempt 1, due now, in a new generation.
    /// The dead-letter record stays: it is the evidence the attempts ran out.
    /// `tenant` scopes the lookup; the internal seam passes `None`.
    pub async fn replay_dead_letter(&self, tenant: Option<Tenant>, dead_letter_id: Uuid) -> AppResult<Uuid> {
        let mut tx = self.db.begin().await?;
        let (delivery_id, endpoint_id, active) =
            db::dead_letters::find_for_replay(&mut tx, dead_letter_id, tenant.map(|t| t.environment_id))
                .await?
                .ok_or_else(|| AppError::not_found("dead letter"))?;
        if !active {
            return Err(AppError::precondition(
                "endpoint_inactive",
                format!("endpoint {endpoint_id} is disabled or deleted; enable it before replaying its dead letters"),
            ));
        }
        if !db::deliveries::reset_for_replay(&mut tx, delivery_id).await? {
            return Err(AppError::precondition(
                "already_replayed",
                format!("delivery {delivery_id} is no longer dead: it was already replayed"),
            ));
        }
        db::deliveries::notify_due(&mut tx).await?;
        tx.commit().await.context("committing a replay")?;
        self.deliveries_wake.wake();
        Ok(delivery_id)
    }

    /// Deletes claims on attempts that ran out long ago: a claim matters
    /// only while it holds (see `claim_attempts`). Run with the pruning of
    /// dead letters.
    pub async fn prune_attempt_claims(&self) -> AppResult<u64> {
        db::deliveries::prune_attempt_claims(&self.db).await
    }

    /// Deletes dead letters older than `retention`; run by the api on a timer.
    pub async fn prune_dead_letters(&self, retention: Duration) -> AppResult<u64> {
        db::dead_letters::prune(&self.db, retention).await
    }

    pub async fn list_dead_letters(&self, tenant: Tenant) -> AppResult<Vec<DeadLetter>> {
        db::dead_letters::list(&self.db, tenant.environment_id).await
    }
}

/// The dead letters and attempt-log rows of an outcome batch, one insert each.
async fn write_outcome_rows(
    tx: &mut sqlx::PgConnection,
    dead: &db::dead_letters::DeadLetterRows,
    log: &db::attempts::AttemptRows,
) -> AppResult<()> {
    db::dead_letters::insert_exhausted(&mut *tx, dead).await?;
    db::attempts::insert(&mut *tx, log).await
}
