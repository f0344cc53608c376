//! Ordered endpoints' lanes (`relay_domain::ordering`): after anything that
//! writes a queued row or ends a lane's head has committed, its lanes are
//! asked to promote their next row (`db::deliveries::lanes`). A promotion
//! that fails, or never runs because this process died first, is made by
//! the upkeep's sweep, which looks for lanes left without a head.

use relay_domain::EndpointId;
use sqlx::PgConnection;

use super::{
    App,
    deliveries::{Claim, Material},
    material::SendingByEndpoint,
};
use crate::{
    db::{
        self,
        deliveries::lanes::{EndedHeads, Lanes},
    },
    error::AppResult,
};

/// A lane head an outcome ended: its endpoint, key and position in the
/// lane (`None` only for a head never numbered, which is promoted anyway).
pub(crate) type EndedHead = (EndpointId, String, Option<i64>);

/// How many headless lanes one sweep promotes at most.
const SWEEP_BATCH: i64 = 1000;

/// How many of a lane's next deliveries go out with its head: enough for a
/// dispatcher to keep sending a key's deliveries back to back while their
/// predecessors' outcomes are recorded (a few milliseconds each), few
/// enough that a run cut short wastes little reading.
const LANE_FOLLOWERS: i64 = 32;

impl App {
    /// Promotes the next row of each of these lanes that has no head, and
    /// wakes the relay for those now pending. Never fails its caller: what it
    /// could not do, the sweep does.
    pub(crate) async fn promote_lanes(&self, lanes: Vec<(EndpointId, String)>) {
        let promoted = match self.db.acquire().await {
            Ok(mut conn) => db::deliveries::lanes::promote(&mut conn, &Lanes::of(lanes), true).await,
            Err(e) => Err(e.into()),
        };
        match promoted {
            Ok(p) if p.pending > 0 => self.deliveries_wake.wake(),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = ?e, "promoting the next deliveries of ordered lanes failed; the lane sweep will"),
        }
    }

    /// Promotes the next row of lanes whose heads an outcome batch ended,
    /// telling no relay: the batch's refill hands the new heads back to the
    /// dispatcher that reported (no relay pass, no broker), and the caller
    /// wakes this api's relay for what it did not. How many are pending.
    /// On the caller's connection: the outcome or expansion batch's own.
    pub(crate) async fn promote_ended_lanes(&self, conn: &mut PgConnection, lanes: Vec<(EndpointId, String)>) -> u64 {
        match db::deliveries::lanes::promote(conn, &Lanes::of(lanes), false).await {
            Ok(p) => {
                if p.pending > 0 {
                    self.slots_awaited.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                p.pending
            }
            Err(e) => {
                tracing::warn!(error = ?e, "promoting the next deliveries of ordered lanes failed; the lane sweep will");
                0
            }
        }
    }

    /// After an outcome batch that ended lane heads has committed: marks
    /// idle the lanes with nothing queued behind their ended head, in one
    /// statement that needs no promotion after it
    /// (`db::deliveries::lanes::mark_idle_after_heads` says why that is
    /// safe), and promotes the others as `promote_ended_lanes` does. Most
    /// ended heads have nothing behind them: their lanes cost one statement,
    /// not a promotion's transaction of four round trips. How many are
    /// pending.
    pub(crate) async fn settle_ended_lanes(&self, conn: &mut PgConnection, ended: Vec<EndedHead>) -> u64 {
        let lanes: Vec<(EndpointId, String)> = ended.iter().map(|(e, k, _)| (*e, k.clone())).collect();
        let numbered = EndedHeads::of(ended.into_iter().filter_map(|(e, k, p)| Some((e, k, p?))).collect());
        let idle = match db::deliveries::lanes::mark_idle_after_heads(conn, &numbered).await {
            Ok(idle) => idle.into_iter().collect::<std::collections::HashSet<_>>(),
            Err(e) => {
                tracing::warn!(error = ?e, "marking ended lanes idle failed; promoting them");
                Default::default()
            }
        };
        let rest: Vec<(EndpointId, String)> = lanes.into_iter().filter(|lane| !idle.contains(lane)).collect();
        self.metrics.ended_lanes.with_label_values(&["idle"]).inc_by(idle.len() as u64);
        self.metrics.ended_lanes.with_label_values(&["promoted"]).inc_by(rest.len() as u64);
        if rest.is_empty() { 0 } else { self.promote_ended_lanes(conn, rest).await }
    }

    /// After an expansion queued rows in lanes, for a dispatcher that takes
    /// attempts in hand: promotes the lanes telling no relay, and hands the
    /// new heads (and any other due row of their endpoints, within their
    /// caps) to that dispatcher with their material, as a refill does, up
    /// to `budget` bytes of bodies. What it does not take, this api's relay
    /// sends.
    pub(crate) async fn promote_and_hand(
        &self,
        conn: &mut PgConnection,
        lanes: Vec<(EndpointId, String)>,
        claim: Claim,
        budget: i64,
    ) -> Vec<Material> {
        let mut endpoints: Vec<EndpointId> = lanes.iter().map(|(e, _)| *e).collect();
        endpoints.sort();
        endpoints.dedup();
        let promoted = self.promote_ended_lanes(&mut *conn, lanes).await;
        if promoted == 0 {
            return Vec::new();
        }
        let cap = self.direct.as_ref().map_or(0, |d| d.endpoint_cap);
        let refilling = budget > 0 && cap > 0;
        let handed = if refilling {
            let _leasing = self.lease_guard.lock().await;
            db::deliveries::refill(&mut *conn, &endpoints, cap, claim.claimant, claim.hold, budget).await
        } else {
            Ok(Vec::new())
        };
        let refilled = refilling && handed.is_ok();
        let now = self.clock.now();
        let mut sending_of = SendingByEndpoint::new();
        let mut out: Vec<Material> = match handed {
            Ok(rows) => rows
                .into_iter()
                .filter_map(|row| {
                    self.refilled(row, now, &mut sending_of)
                        .inspect_err(|e| tracing::warn!(error = ?e, "no material for a lane's new head; its lease runs out first"))
                        .ok()
                })
                .collect(),
            Err(e) => {
                tracing::warn!(error = ?e, "handing lanes' new heads to the dispatcher failed; the relay sends them");
                Vec::new()
            }
        };
        if (out.len() as u64) < promoted {
            self.heads_left_behind(conn, refilled).await;
        }
        self.attach_followers(conn, &mut out, claim).await;
        out
    }

    /// New heads that `promote_and_hand` did not hand out. Where its refill
    /// ran, they wait behind their endpoints' caps (it fills every free
    /// slot, or leaves the rows another pass holds to that pass), so each
    /// endpoint has attempts in flight whose outcomes fill the next slots:
    /// every api is told to refill, as for rows an expansion writes beyond a
    /// cap (this api's flag is up already: the promotion raised it). A
    /// relay woken instead raced those refills for each slot an outcome
    /// freed and won a third of `w6`'s deliveries for the broker's longer
    /// way (a DELIVERIES message and a material call each). Where the
    /// refill did not run, the relay sends them.
    async fn heads_left_behind(&self, conn: &mut PgConnection, refilled: bool) {
        if refilled {
            match db::deliveries::notify_capped(conn).await {
                Ok(()) => return,
                Err(e) => tracing::warn!(error = ?e, "telling the apis that lane heads wait behind caps failed; the relay sends them"),
            }
        }
        self.deliveries_wake.wake();
    }

    /// Promotes the next row of lanes left without a head; how many lanes
    /// it looked at.
    pub async fn sweep_lanes(&self) -> AppResult<usize> {
        let lanes = db::deliveries::lanes::headless(&self.db, SWEEP_BATCH).await?;
        let n = lanes.endpoint_id.len();
        if n > 0 {
            let promoted = db::deliveries::lanes::promote(&mut *self.db.acquire().await?, &lanes, true).await?;
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

    /// Gives each lane head in `handed` (material going to the dispatcher
    /// of `claim`) the lane's next deliveries as followers, claimed for it, each
    /// numbered as its promotion will number it: one more than its
    /// predecessor, as nothing else in a lane is promoted between a head's
    /// end and its successor's promotion, and the lane's order is the queue's
    /// (nothing is ever queued ahead of a waiting row: an event is expanded
    /// only after its key's predecessors, a replay joins the tail). Never
    /// fails its caller: without followers the heads go as before.
    pub(crate) async fn attach_followers(&self, conn: &mut PgConnection, handed: &mut [Material], claim: Claim) {
        let lanes: Vec<(EndpointId, String)> =
            handed.iter().filter_map(|m| m.ordering.as_ref().map(|(key, _)| (m.endpoint_id, key.clone()))).collect();
        if lanes.is_empty() {
            return;
        }
        let rows = match db::deliveries::lanes::followers(
            conn,
            &Lanes::of(lanes),
            LANE_FOLLOWERS,
            relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64,
            claim.claimant,
            claim.hold,
        )
        .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = ?e, "reading lane heads' followers failed; the heads go without");
                return;
            }
        };
        let now = self.clock.now();
        let mut sending_of = SendingByEndpoint::new();
        let mut by_lane: std::collections::HashMap<(EndpointId, String), Vec<Option<Material>>> = std::collections::HashMap::new();
        for row in rows {
            let lane = (row.endpoint_id, row.ordering_key.clone().unwrap_or_default());
            match self.refilled(row, now, &mut sending_of) {
                Ok(m) => by_lane.entry(lane).or_default().push(Some(m)),
                // A lane's followers are a prefix of its queue or nothing.
                Err(e) => {
                    tracing::warn!(error = ?e, "no material for a lane follower; its lane's head goes with those before it");
                    by_lane.entry(lane).or_default().push(None);
                }
            }
        }
        for head in handed.iter_mut() {
            let Some((key, position)) = head.ordering.clone() else { continue };
            let Some(followers) = by_lane.remove(&(head.endpoint_id, key.clone())) else { continue };
            head.followers = followers
                .into_iter()
                .map_while(|f| f)
                .zip(1..)
                .map(|(mut f, i)| {
                    f.ordering = Some((key.clone(), position + i));
                    f
                })
                .collect();
        }
    }
}
