//! How a lane's outcomes reach the api: each report on a task of its own
//! (the lane moves on meanwhile), and those the api did not take reported
//! again in the background (see `crate::unreported`).

use std::sync::Arc;

use relay_contracts::{
    AttemptKey,
    relay::{dispatch::v1::OutcomeRequest, queue::v1::DeliveryJob},
};
use tokio::sync::watch;
use tracing::Instrument as _;

use super::LaneShared;
use crate::{
    settle::{Reporting, Source, report},
    unreported,
};

impl LaneShared {
    /// Reports an attempt's outcome on a task of its own, then gives its
    /// key back (see `Unsettled`), a lane follower's noted as sent lately.
    /// `urgent`: see `report`.
    pub(super) fn report_spawned(
        self: &Arc<Self>,
        source: Arc<Source>,
        job: DeliveryJob,
        event_id: String,
        outcome: OutcomeRequest,
        (urgent, follower): (bool, bool),
        span: tracing::Span,
    ) {
        let shared = self.clone();
        tokio::spawn(
            async move {
                let to = Reporting { outcomes: &shared.outcomes, unreported: &shared.unreported, hand: |next| shared.hand(next, None) };
                report(&to, &source, &job, &event_id, outcome, urgent).await;
                let key = AttemptKey::of(&job);
                if follower {
                    shared.sent_lately.note(key.clone());
                }
                shared.unsettled.lock().expect("unpoisoned").remove(&key);
            }
            .instrument(span),
        );
    }

    /// Reports the outcomes the api has not taken again, in the
    /// background, until `stop`; each attempt is in hand while its report is
    /// on the way.
    pub(super) fn start_retrying(self: &Arc<Self>, stop: watch::Receiver<bool>) {
        let shared = self.clone();
        tokio::spawn(async move {
            let busy = |key: &AttemptKey, on: bool| {
                let mut unsettled = shared.unsettled.lock().expect("unpoisoned");
                if on {
                    unsettled.insert(key.clone());
                } else {
                    unsettled.remove(key);
                }
            };
            unreported::retry(&shared.unreported, &shared.outcomes, busy, |next| shared.hand(next, None), stop).await
        });
    }
}
