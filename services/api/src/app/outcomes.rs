//! Outcomes: an attempt's result recorded once, and the delivery moved on
//! as `relay_domain::delivery` decides, in one transaction per batch.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use relay_domain::{DeliveryId, EndpointId, EnvironmentId};
use relay_signing::Scheme;

use sqlx::{Connection, PgConnection};

use relay_domain::{
    delivery::{self as state, DeliveryStanding, DeliveryState, Reported, Step},
    health::Seen,
};

use super::{App, Timestamp, deliveries::*, lanes::EndedHead};
use crate::{
    db,
    error::{AppError, AppResult},
};

/// The attempt log keeps this much of a response body.
pub const MAX_RESPONSE_BODY: usize = relay_contracts::RESPONSE_BODY_KEPT_BYTES;
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
        let asked = OutcomeAsk { report, claim: None };
        Ok(self.record_outcomes(vec![asked]).await?.pop().expect("one answer per report")?.decision)
    }

    /// Records many attempts, through the outcome batcher (a connection of its
    /// own: reports from concurrent calls share its batches). Each report
    /// answers on its own, with the idempotency of `record_outcome`; a
    /// report that names its sender (`claim`) may come back with the next
    /// attempts of its endpoint, to take the slot it freed.
    pub async fn record_outcomes(&self, asks: Vec<OutcomeAsk>) -> AppResult<Vec<AppResult<Recorded>>> {
        Ok(self.batchers().outcomes.call_all(asks).await)
    }

    /// One batch of the outcome batcher. The common case is one statement:
    /// each delivery's first report in the batch is taken to be for its
    /// current attempt, decided from the report alone, applied only where
    /// that holds, logged, and its dead letter written (RETURNING says which
    /// applied, with their endpoints' health). A batch of successes on
    /// healthy endpoints is that statement alone, committed by itself. A
    /// batch with a failure runs in one transaction with what the failures
    /// do to their endpoints' circuits, so a circuit always counts the
    /// attempts that were recorded. Whatever the statement did not apply —
    /// a report repeated inside the batch or sent again, a straggler from
    /// before a replay, an unknown delivery — and a success that changes a
    /// circuit (a probe) follow in a transaction of their own.
    ///
    /// A lane follower's report (`AttemptReport::lane_follower`) may come
    /// in the same batch as its predecessor's, or before it: the batch is
    /// recorded in passes, each taking the reports whose delivery is no
    /// longer queued (its predecessor recorded by an earlier pass, and it
    /// promoted), so a run of a key's deliveries is recorded in one call.
    /// A follower still queued after the passes is answered
    /// `predecessor_unrecorded`, to be reported again.
    pub(crate) async fn record_outcome_batch(&self, conn: &mut PgConnection, asks: &[OutcomeAsk]) -> AppResult<Vec<AppResult<Recorded>>> {
        let (mut recorded, endpoints, promoted) = self.record_in_passes(&mut *conn, asks).await?;
        // The outcomes are recorded; a refill that fails leaves the waiting
        // rows to the relay.
        let handed_heads = match self.refill_freed_slots(conn, asks, &endpoints, &mut recorded).await {
            Ok(n) => n as u64,
            Err(e) => {
                tracing::warn!(error = ?e, "refilling freed slots failed; the relay hands the waiting deliveries out");
                self.deliveries_wake.wake();
                0
            }
        };
        // Lane heads promoted by these outcomes that the refill did not hand
        // back (no claim, no free slot) are this api's relay's to send. Not
        // woken when every report named its dispatcher (so the refill looked
        // at every endpoint a head was promoted on) and it handed back as
        // many lane heads: a relay pass then finds nothing this batch left,
        // and one woken for nothing would race the next batch's refill for
        // its heads (and win them for the broker's longer way: a DELIVERIES
        // message and a material call each).
        let refilled_everywhere = asks.iter().all(|a| a.claim.is_some());
        if promoted > 0 && (!refilled_everywhere || promoted > handed_heads) {
            self.deliveries_wake.wake();
        }
        Ok(recorded)
    }

    /// Records the reports of one batch (see `record_outcome_batch`): each
    /// one's answer, and the endpoint of each that recorded an attempt.
    pub(super) async fn record_reports(
        &self,
        conn: &mut PgConnection,
        reports: &[AttemptReport],
    ) -> AppResult<(Vec<AppResult<Decision>>, Vec<Option<EndpointId>>, u64)> {
        let now = self.clock.now();
        let mut first_seen: HashSet<DeliveryId> = HashSet::new();
        let mut candidates: Vec<(usize, Decision)> = Vec::new();
        for (i, r) in reports.iter().enumerate() {
            if first_seen.insert(r.delivery_id) {
                candidates.push((i, state::decide(&self.schedule, r.attempt, r.http_status, r.retry_after, now)));
            }
        }
        // In id order, so two batches that share a delivery (a repeated
        // report) lock in the same order.
        candidates.sort_by_key(|&(i, _)| reports[i].delivery_id);
        let errors: Vec<Option<String>> = reports.iter().map(|r| report_error(&r.error)).collect();
        let body = |r: &AttemptReport| {
            let mut body = r.response_body.clone();
            body.truncate(MAX_RESPONSE_BODY);
            body
        };
        let current = db::deliveries::CurrentOutcomes {
            id: candidates.iter().map(|&(i, _)| reports[i].delivery_id).collect(),
            generation: candidates.iter().map(|&(i, _)| reports[i].generation as i32).collect(),
            attempt: candidates.iter().map(|&(i, _)| reports[i].attempt as i32).collect(),
            state: candidates.iter().map(|(_, d)| d.state()).collect(),
            next_attempt: candidates.iter().map(|&(i, d)| d.next_attempt(reports[i].attempt) as i32).collect(),
            next_attempt_at: candidates.iter().map(|(_, d)| d.next_attempt_at()).collect(),
            status: candidates.iter().map(|&(i, _)| reports[i].http_status.map(|s| s as i32)).collect(),
            error: candidates.iter().map(|&(i, _)| errors[i].clone()).collect(),
            latency_ms: candidates.iter().map(|&(i, _)| i64::try_from(reports[i].latency_ms).unwrap_or(i64::MAX)).collect(),
            response_body: candidates.iter().map(|&(i, _)| body(&reports[i])).collect(),
            decision: candidates.iter().map(|(_, d)| d.as_str()).collect(),
            signature_scheme: candidates.iter().map(|&(i, _)| reports[i].signature_scheme.map(Scheme::as_str)).collect(),
        };
        let all_succeeded = reports.iter().all(|r| seen_in(r).is_success());
        let mut batch = OutcomeBatch::new(reports, &candidates);
        if all_succeeded {
            let applied = db::deliveries::record_current_outcomes(&mut *conn, &current).await?;
            let plainly_healthy = applied.iter().all(|a| plainly_healthy(a, now, &self.health.circuit));
            let stamp = stale_success_stamps(&applied, now);
            batch.applied(&applied);
            if plainly_healthy && batch.rest().is_empty() {
                if !stamp.is_empty() {
                    db::health::touch_success(&mut *conn, &stamp, now).await?;
                }
            } else {
                let mut tx = conn.begin().await?;
                self.follow_up(&mut tx, reports, &mut batch, now).await?;
                tx.commit().await.context("committing outcomes")?;
            }
        } else {
            let mut tx = conn.begin().await?;
            let applied = db::deliveries::record_current_outcomes(&mut tx, &current).await?;
            batch.applied(&applied);
            let dead: Vec<&db::deliveries::AppliedOutcome> =
                applied.iter().filter(|a| batch.decision_of(a.id) == Some(Decision::DeadLettered)).collect();
            if !dead.is_empty() {
                // Counted for the tenant's operations endpoint, announced in a batch.
                let (endpoints, environments): (Vec<EndpointId>, Vec<EnvironmentId>) =
                    dead.iter().map(|a| (a.endpoint_id, a.environment_id)).unzip();
                db::dead_letters::count_dead_letter_notices(&mut tx, &endpoints, &environments).await?;
                self.dead_letters_counted.counted();
            }
            self.follow_up(&mut tx, reports, &mut batch, now).await?;
            tx.commit().await.context("committing outcomes")?;
        }
        // Committed: the lanes whose head ended send their next, handed
        // back with these outcomes by the refill where it can.
        let promoted = if batch.ended_lanes.is_empty() {
            0
        } else {
            self.settle_ended_lanes(&mut *conn, std::mem::take(&mut batch.ended_lanes)).await
        };
        // Committed: the charts count what the log now holds.
        self.attempt_stats.add(now, batch.seen.iter().map(|&(i, endpoint, seen)| (endpoint, seen == Seen::Success, reports[i].latency_ms)));
        for (decision, latency_ms) in &batch.decisions {
            self.metrics.attempts.with_label_values(&[decision]).inc();
            self.metrics.attempt_latency.with_label_values(&[decision]).observe(*latency_ms as f64 / 1000.0);
        }
        // A reschedule may be due sooner than the relay's current sleep (a
        // freed slot is the refill's business). Otherwise it sleeps on:
        // most outcomes need nothing of it.
        if batch.decisions.iter().any(|&(d, _)| d == Decision::RESCHEDULED) {
            self.deliveries_wake.wake();
        }
        let mut endpoints = vec![None; reports.len()];
        for &(i, endpoint, _) in &batch.seen {
            endpoints[i] = Some(endpoint);
        }
        Ok((batch.answers.into_iter().map(|a| a.expect("every report answered")).collect(), endpoints, promoted))
    }

    /// What follows the one statement, in the caller's transaction: the
    /// careful path for the reports it did not apply, then what every
    /// recorded result does to its endpoint's health (an outcome batch locks
    /// deliveries before health rows, see `db::health`).
    async fn follow_up(&self, tx: &mut PgConnection, reports: &[AttemptReport], batch: &mut OutcomeBatch, now: Timestamp) -> AppResult<()> {
        let rest = batch.rest();
        if !rest.is_empty() {
            let (slow, slow_decisions, slow_seen) = self
                .record_outcomes_locked(&mut *tx, rest.iter().map(|&i| reports[i].clone()).collect(), now, &mut batch.ended_lanes)
                .await?;
            batch.seen.extend(slow_seen.into_iter().map(|(k, endpoint, s)| (rest[k], endpoint, s)));
            for (i, a) in rest.into_iter().zip(slow) {
                batch.answers[i] = Some(a);
            }
            batch.decisions.extend(slow_decisions);
        }
        batch.seen.sort_by_key(|(i, _, _)| *i);
        let seen: Vec<(EndpointId, Seen)> = batch.seen.iter().map(|&(_, endpoint, s)| (endpoint, s)).collect();
        self.observe_results(&mut *tx, &seen, now).await
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
        ended_lanes: &mut Vec<EndedHead>,
    ) -> AppResult<(Vec<AppResult<Decision>>, Vec<(&'static str, i64)>, Vec<(usize, EndpointId, Seen)>)> {
        let ids: Vec<DeliveryId> = reports.iter().map(|r| r.delivery_id).collect();
        let rows = db::deliveries::lock_for_outcome(&mut *tx, &ids).await?;
        let mut current: HashMap<DeliveryId, db::deliveries::OutcomeRow> = rows.into_iter().map(|r| (r.id, r)).collect();
        // A report for the delivery's current attempt cannot have been
        // recorded (recording moves the attempt on or ends the delivery), so
        // the attempt log is read only for the rare repeats and stragglers.
        let stragglers: Vec<DeliveryId> = reports
            .iter()
            .filter(|r| !current.get(&r.delivery_id).is_some_and(|row| standing(row, false).awaits(&reported(r))))
            .map(|r| r.delivery_id)
            .collect();
        let mut recorded: HashMap<(DeliveryId, u32, u32), Decision> = HashMap::new();
        if !stragglers.is_empty() {
            let wanted: HashSet<(DeliveryId, u32, u32)> = reports.iter().map(|r| (r.delivery_id, r.generation, r.attempt)).collect();
            recorded = db::attempts::recorded_decisions(&mut *tx, &stragglers).await?;
            recorded.retain(|key, _| wanted.contains(key));
        }
        // Deliveries ended because their endpoint was disabled or deleted
        // while an attempt was on the wire: that attempt's result still
        // counts (a 2xx means the receiver has the event).
        let switched_off: HashSet<DeliveryId> =
            if stragglers.is_empty() { HashSet::new() } else { db::dead_letters::switched_off_in_flight(&mut *tx, &stragglers).await? };
        let mut revived: Vec<DeliveryId> = Vec::new();
        let mut late_failures = db::dead_letters::DeadLetterRows::default();

        let mut out = Vec::with_capacity(reports.len());
        let mut seen = Vec::new();
        let mut touched: Vec<DeliveryId> = Vec::new();
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
            seen.push((k, row.endpoint_id, seen_in(&report)));
            let moved = standing.after(step);
            row.state = moved.state;
            row.attempt = moved.attempt as i32;
            row.next_attempt_at = moved.next_attempt_at;
            row.last_error = if decision == Decision::Delivered { None } else { error.clone() };
            row.last_status = status;
            if let Some(key) = row.ordering_key.as_ref().filter(|_| matches!(row.state, DeliveryState::Delivered | DeliveryState::Dead)) {
                ended_lanes.push((row.endpoint_id, key.clone(), row.ordering_position));
            }
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
                report.signature_scheme,
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
        db::dead_letters::count_dead_letter_notices(&mut *tx, &dead.endpoint_id, &dead.environment_id).await?;
        counted.counted();
    }
    db::attempts::insert(&mut *tx, log).await
}

/// An outcome batch as it is answered: each report's answer, what each
/// recorded result says about its endpoint (by report position), and the
/// decisions recorded (for metrics).
struct OutcomeBatch {
    answers: Vec<Option<AppResult<Decision>>>,
    seen: Vec<(usize, EndpointId, Seen)>,
    decisions: Vec<(&'static str, i64)>,
    /// Each candidate's report position and decision, by delivery.
    candidate_of: HashMap<DeliveryId, (usize, Decision)>,
    seen_of: Vec<Seen>,
    latency_of: Vec<i64>,
    /// The lanes whose head this batch ended (delivered or dead): each
    /// promotes its next once the batch has committed.
    ended_lanes: Vec<EndedHead>,
}

impl OutcomeBatch {
    fn new(reports: &[AttemptReport], candidates: &[(usize, Decision)]) -> Self {
        Self {
            answers: (0..reports.len()).map(|_| None).collect(),
            seen: Vec::new(),
            decisions: Vec::new(),
            candidate_of: candidates.iter().map(|&(i, d)| (reports[i].delivery_id, (i, d))).collect(),
            seen_of: reports.iter().map(seen_in).collect(),
            latency_of: reports.iter().map(|r| i64::try_from(r.latency_ms).unwrap_or(i64::MAX)).collect(),
            ended_lanes: Vec::new(),
        }
    }

    fn decision_of(&self, delivery: DeliveryId) -> Option<Decision> {
        self.candidate_of.get(&delivery).map(|&(_, d)| d)
    }

    /// The one statement applied these.
    fn applied(&mut self, applied: &[db::deliveries::AppliedOutcome]) {
        for a in applied {
            let Some(&(i, decision)) = self.candidate_of.get(&a.id) else { continue };
            self.seen.push((i, a.endpoint_id, self.seen_of[i]));
            self.decisions.push((decision.as_str(), self.latency_of[i]));
            self.answers[i] = Some(Ok(decision));
            if let Some(key) = a.ordering_key.as_ref().filter(|_| decision.state() != DeliveryState::Pending) {
                self.ended_lanes.push((a.endpoint_id, key.clone(), a.ordering_position));
            }
        }
    }

    /// The reports still unanswered, by position.
    fn rest(&self) -> Vec<usize> {
        (0..self.answers.len()).filter(|&i| self.answers[i].is_none()).collect()
    }
}

/// An endpoint whose successes change nothing the health rules read, as the
/// one statement returned it (see `EndpointHealth::is_plainly_healthy`).
fn plainly_healthy(a: &db::deliveries::AppliedOutcome, now: Timestamp, policy: &relay_domain::health::CircuitPolicy) -> bool {
    let health = relay_domain::health::EndpointHealth {
        circuit: a.circuit,
        consecutive_failures: a.consecutive_failures,
        window: relay_domain::health::FailureWindow {
            length_ms: a.window_ms,
            bucket: a.window_bucket,
            failures: a.window_failures,
            previous_failures: a.previous_failures,
            ..Default::default()
        },
        ..Default::default()
    };
    health.is_plainly_healthy(now, policy) && a.disabled_reason.is_none()
}

/// What a report says about its endpoint.
fn seen_in(r: &AttemptReport) -> Seen {
    Seen::of(r.http_status, r.retry_after, r.attempt)
}

/// Healthy endpoints whose `last_success_at` is older than the stamp's
/// interval: refreshed at most once a second each, not once per batch.
fn stale_success_stamps(applied: &[db::deliveries::AppliedOutcome], now: Timestamp) -> Vec<EndpointId> {
    let mut stamp: Vec<EndpointId> = applied
        .iter()
        .filter(|a| a.last_success_at.is_none_or(|at| at + super::circuit::SUCCESS_STAMP_EVERY <= now))
        .map(|a| a.endpoint_id)
        .collect();
    stamp.sort();
    stamp.dedup();
    stamp
}

/// A locked delivery as the state machine reads it.
fn standing(row: &db::deliveries::OutcomeRow, switched_off_in_flight: bool) -> DeliveryStanding {
    DeliveryStanding {
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
