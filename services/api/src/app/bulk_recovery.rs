//! Bulk recovery of one endpoint: its dead letters and held deliveries in a
//! time range sent again, as an operation that runs throttled, survives an
//! api crash (progress is stored with each pass's work) and never sends a
//! delivery twice (only dead and held deliveries are taken, and taking one
//! makes it pending).

use anyhow::Context;

use relay_domain::{EndpointId, OperationId, Reason, models::Operation};

use super::{App, Tenant, Timestamp};
use crate::{
    db,
    error::{AppError, AppResult},
};

/// What a recovery request asked for and got.
#[derive(Debug, Clone)]
pub enum Recovery {
    /// A dry run: how many deliveries a real one would send again now.
    WouldRecover(u32),
    Started(Operation),
}

impl App {
    /// Starts a recovery (or counts, for a dry run) of an endpoint's dead
    /// and held deliveries created in `[since, until)`. `tenant` scopes the
    /// endpoint; `None` is an operator's call, for any environment.
    pub async fn recover_endpoint(
        &self,
        tenant: Option<Tenant>,
        endpoint_id: EndpointId,
        since: Timestamp,
        until: Timestamp,
        dry_run: bool,
    ) -> AppResult<Recovery> {
        if since >= until {
            return Err(AppError::invalid(Reason::InvalidRange, format!("since ({since}) must be before until ({until})")));
        }
        let environment_id = match tenant {
            Some(t) => t.environment_id,
            None => db::endpoints::environment_of(&self.db, endpoint_id).await?.ok_or_else(|| AppError::not_found("webhook endpoint"))?,
        };
        let endpoint = self.get_endpoint(Tenant { environment_id }, endpoint_id).await?;
        let n = db::operations::count_recoverable(&self.db, endpoint_id, since, until).await?;
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        if dry_run {
            return Ok(Recovery::WouldRecover(n));
        }
        if !endpoint.enabled {
            return Err(AppError::precondition(
                Reason::EndpointInactive,
                format!("endpoint {endpoint_id} is disabled; enable it before recovering its deliveries"),
            ));
        }
        let op = db::operations::insert(&self.db, environment_id, endpoint_id, since, until, n.min(i32::MAX as u32) as i32).await?;
        self.recover_wake.wake();
        Ok(Recovery::Started(op))
    }

    pub async fn operation(&self, tenant: Option<Tenant>, id: OperationId) -> AppResult<Operation> {
        db::operations::get(&self.db, id, tenant.map(|t| t.environment_id)).await?.ok_or_else(|| AppError::not_found("operation"))
    }

    /// One pass over the running recoveries: each endpoint's oldest takes
    /// its next `per_pass` deliveries. Returns how many were sent again.
    pub async fn recover_pass(&self, per_pass: i64) -> AppResult<usize> {
        let mut tx = self.db.begin().await?;
        let ops = db::operations::lock_running(&mut tx).await?;
        let mut sent = 0;
        let mut lanes = Vec::new();
        for op in ops {
            let endpoint = db::endpoints::get(&mut tx, op.environment_id, op.endpoint_id, self.clock.now()).await?;
            if !endpoint.is_some_and(|e| e.enabled) {
                db::operations::fail(&mut tx, op.id, "the endpoint was disabled or deleted before the recovery finished").await?;
                continue;
            }
            let taken = db::operations::recover_next(&mut tx, &op, per_pass).await?;
            lanes.extend(taken.iter().filter_map(|r| Some((op.endpoint_id, r.queued_in.clone()?))));
            let cursor = taken.iter().max_by_key(|r| (r.created_at, r.id)).map(|r| (r.created_at, r.id));
            let finished = (taken.len() as i64) < per_pass;
            db::operations::advance(&mut tx, op.id, taken.len() as i32, cursor, finished).await?;
            sent += taken.len();
        }
        if sent > 0 {
            db::deliveries::notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing a recovery pass")?;
        if sent > 0 {
            self.deliveries_wake.wake();
        }
        // Replays into lanes: each sent once what is ahead of it has ended.
        if !lanes.is_empty() {
            self.promote_lanes(lanes).await;
        }
        Ok(sent)
    }
}
