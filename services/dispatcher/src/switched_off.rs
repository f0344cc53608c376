//! Attempts switched off while in this process's hands.
//!
//! A tenant's disable or delete of an endpoint ends its pending deliveries,
//! but first attempts handed over with their material (and attempts whose
//! material was fetched just before) sit queued on the endpoint's lane and
//! are sent without asking the api again. So the api, before it answers the
//! tenant, tells each dispatcher holding a claim on one of the ended attempts
//! which ones (a core-NATS request on its own subject, see
//! `relay.queue.v1.SwitchedOff`), and waits for the answer. The dispatcher
//! marks those attempts refused, so a lane starts none of them from then on,
//! and answers once none of them is on the wire either: after the answer, no
//! request of the endpoint's starts, and none is still being made.
//!
//! The check a lane makes before each attempt is a lookup under a lock no
//! one holds for long: the hot path asks nothing of the api or the broker.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use futures::StreamExt;
use prost::Message;
use relay_contracts::{AttemptKey, StreamNames, relay::queue::v1::SwitchedOff};
use tokio::sync::{Notify, watch};

/// What was switched off, and what is on the wire.
#[derive(Default)]
pub(crate) struct Switches {
    state: Mutex<State>,
    /// Fired whenever an attempt leaves the wire.
    left_wire: Notify,
}

#[derive(Default)]
struct State {
    /// Attempts not to start, each with when it was refused.
    refused: HashMap<AttemptKey, Instant>,
    on_wire: HashSet<AttemptKey>,
}

impl Switches {
    /// Puts an attempt on the wire unless it was switched off; one lock for
    /// both, so a refusal either comes first and is seen here, or comes
    /// after and finds the attempt on the wire (and waits for it).
    fn start(&self, key: &AttemptKey) -> bool {
        let mut state = self.state.lock().expect("unpoisoned");
        if state.refused.contains_key(key) {
            return false;
        }
        state.on_wire.insert(key.clone());
        true
    }

    /// Puts the attempt on the wire (see [`Self::start`]) for as long as
    /// the guard lives; `None` if it was switched off. A guard, so that an
    /// attempt dropped half-way (shutdown) leaves the wire too.
    pub(crate) fn on_wire<'a>(&'a self, key: &'a AttemptKey) -> Option<OnWire<'a>> {
        self.start(key).then_some(OnWire { switches: self, key })
    }

    /// Refuses the attempts from now on, and forgets refusals older than
    /// `keep`: by then the api has long refused their material, and no
    /// copy of it fetched before could still be fresh enough to send.
    fn refuse(&self, keys: &[AttemptKey], keep: Duration) {
        let mut state = self.state.lock().expect("unpoisoned");
        let now = Instant::now();
        state.refused.retain(|_, at| now.duration_since(*at) < keep);
        for key in keys {
            state.refused.insert(key.clone(), now);
        }
    }

    /// Waits until none of the attempts is on the wire, at most `within`
    /// (an attempt ends by its timeout, so the bound is only a guard).
    async fn off_the_wire(&self, keys: &[AttemptKey], within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // Registered before the look, so a departure between the look
            // and the wait is not missed.
            let left = self.left_wire.notified();
            tokio::pin!(left);
            left.as_mut().enable();
            if !keys.iter().any(|k| self.state.lock().expect("unpoisoned").on_wire.contains(k)) {
                return true;
            }
            if tokio::time::timeout_at(deadline, left).await.is_err() {
                return false;
            }
        }
    }
}

/// An attempt on the wire; leaves it when dropped.
pub(crate) struct OnWire<'a> {
    switches: &'a Switches,
    key: &'a AttemptKey,
}

impl Drop for OnWire<'_> {
    fn drop(&mut self) {
        self.switches.state.lock().expect("unpoisoned").on_wire.remove(self.key);
        self.switches.left_wire.notify_waiters();
    }
}

/// Answers the api's switch-off notices for this process (`claimant`) until
/// `stop`: each notice's attempts are refused at once and the answer goes
/// back once none of them is on the wire (at most `on_wire_bound`).
/// `keep`: how long a refusal is remembered.
pub(crate) async fn listen(
    client: async_nats::Client,
    names: StreamNames,
    claimant: String,
    switches: Arc<Switches>,
    (keep, on_wire_bound): (Duration, Duration),
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let subject = names.switched_off_subject(&claimant);
    // The client subscribes again by itself after a reconnect.
    let mut notices = client.subscribe(subject.clone()).await.with_context(|| format!("subscribing to {subject}"))?;
    loop {
        let msg = tokio::select! {
            next = notices.next() => match next {
                Some(msg) => msg,
                None => anyhow::bail!("the subscription to {subject} ended"),
            },
            _ = stop.changed() => return Ok(()),
        };
        let notice = match SwitchedOff::decode(msg.payload.clone()) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "an unreadable switch-off notice; ignored");
                continue;
            }
        };
        let keys: Vec<AttemptKey> = notice.attempts.iter().map(AttemptKey::of).collect();
        switches.refuse(&keys, keep);
        let (switches, client) = (switches.clone(), client.clone());
        // Waiting for one endpoint's attempt on the wire must not hold up
        // the notices about others.
        tokio::spawn(async move {
            let cleared = switches.off_the_wire(&keys, on_wire_bound).await;
            tracing::info!(endpoint_id = %notice.endpoint_id, attempts = keys.len(), cleared, "attempts switched off; none will start");
            if let Some(reply) = msg.reply
                && let Err(e) = client.publish(reply, bytes::Bytes::new()).await
            {
                tracing::warn!(error = %e, "answering a switch-off notice failed; the api waits out the claims instead");
            }
        });
    }
}
