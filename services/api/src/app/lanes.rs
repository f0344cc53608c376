//! Ordered endpoints' lanes (`relay_domain::ordering`): after anything that
//! writes a queued row or ends a lane's head has committed, its lanes are
//! asked to promote their next row (`db::deliveries::lanes`). A promotion
//! that fails, or never runs because this process died first, is made by
//! the upkeep's sweep, which looks for lanes left without a head.

use relay_domain::EndpointId;

use super::App;
use crate::{
    db::{self, deliveries::lanes::Lanes},
    error::AppResult,
};

/// How many headless lanes one sweep promotes at most.
const SWEEP_BATCH: i64 = 1000;

impl App {
    /// Promotes the next row of each of these lanes that has no head, and
    /// wakes the relay for those now pending. Never fails its caller: what it
    /// could not do, the sweep does.
    pub(crate) async fn promote_lanes(&self, lanes: Vec<(EndpointId, String)>) {
        match db::deliveries::lanes::promote(&self.db, &Lanes::of(lanes)).await {
            Ok(p) if p.pending > 0 => self.deliveries_wake.wake(),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = ?e, "promoting the next deliveries of ordered lanes failed; the lane sweep will"),
        }
    }

    /// Promotes the next row of lanes left without a head; how many lanes
    /// it looked at.
    pub async fn sweep_lanes(&self) -> AppResult<usize> {
        let lanes = db::deliveries::lanes::headless(&self.db, SWEEP_BATCH).await?;
        let n = lanes.endpoint_id.len();
        if n > 0 {
            let promoted = db::deliveries::lanes::promote(&self.db, &lanes).await?;
            tracing::info!(
                lanes = n,
                pending = promoted.pending,
                held = promoted.held,
                "promoted the next deliveries of lanes left without one"
            );
            if promoted.pending > 0 {
                self.deliveries_wake.wake();
            }
        }
        Ok(n)
    }
}
