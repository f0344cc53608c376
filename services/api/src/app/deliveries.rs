//! Deliveries as the seam and the tenant see them: the types the use-cases
//! take and give, replay, and the dead-letter store. The use-cases live
//! beside this file — `expansion`, `material`, `outcomes` — the rules in
//! `state`, the SQL in `crate::db`. Every transition is one transaction.

use std::time::Duration;

use anyhow::Context;
use relay_domain::{DeadLetterId, DeliveryId, DispatcherId, EndpointId, EnvironmentId, EventId, Reason};
use relay_signing::{Scheme, SigningSecret};

use super::{App, Tenant};
pub use crate::db::dead_letters::DeadLetter;
use crate::{
    db,
    error::{AppError, AppResult},
};
pub use relay_domain::delivery::Decision;

#[derive(Debug)]
pub struct Expanded {
    pub created: u32,
    pub duplicate: bool,
    /// First attempts handed to the dispatcher that asked, with their material.
    pub attempts: Vec<Material>,
}

impl Expanded {
    pub(crate) fn none() -> Self {
        Self { created: 0, duplicate: false, attempts: Vec::new() }
    }

    pub(crate) fn duplicate() -> Self {
        Self { duplicate: true, ..Self::none() }
    }
}

/// Everything one attempt needs. The secrets are decrypted for this attempt
/// only; `SigningSecret`'s `Debug` keeps them out of logs.
#[derive(Debug)]
pub struct Material {
    pub delivery_id: DeliveryId,
    pub endpoint_id: EndpointId,
    pub environment_id: EnvironmentId,
    pub event_id: EventId,
    pub url: String,
    pub attempt: u32,
    pub generation: u32,
    /// How `secrets` sign (the endpoint's scheme when the material was read).
    pub scheme: Scheme,
    pub secrets: Vec<SigningSecret>,
    /// The endpoint's custom headers (their `Debug` shows names only).
    pub headers: relay_domain::headers::CustomHeaders,
    /// How to authenticate to the receiver (`Debug` redacts keys and secrets).
    pub auth: ReceiverAuth,
    /// The endpoint's own in-flight cap, if it set one: a dispatcher sends
    /// up to this many of its attempts at once.
    pub max_in_flight: Option<u32>,
    /// In an ordered endpoint's lane: the key and the delivery's position
    /// (sent as the sequence header).
    pub ordering: Option<(String, i64)>,
    pub payload: Vec<u8>,
    /// The trace the delivery's attempts continue, for an attempt handed
    /// over in a reply rather than asked for.
    pub traceparent: Option<String>,
    /// A lane head's next deliveries, in lane order, each numbered as it
    /// will be when promoted: sent on their predecessor's 2xx by the
    /// dispatcher the head was handed to (`lanes::attach_followers`).
    pub followers: Vec<Material>,
}

/// How Relay authenticates to the receiver beyond signing, when the
/// endpoint asks: the client certificate and key to present (one PEM text),
/// the CA bundle to pin, and OAuth2 client credentials.
#[derive(Clone, Default)]
pub struct ReceiverAuth {
    pub identity_pem: Option<String>,
    /// Inside a client certificate's overlap: the identity it replaced.
    pub previous_identity_pem: Option<String>,
    pub ca_bundle: Option<String>,
    pub oauth2: Option<relay_domain::models::OAuth2Credentials>,
}

impl std::fmt::Debug for ReceiverAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverAuth")
            .field("identity", &self.identity_pem.as_ref().map(|_| "[redacted]"))
            .field("previous_identity", &self.previous_identity_pem.as_ref().map(|_| "[redacted]"))
            .field("ca_bundle_len", &self.ca_bundle.as_ref().map(String::len))
            .field("oauth2", &self.oauth2)
            .finish()
    }
}

/// An outcome to record, and who reported it: a dispatcher that names
/// itself may be handed its endpoint's next attempts (see `record_outcomes`).
#[derive(Debug, Clone)]
pub struct OutcomeAsk {
    pub report: AttemptReport,
    pub claim: Option<Claim>,
}

/// What recording an outcome decided, and the attempts handed back to take
/// the slot it freed.
#[derive(Debug)]
pub struct Recorded {
    pub decision: Decision,
    pub next: Vec<Material>,
}

#[derive(Debug, Clone)]
pub struct AttemptReport {
    pub delivery_id: DeliveryId,
    pub generation: u32,
    pub attempt: u32,
    pub http_status: Option<u32>,
    pub error: String,
    pub latency_ms: u64,
    pub response_body: Vec<u8>,
    /// The receiver's `Retry-After` on a 429 or 503.
    pub retry_after: Option<std::time::Duration>,
    /// The scheme the attempt was signed with; `None` from a dispatcher
    /// that does not say.
    pub signature_scheme: Option<Scheme>,
    /// Sent as a lane follower, on its predecessor's 2xx and perhaps before
    /// that outcome was recorded: the report waits for it.
    pub lane_follower: bool,
    /// Followers of this attempt's run that its dispatcher will not send:
    /// their claims are given up.
    pub released_followers: Vec<DeliveryId>,
    /// The follower its dispatcher sends next, its run going on: leased to
    /// it once promoted.
    pub next_follower: Option<DeliveryId>,
}

/// One event to expand. `trace_context` is the traceparent its deliveries
/// carry, so their attempts continue the event's trace.
#[derive(Debug, Clone)]
pub struct ExpandItem {
    pub event_id: EventId,
    pub environment_id: EnvironmentId,
    pub event_type: String,
    pub trace_context: Option<String>,
    /// An operational event's one recipient.
    pub target: Option<EndpointId>,
}

/// One attempt of one delivery, as the dispatcher names it.
#[derive(Debug, Clone, Copy)]
pub struct AttemptRef {
    pub delivery_id: DeliveryId,
    pub generation: u32,
    pub attempt: u32,
    /// Who will send it, for how long: the material is handed out only to
    /// the holder of the attempt's claim. `None` reads without claiming.
    pub claim: Option<Claim>,
}

/// A dispatcher's claim on an attempt it is about to send.
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub claimant: DispatcherId,
    pub hold: Duration,
}

/// The longest claim a dispatcher may take.
pub const MAX_CLAIM_HOLD: Duration = relay_config::timing::MAX_CLAIM_HOLD;

impl App {
    /// Puts a dead delivery back at attempt 1, due now, in a new generation.
    /// The dead-letter record stays: it is the evidence the attempts ran out.
    /// `tenant` scopes the lookup; the internal seam passes `None`.
    pub async fn replay_dead_letter(&self, tenant: Option<Tenant>, dead_letter_id: DeadLetterId) -> AppResult<DeliveryId> {
        let mut tx = self.db.begin().await?;
        let (delivery_id, endpoint_id, active) =
            db::dead_letters::find_for_replay(&mut tx, dead_letter_id, tenant.map(|t| t.environment_id))
                .await?
                .ok_or_else(|| AppError::not_found("dead letter"))?;
        if !active {
            return Err(AppError::precondition(
                Reason::EndpointInactive,
                format!("endpoint {endpoint_id} is disabled or deleted; enable it before replaying its dead letters"),
            ));
        }
        let Some(lane) = db::deliveries::reset_for_replay(&mut tx, delivery_id).await? else {
            return Err(AppError::precondition(
                Reason::AlreadyReplayed,
                format!("delivery {delivery_id} is no longer dead: it was already replayed"),
            ));
        };
        if lane.is_none() {
            db::deliveries::notify_due(&mut tx).await?;
        }
        tx.commit().await.context("committing a replay")?;
        match lane {
            // Queued at its lane's tail: sent when what is ahead has ended.
            Some(key) => self.promote_lanes(vec![(endpoint_id, key)]).await,
            None => self.deliveries_wake.wake(),
        }
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

    /// Deliveries held longer than their environment allows end as dead
    /// letters `endpoint_failing`, batch after batch (at most `budget`).
    pub async fn expire_held(&self, budget: u64) -> AppResult<u64> {
        const BATCH: i64 = 1000;
        let mut total = 0;
        while total < budget {
            let n = db::health::expire_held(&self.db, BATCH).await?;
            total += n;
            if n < BATCH as u64 {
                break;
            }
        }
        Ok(total)
    }

    /// One round of the retention walk (see `db::retention`): from `cursor`,
    /// batch after batch, until it reaches events younger than `retention`
    /// or has looked at `budget` events; returns where the walk stands (0:
    /// the round is done, the next starts from the oldest event again) and
    /// what it removed.
    pub async fn prune_retained(&self, retention: Duration, cursor: i64, budget: i64) -> AppResult<(i64, db::retention::Pruned)> {
        const BATCH: i64 = 500;
        let (mut cursor, mut total, mut looked) = (cursor, db::retention::Pruned::default(), 0);
        while looked < budget {
            let pass = db::retention::prune_events(&self.db, retention, cursor, BATCH).await?;
            looked += BATCH;
            total.events += pass.events;
            total.deliveries += pass.deliveries;
            total.attempts += pass.attempts;
            match pass.last_seq {
                Some(seq) if !pass.reached_young => cursor = seq,
                _ => return Ok((0, total)),
            }
        }
        Ok((cursor, total))
    }

    pub async fn list_dead_letters(&self, tenant: Tenant) -> AppResult<Vec<DeadLetter>> {
        db::dead_letters::list(&self.db, tenant.environment_id).await
    }
}
