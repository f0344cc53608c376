//! Outcomes: an attempt's result recorded once, and the delivery moved on
//! as `state` decides, in one transaction per batch.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use uuid::Uuid;

use super::{
    App, Timestamp,
    deliveries::*,
    health::Seen,
    state::{self, Reported, Standing, Step},
};
use crate::{
    db,
    error::{AppError, AppResult},
};

/// The attempt log keeps this much of a response body.
pub const MAX_RESPONSE_BODY: usize = 4096;
const MAX_ERROR_LEN: usize = 2000;

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
        let now = self.clock.now();
        // The common case in one statement: each delivery's first report in
        // the batch is taken to be for its current attempt, decided from the
        // report alone, and applied only where that holds (pending, same
        // generation and attempt). RETURNING says which did.
        let mut first_seen: HashSet<Uuid> = HashSet::new();
        let mut candidates: Vec<(usize, Decision)> = Vec::new();
        for (i, r) in reports.iter().enumerate() {
            if first_seen.insert(r.delivery_id) {
                candidates.push((i, state::decide(&self.schedule, r.attempt, r.http_status, r.retry_after, now)));
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
        // What each recorded attempt says about its endpoint, in report order.
        let mut seen: Vec<(usize, Uuid, Seen)> = Vec::new();
        for (id, environment_id, endpoint_id, event_id) in applied {
            let Some(&(i, decision)) = candidate_of.get(&id) else { continue };
            let r = &reports[i];
            seen.push((i, endpoint_id, Seen::of(r.http_status)));
            let status = r.http_status.map(|s| s as i32);
            if decision == Decision::DeadLettered {
                dead.push(id, environment_id, endpoint_id, event_id, r.attempt as i32, status, errors[i].clone());
            }
            let mut body = r.response_body.clone();
            body.truncate(MAX_RESPONSE_BODY);
            log.push(id, r.generation, r.attempt, environment_id, status, errors[i].clone(), r.latency_ms, body, decision);
            answers[i] = Some(Ok(decision));
        }
        write_outcome_rows(&mut tx, &dead, &log, &self.dead_letters_counted).await?;
        let mut decisions: Vec<(&'static str, i64)> = log.decision.iter().copied().zip(log.latency_ms.iter().copied()).collect();

        // Everything else — repeats, stragglers from before a replay, unknown
        // deliveries — the careful way, rows locked.
        let rest: Vec<usize> = (0..reports.len()).filter(|&i| answers[i].is_none()).collect();
        if !rest.is_empty() {
            let (slow, slow_decisions, slow_seen) =
                self.record_outcomes_locked(&mut tx, rest.iter().map(|&i| reports[i].clone()).collect(), now).await?;
            seen.extend(slow_seen.into_iter().map(|(k, endpoint, s)| (rest[k], endpoint, s)));
            for (i, a) in rest.into_iter().zip(slow) {
                answers[i] = Some(a);
            }
            decisions.extend(slow_decisions);
        }
        // The endpoints' health, after their deliveries: an outcome batch
        // locks deliveries before health rows (see `db::health`).
        seen.sort_by_key(|(i, _, _)| *i);
        let seen: Vec<(Uuid, Seen)> = seen.into_iter().map(|(_, endpoint, s)| (endpoint, s)).collect();
        self.observe_results(&mut tx, &seen, now).await?;
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
    ) -> AppResult<(Vec<AppResult<Decision>>, Vec<(&'static str, i64)>, Vec<(usize, Uuid, Seen)>)> {
        let ids: Vec<Uuid> = reports.iter().map(|r| r.delivery_id).collect();
        let rows = db::deliveries::lock_for_outcome(&mut *tx, &ids).await?;
        let mut current: HashMap<Uuid, db::deliveries::OutcomeRow> = rows.into_iter().map(|r| (r.id, r)).collect();
        // A report for the delivery's current attempt cannot have been
        // recorded (recording moves the attempt on or ends the delivery), so
        // the attempt log is read only for the rare repeats and stragglers.
        let stragglers: Vec<Uuid> = reports
            .iter()
            .filter(|r| !current.get(&r.delivery_id).is_some_and(|row| standing(row, false).awaits(&reported(r))))
            .map(|r| r.delivery_id)
            .collect();
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
        let mut seen = Vec::new();
        let mut touched: Vec<Uuid> = Vec::new();
        let mut dead = db::dead_letters::DeadLetterRows::default();
        let mut log = db::attempts::AttemptRows::default();
        for (k, report) in reports.into_iter().enumerate() {
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
            let standing = standing(row, switched_off.contains(&row.id));
            let step = standing.step(&reported(&report), None, || {
                state::decide(&self.schedule, report.attempt, report.http_status, report.retry_after, now)
            });
            let decision = match step {
                Step::Answer(d) => {
                    out.push(Ok(d));
                    continue;
                }
                Step::Advance(d) | Step::Settle(d) => d,
            };
            seen.push((k, row.endpoint_id, Seen::of(report.http_status)));
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
        write_outcome_rows(&mut *tx, &dead, &log, &self.dead_letters_counted).await?;
        let decisions = log.decision.iter().copied().zip(log.latency_ms.iter().copied()).collect();
        Ok((out, decisions, seen))
    }
}

/// The dead letters and attempt-log rows of an outcome batch, one insert each.
async fn write_outcome_rows(
    tx: &mut sqlx::PgConnection,
    dead: &db::dead_letters::DeadLetterRows,
    log: &db::attempts::AttemptRows,
    counted: &super::operational::DeadLetterHint,
) -> AppResult<()> {
    db::dead_letters::insert_exhausted(&mut *tx, dead).await?;
    // Counted for the tenant's operations endpoint, announced in a batch.
    if !dead.id.is_empty() {
        db::events::count_dead_letter_notices(&mut *tx, &dead.endpoint_id, &dead.environment_id).await?;
        counted.counted();
    }
    db::attempts::insert(&mut *tx, log).await
}

/// A locked delivery as the state machine reads it.
fn standing(row: &db::deliveries::OutcomeRow, switched_off_in_flight: bool) -> Standing {
    Standing {
        state: row.state,
        generation: row.generation as u32,
        attempt: row.attempt as u32,
        next_attempt_at: row.next_attempt_at,
        switched_off_in_flight,
    }
}

fn reported(r: &AttemptReport) -> Reported {
    Reported { generation: r.generation, attempt: r.attempt, http_status: r.http_status }
}
