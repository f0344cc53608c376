//! The delivery relay: due deliveries → the DELIVERIES stream. The schedule
//! lives in Postgres; a delivery enters the broker only once it is due, so no
//! message waits in the broker holding an ack slot.
//!
//! Handing an attempt out takes a lease: `next_attempt_at` moves forward by
//! the lease length. An outcome replaces it with the real next due time; if
//! none ever comes (the job was lost), the row falls due again by itself and
//! is re-published under the same message id.

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream;
use relay_contracts::StreamNames;
use tokio::sync::watch;

use crate::{
    app::{App, Timestamp},
    db::{self, batcher::KeptConnection, deliveries::Claimed},
    queue::{Job, job_message},
};

pub struct DeliveryRelay {
    pub app: App,
    pub js: jetstream::Context,
    pub names: StreamNames,
    pub batch: i64,
    pub lease: Duration,
    /// The longest sleep when nothing is due and nothing wakes the relay; a
    /// backstop for rows written by another api process.
    pub idle: Duration,
    /// At most this many attempts per endpoint handed out and not yet
    /// reported. A dead endpoint can therefore hold only this many broker
    /// slots, however large its backlog; its other due rows wait in Postgres
    /// and the scan passes over them to other endpoints' work.
    pub endpoint_cap: i64,
    /// The relay's own connection (see `db::batcher`).
    pub conn: tokio::sync::Mutex<KeptConnection>,
}

/// The shortest pause between relay passes started by wake-ups (a pass that
/// fills its batch goes straight on).
const MIN_PASS_GAP: Duration = Duration::from_millis(5);

async fn listen_once(app: &App) -> Result<std::convert::Infallible, sqlx::Error> {
    let mut l = sqlx::postgres::PgListener::connect_with(app.db()).await?;
    l.listen_all([crate::db::deliveries::DUE_CHANNEL, crate::db::keys::REVOKED_CHANNEL, crate::db::events::OUTBOX_CHANNEL]).await?;
    loop {
        let n = l.recv().await?;
        match (n.channel(), n.payload()) {
            (crate::db::keys::REVOKED_CHANNEL, prefix) => app.verified_keys().forget(prefix),
            (crate::db::events::OUTBOX_CHANNEL, _) => {
                app.outbox_offers().look_at_outbox();
                app.outbox_wake().wake();
            }
            (_, crate::db::deliveries::BEHIND_CAPS) => app.slots_awaited().store(true, std::sync::atomic::Ordering::Relaxed),
            _ => app.deliveries_wake().wake(),
        }
    }
}

impl DeliveryRelay {
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        super::drive(&self, shutdown).await
    }

    /// Wakes this relay whenever any api process commits due deliveries,
    /// has the outbox relay look at the outbox when any api commits events
    /// it offered to no relay, and forgets keys any api revokes. sqlx's listener reconnects by
    /// itself; the idle interval (and the keys' short cache) covers the gap.
    pub async fn listen(app: App, mut shutdown: watch::Receiver<bool>) {
        let mut failures = 0u32;
        loop {
            tokio::select! {
                r = listen_once(&app) => {
                    failures += 1;
                    tracing::warn!(error = ?r.err(), "listening for due deliveries failed; relying on the idle interval meanwhile");
                    tokio::select! {
                        _ = tokio::time::sleep(super::backoff(failures)) => {}
                        _ = shutdown.changed() => return,
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }

    async fn next_due(&self) -> Result<Option<Timestamp>> {
        super::on_held(&self.conn, async |held| Ok(db::deliveries::earliest_due(held.get().await?).await?)).await
    }

    pub async fn drain_once(&self) -> Result<usize> {
        super::Pass::drain_once(self).await
    }
}

impl super::Pass for DeliveryRelay {
    const FAILING: &'static str = "deliveries stay pending";

    fn batch(&self) -> usize {
        self.batch as usize
    }

    fn wake(&self) -> &crate::app::Wake {
        self.app.deliveries_wake()
    }

    /// Until the earliest due time rather than polling blindly. A due time
    /// already past belongs to rows this pass could not take (their endpoint
    /// is at its cap, or another relay holds them): the relay says so, and an
    /// outcome freeing a slot wakes it, so it waits for that.
    async fn idle_for(&self) -> Duration {
        let now = self.app.now();
        let next = self.next_due().await;
        let awaited = matches!(next, Ok(Some(at)) if at <= now);
        self.app.slots_awaited().store(awaited, std::sync::atomic::Ordering::Relaxed);
        match next {
            Ok(Some(at)) if at > now => (at - now).to_std().unwrap_or(Duration::ZERO).min(self.idle),
            Ok(_) => self.idle,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "reading the next due time");
                self.idle
            }
        }
    }

    /// Outcomes wake the relay one batch at a time; a short pause lets the
    /// slots freed by several batches be claimed in one pass instead of one
    /// scan each.
    fn settle_after_wake(&self) -> Duration {
        MIN_PASS_GAP
    }

    async fn drain_once(&self) -> Result<usize> {
        super::on_held(&self.conn, async |held| self.pass(held).await).await
    }
}

impl DeliveryRelay {
    async fn pass(&self, held: &mut KeptConnection) -> Result<usize> {
        let conn = held.get().await?;
        let _leasing = self.app.lease_guard().lock().await;
        // Choose without locking (the claim below re-checks): each
        // endpoint's fresh rows come already within its free slots, lost
        // leases hold theirs, so every row chosen may be taken.
        let chosen = db::deliveries::due_candidates(&mut *conn, self.batch, self.endpoint_cap).await.context("finding due deliveries")?;
        if chosen.is_empty() {
            return Ok(0);
        }
        // Claim what was chosen, re-checking that it is still due and
        // unclaimed (another relay may have taken, or an outcome moved, it
        // since the scan), and lease it in the same statement: no row lock
        // or transaction is held while the broker is asked. Rows the broker
        // refuses are released at once; if this process dies before the
        // broker answers, they are published again when the lease runs out,
        // under the same message ids. A claim lost to a Postgres crash is a
        // re-publish the broker drops, so it need not wait for the disk
        // (see cheap commits in `super`).
        let rows = db::deliveries::claim_and_lease(&mut *conn, &chosen, self.lease).await.context("claiming due deliveries")?;
        if rows.is_empty() {
            return Ok(0);
        }
        let messages = rows
            .iter()
            .map(|row| {
                let job = Job {
                    delivery_id: row.id,
                    endpoint_id: row.endpoint_id,
                    environment_id: row.environment_id,
                    attempt: row.attempt,
                    generation: row.generation,
                    trace_context: row.trace_context.as_deref(),
                };
                job_message(&self.names, &job)
            })
            .collect();
        let (stored, first_error) = crate::broker::publish_all(&self.js, messages).await;
        let (mut leased, mut refused): (Vec<&Claimed>, Vec<&Claimed>) = (Vec::new(), Vec::new());
        for (row, ok) in rows.iter().zip(stored) {
            if ok { leased.push(row) } else { refused.push(row) }
        }
        // Refused rows are released, if still under this pass's claim (an
        // outcome cannot have come back for them, but compare-and-set on the
        // claim's instant keeps that true by construction).
        let still_ours =
            |rows: &[&Claimed]| (rows.iter().map(|r| r.id).collect::<Vec<_>>(), rows.iter().map(|r| r.dispatched_at).collect::<Vec<_>>());
        if !refused.is_empty() {
            let (ids, at) = still_ours(&refused);
            db::deliveries::release_refused(&mut *conn, &ids, &at).await.context("releasing deliveries the broker refused")?;
        }
        self.app.count_relayed(leased.len());
        match first_error {
            Some(e) if leased.is_empty() => Err(e.context("publishing to DELIVERIES")),
            _ => Ok(leased.len()),
        }
    }
}
