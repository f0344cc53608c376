//! A tenant's switch-off (disable or delete) of an endpoint, as its
//! deliveries see it: each pending or held one ends as a dead letter, and
//! the claims on the attempts it ends are fenced and reported, so the caller
//! can wait for the dispatchers that hold them.

use relay_domain::{DeliveryId, DispatcherId, EndpointId, delivery::DeadLetterReason};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::AppResult;

/// Who holds claims an endpoint's switch-off must wait for: the claimant
/// stored on the placeholders that fence the ended attempts (see
/// [`end_pending_of_endpoint`]), never a dispatcher's.
pub const SWITCHED_OFF: DispatcherId = DispatcherId::from_uuid(Uuid::nil());

/// How long a placeholder claim fences its attempt: far longer than a
/// material call that read the attempt before the switch-off committed can
/// take to try to claim it.
const FENCE_MS: i64 = 60_000;

/// A dispatcher's live claim on an attempt that a switch-off ended: that
/// dispatcher may have the attempt queued, about to start, or on the wire.
#[derive(Debug, Clone)]
pub struct HeldClaim {
    pub delivery_id: DeliveryId,
    pub attempt: i32,
    pub generation: i32,
    pub claimant: DispatcherId,
    /// Until the claim runs out, by the database's clock; the dispatcher
    /// starts no attempt past its claim, nor has one on the wire then.
    pub remaining_ms: i64,
}

/// Every pending, held or queued delivery of an endpoint being disabled or deleted, in the
/// caller's transaction (the one that switches the endpoint off): each ends
/// as a dead letter with `reason` (why it will not be attempted again), the
/// update and the dead letters in one statement. `attempts` counts the
/// attempts that reported (the current one had not).
///
/// The same statement fences the ended attempts' claims, so that the caller
/// learns of every dispatcher that holds one and no other can take one: a
/// dispatcher's live claim on the attempt is kept and returned, anything else
/// becomes a placeholder of [`SWITCHED_OFF`]'s (which no claim for the same
/// attempt replaces). A claim being taken meanwhile (a material call that
/// read the attempt as current before this commits) either committed first,
/// and is returned here, or meets the placeholder, waits for this
/// transaction and is refused; rows being leased and claimed by an outcome's
/// refill are waited for by the update, and their claims returned.
pub async fn end_pending_of_endpoint(
    tx: &mut PgConnection,
    endpoint_id: EndpointId,
    reason: DeadLetterReason,
) -> AppResult<Vec<HeldClaim>> {
    Ok(sqlx::query_as!(
        HeldClaim,
        r#"WITH ended AS (
           UPDATE webhook_deliveries SET state = 'dead', dispatched_at = NULL, last_error = $2, updated_at = now()
           -- Spelled as the four partial indexes that hold an endpoint's
           -- live rows (waiting, leased, held, queued in lanes), so each
           -- serves its part.
           WHERE endpoint_id = $1
             AND (state = 'pending' AND dispatched_at IS NULL OR state = 'pending' AND dispatched_at IS NOT NULL OR state = 'held'
                  OR state = 'queued')
           RETURNING id, environment_id, endpoint_id, event_id, attempt, generation, last_status),
         lettered AS (
           INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason)
           SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt - 1, last_status, $2, $2 FROM ended),
         fenced AS (
           INSERT INTO attempt_claims AS c (delivery_id, attempt, generation, claimant, until)
           SELECT id, attempt, generation, $3, now() + $4::bigint * interval '1 millisecond' FROM ended
           ON CONFLICT (delivery_id) DO UPDATE
             SET claimant = CASE WHEN c.until > now() AND (c.generation, c.attempt) = (excluded.generation, excluded.attempt)
                                 THEN c.claimant ELSE excluded.claimant END,
                 until = CASE WHEN c.until > now() AND (c.generation, c.attempt) = (excluded.generation, excluded.attempt)
                              THEN c.until ELSE excluded.until END,
                 attempt = excluded.attempt, generation = excluded.generation
           RETURNING delivery_id, attempt, generation, claimant, until)
         SELECT delivery_id, attempt, generation, claimant,
                ceil(extract(epoch FROM until - now()) * 1000)::bigint AS "remaining_ms!"
         FROM fenced WHERE claimant <> $3"#,
        endpoint_id as _,
        reason.as_str(),
        SWITCHED_OFF as _,
        FENCE_MS,
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// The same ending for pending deliveries found by id (see `end_pending_of_endpoint`).
pub async fn end_pending_by_id(db: &PgPool, ids: &[DeliveryId], reason: DeadLetterReason) -> AppResult<u64> {
    Ok(sqlx::query!(
        "WITH ended AS (
           UPDATE webhook_deliveries SET state = 'dead', dispatched_at = NULL, last_error = $2, updated_at = now()
           WHERE state = 'pending' AND id = ANY ($1)
           RETURNING id, environment_id, endpoint_id, event_id, attempt, last_status)
         INSERT INTO webhook_dead_letters (id, environment_id, delivery_id, endpoint_id, event_id, attempts, last_status, last_error, reason)
         SELECT relay_uuid_v7(), environment_id, id, endpoint_id, event_id, attempt - 1, last_status, $2, $2 FROM ended",
        ids as _,
        reason.as_str(),
    )
    .execute(db)
    .await?
    .rows_affected())
}
