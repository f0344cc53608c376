//! Lane runs: a lane head handed to a dispatcher comes with the lane's
//! next deliveries (`Material::followers`, see `lanes::attach_followers`),
//! which the dispatcher sends each on its predecessor's 2xx. What their
//! reports ask of an outcome batch besides being recorded: the claims of
//! the followers a run stopped before given up, and the follower a run
//! sends next leased to it once promoted.

use std::collections::{HashMap, HashSet};

use relay_domain::{DeliveryId, DispatcherId, EndpointId};
use sqlx::PgConnection;

use super::{
    App,
    deliveries::{AttemptReport, OutcomeAsk, Recorded},
};
use crate::{
    db,
    error::{AppError, AppResult},
};

impl App {
    /// Records an outcome batch's reports in passes (see
    /// `record_outcome_batch`), with what lane runs ask besides: each
    /// report's answer, the endpoint of each that recorded an attempt, and
    /// how many lane heads its outcomes promoted that are still to be sent.
    pub(super) async fn record_in_passes(
        &self,
        conn: &mut PgConnection,
        asks: &[OutcomeAsk],
    ) -> AppResult<(Vec<AppResult<Recorded>>, Vec<Option<EndpointId>>, u64)> {
        self.release_followers(&mut *conn, asks).await;
        let mut answers: Vec<Option<AppResult<Recorded>>> = asks.iter().map(|_| None).collect();
        let mut endpoints: Vec<Option<EndpointId>> = vec![None; asks.len()];
        let (mut promoted, mut promoted_then_recorded) = (0u64, 0u64);
        let mut waiting: Vec<usize> = (0..asks.len()).collect();
        while !waiting.is_empty() {
            let followers: Vec<DeliveryId> =
                waiting.iter().filter(|&&i| asks[i].report.lane_follower).map(|&i| asks[i].report.delivery_id).collect();
            let queued: HashSet<DeliveryId> = if followers.is_empty() {
                HashSet::new()
            } else {
                db::deliveries::lanes::still_queued(&mut *conn, &followers).await?.into_iter().collect()
            };
            let first_pass = waiting.len() == asks.len();
            let (ready, later): (Vec<usize>, Vec<usize>) = std::mem::take(&mut waiting)
                .into_iter()
                .partition(|&i| !(asks[i].report.lane_follower && queued.contains(&asks[i].report.delivery_id)));
            waiting = later;
            if ready.is_empty() {
                break;
            }
            if !first_pass {
                promoted_then_recorded += ready.len() as u64;
            }
            let reports: Vec<AttemptReport> = ready.iter().map(|&i| asks[i].report.clone()).collect();
            let (decisions, recorded_endpoints, p) = self.record_reports(&mut *conn, &reports).await?;
            promoted += p;
            for ((i, decision), endpoint) in ready.into_iter().zip(decisions).zip(recorded_endpoints) {
                if asks[i].report.lane_follower && endpoint.is_some() {
                    self.metrics.lane_follower_attempts.inc();
                }
                answers[i] = Some(decision.map(|decision| Recorded { decision, next: Vec::new() }));
                endpoints[i] = endpoint;
            }
        }
        // Still queued: behind a head whose report has not come yet (the
        // same dispatcher sent it, and this one follows it), or whose
        // successor's promotion has not committed yet. Reported again
        // shortly (the dispatcher gives up after some seconds: a lane ended
        // with its endpoint never promotes it).
        self.extend_deferred_claims(&mut *conn, asks, &waiting).await;
        for i in waiting {
            answers[i] = Some(Err(AppError::new(
                crate::error::ErrorCode::Unavailable,
                relay_domain::Reason::PredecessorUnrecorded,
                format!(
                    "delivery {} follows a lane head whose outcome is not recorded yet; report attempt {} again",
                    asks[i].report.delivery_id, asks[i].report.attempt
                ),
            )));
        }
        let leased = self.settle_runs(&mut *conn, asks, &endpoints).await;
        // Heads promoted by one pass and recorded by the next were sent
        // already, as were those leased to the runs sending them; the rest
        // are the refill's or the relay's to send.
        let promoted = promoted.saturating_sub(promoted_then_recorded + leased);
        Ok((answers.into_iter().map(|a| a.expect("every report answered")).collect(), endpoints, promoted))
    }

    /// The claims of the followers whose reports this batch defers (still
    /// queued behind an unrecorded predecessor) renewed for their
    /// dispatchers (see `db::deliveries::lanes::extend_deferred_claims`).
    /// Never fails the batch: a claim not renewed may run out, as before.
    async fn extend_deferred_claims(&self, conn: &mut PgConnection, asks: &[OutcomeAsk], waiting: &[usize]) {
        let mut deferred: HashMap<DispatcherId, (db::deliveries::lanes::Deferred, std::time::Duration)> = HashMap::new();
        for &i in waiting {
            let Some(claim) = asks[i].claim else { continue };
            let r = &asks[i].report;
            let (rows, _) = deferred.entry(claim.claimant).or_insert_with(|| (Default::default(), claim.hold));
            rows.delivery.push(r.delivery_id);
            rows.attempt.push(r.attempt as i32);
            rows.generation.push(r.generation as i32);
        }
        for (claimant, (rows, hold)) in deferred {
            if let Err(e) = db::deliveries::lanes::extend_deferred_claims(&mut *conn, &rows, claimant, hold).await {
                tracing::warn!(error = ?e, "renewing deferred lane followers' claims failed; they may run out");
            }
        }
    }

    /// The followers that runs stopped before (`released_followers`), given
    /// up before the reports are recorded: while the reporting attempt is
    /// current no one can have claimed them again (see
    /// `db::deliveries::lanes::release_followers`). Never fails the batch:
    /// a claim not released runs out.
    pub(super) async fn release_followers(&self, conn: &mut PgConnection, asks: &[OutcomeAsk]) {
        let mut released: HashMap<DispatcherId, db::deliveries::lanes::Released> = HashMap::new();
        for ask in asks {
            let Some(claim) = ask.claim else { continue };
            let r = &ask.report;
            for &follower in &r.released_followers {
                let rows = released.entry(claim.claimant).or_default();
                rows.follower.push(follower);
                rows.reporter.push(r.delivery_id);
                rows.attempt.push(r.attempt as i32);
                rows.generation.push(r.generation as i32);
            }
        }
        for (claimant, rows) in released {
            if let Err(e) = db::deliveries::lanes::release_followers(&mut *conn, &rows, claimant).await {
                tracing::warn!(error = ?e, "releasing unsent lane followers' claims failed; they run out");
            }
        }
    }

    /// What lane runs (`Material::followers`) ask with the reports this
    /// batch recorded (`recorded`: the endpoint of each that recorded an
    /// attempt now; a report answered from the log, or deferred, asks
    /// nothing): the followers a run will send next, promoted by this batch, are leased
    /// to their dispatcher (not handed out, nor sent by a relay). Never
    /// fails the batch: a lease not taken costs at most a second copy of
    /// the follower. How many followers it leased.
    pub(super) async fn settle_runs(&self, conn: &mut PgConnection, asks: &[OutcomeAsk], recorded: &[Option<EndpointId>]) -> u64 {
        let mut next: HashMap<DispatcherId, (Vec<DeliveryId>, std::time::Duration)> = HashMap::new();
        for (ask, _) in asks.iter().zip(recorded).filter(|(_, r)| r.is_some()) {
            let Some(claim) = ask.claim else { continue };
            if let Some(id) = ask.report.next_follower {
                next.entry(claim.claimant).or_insert_with(|| (Vec::new(), claim.hold)).0.push(id);
            }
        }
        let mut leased = 0;
        for (claimant, (ids, hold)) in next {
            match db::deliveries::lanes::lease_next_followers(&mut *conn, &ids, claimant, hold).await {
                Ok(n) => leased += n,
                Err(e) => tracing::warn!(error = ?e, "leasing lane runs' next followers failed; a relay may send them too"),
            }
        }
        leased
    }
}
