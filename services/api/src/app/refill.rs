//! Refilling an endpoint's freed slots: when outcomes free slots of an
//! endpoint whose deliveries wait behind its in-flight cap, the next ones
//! go straight back, with their material, to the dispatcher that reported,
//! instead of waiting for a relay pass and the broker.

use std::collections::HashMap;

use relay_domain::{DispatcherId, EndpointId};
use sqlx::PgConnection;

use super::{
    App, Timestamp,
    deliveries::*,
    material::{SendingByEndpoint, StoredSecrets},
};
use crate::{db, error::AppResult};

impl App {
    /// The slots this batch's outcomes freed, filled again for the
    /// dispatchers that reported them: each endpoint's due deliveries that
    /// wait for a slot go straight back to the lane that just sent its last
    /// attempt, instead of waiting for a relay pass and the broker. Only
    /// while rows may wait for slots (an expansion wrote some behind a cap,
    /// or the relay's last look found some due that it could not take); the
    /// relay's next look past the backlog ends the refills.
    pub(super) async fn refill_freed_slots(
        &self,
        conn: &mut PgConnection,
        asks: &[OutcomeAsk],
        endpoints: &[Option<EndpointId>],
        recorded: &mut [AppResult<Recorded>],
    ) -> AppResult<usize> {
        if !self.slots_awaited.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(0);
        }
        let Some(cap) = self.direct.as_ref().map(|d| d.endpoint_cap) else { return Ok(0) };
        // By claimant: each endpoint freed, and the last report of it that
        // recorded (where its next attempts ride back).
        let mut freed: HashMap<DispatcherId, HashMap<EndpointId, usize>> = HashMap::new();
        let mut holds: HashMap<DispatcherId, std::time::Duration> = HashMap::new();
        for (i, (ask, endpoint)) in asks.iter().zip(endpoints).enumerate() {
            if let (Some(claim), Some(endpoint)) = (ask.claim, endpoint) {
                freed.entry(claim.claimant).or_default().insert(*endpoint, i);
                holds.insert(claim.claimant, claim.hold);
            }
        }
        if freed.is_empty() {
            self.deliveries_wake.wake();
            return Ok(0);
        }
        let now = self.clock.now();
        let mut sending_of = SendingByEndpoint::new();
        let (mut found, mut lane_heads) = (0, 0);
        for (claimant, endpoints) in freed {
            let ids: Vec<EndpointId> = endpoints.keys().copied().collect();
            let rows = {
                let _leasing = self.lease_guard.lock().await;
                db::deliveries::refill(
                    &mut *conn,
                    &ids,
                    cap,
                    claimant,
                    holds[&claimant],
                    relay_contracts::SEAM_MATERIAL_REPLY_BUDGET_BYTES as i64,
                )
                .await?
            };
            found += rows.len();
            let mut handed = rows.into_iter().map(|row| self.refilled(row, now, &mut sending_of)).collect::<AppResult<Vec<_>>>()?;
            lane_heads += handed.iter().filter(|m| m.ordering.is_some()).count();
            self.attach_followers(&mut *conn, &mut handed, Claim { claimant, hold: holds[&claimant] }).await;
            for material in handed {
                if let Some(Ok(r)) = endpoints.get(&material.endpoint_id).and_then(|&i| recorded.get_mut(i)) {
                    r.next.push(material);
                }
            }
        }
        tracing::trace!(found, lane_heads, "refilled freed slots");
        Ok(lane_heads)
    }

    pub(super) fn refilled(
        &self,
        row: db::deliveries::RefillRow,
        now: Timestamp,
        sending_of: &mut SendingByEndpoint,
    ) -> AppResult<Material> {
        let stored = StoredSecrets::new(
            &row.signature_scheme,
            &row.secret_key_id,
            &row.secret_ciphertext,
            &row.previous_secret_key_id,
            &row.previous_secret_ciphertext,
            row.secret_rotated_at,
            (&row.headers_key_id, &row.headers_ciphertext),
        )
        .with_auth(
            (&row.client_tls_key_id, &row.client_tls_ciphertext),
            &row.ca_bundle,
            (&row.oauth2_key_id, &row.oauth2_ciphertext),
        );
        let sending = self.sending_for(sending_of, row.endpoint_id, stored, now)?;
        Ok(Material {
            delivery_id: row.id,
            endpoint_id: row.endpoint_id,
            environment_id: row.environment_id,
            event_id: row.event_id,
            url: row.url,
            attempt: row.attempt as u32,
            generation: row.generation as u32,
            scheme: sending.scheme,
            secrets: sending.secrets,
            headers: sending.headers,
            auth: sending.auth,
            max_in_flight: row.max_in_flight.and_then(|n| u32::try_from(n).ok()),
            ordering: row.ordering_key.zip(row.ordering_position),
            payload: row.envelope,
            traceparent: row.trace_context,
            followers: Vec::new(),
        })
    }
}
