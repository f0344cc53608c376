//! First attempts an api sends without being asked: each api expands some
//! events as they are published and sends their first attempts, claimed
//! for this process, over a `TakeAttempts` stream that this process keeps
//! open to every api it knows. They join the lanes exactly as attempts
//! handed over in an expansion's answer do.
//!
//! A stream that breaks is opened again after a pause. While it is closed
//! the api sends this process nothing (its events take the outbox relay
//! and EVENTS), so nothing waits on it; attempts the api had queued for a
//! stream that broke are released by the api for its delivery relay.

use std::{sync::Arc, time::Duration};

use relay_contracts::relay::dispatch::v1::{TakeAttemptsRequest, dispatch_service_client::DispatchServiceClient};
use tokio::sync::watch;
use tonic::transport::Channel;

use crate::lanes::LaneSet;

/// The pause before a broken stream is opened again.
const REOPEN_PAUSE: Duration = Duration::from_millis(500);
/// The pause after an api that does not serve `TakeAttempts` (an older
/// one, during a rolling upgrade) before it is asked again.
const UNSERVED_PAUSE: Duration = Duration::from_secs(30);

/// Keeps a `TakeAttempts` stream open to one api until `stop`, handing what
/// it carries to the lanes.
pub(crate) async fn take_loop(
    api: String,
    mut client: DispatchServiceClient<Channel>,
    lanes: Arc<LaneSet>,
    mut stop: watch::Receiver<bool>,
) {
    let (claimant, hold) = lanes.claim();
    let hold_ms = u32::try_from(hold.as_millis()).unwrap_or(u32::MAX);
    loop {
        let pause = tokio::select! {
            pause = take_once(&api, &mut client, &lanes, TakeAttemptsRequest { claimant: claimant.clone(), hold_ms }) => pause,
            _ = stop.changed() => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One stream, read until it ends; how long to wait before the next.
async fn take_once(api: &str, client: &mut DispatchServiceClient<Channel>, lanes: &LaneSet, req: TakeAttemptsRequest) -> Duration {
    let mut stream = match client.take_attempts(req).await {
        Ok(answer) => answer.into_inner(),
        Err(st) if st.code() == tonic::Code::Unimplemented => {
            tracing::info!(api, "this api does not send attempts unasked; every event goes by EVENTS");
            return UNSERVED_PAUSE;
        }
        Err(st) => {
            tracing::debug!(api, code = ?st.code(), message = st.message(), "could not open the stream of attempts; trying again");
            return REOPEN_PAUSE;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(taken)) => {
                for attempt in taken.attempts {
                    tracing::debug!(target: "relay_hops", hop = "expand_answered", event_id = %attempt.event_id);
                    lanes.hand(attempt, None);
                }
            }
            Ok(None) => return REOPEN_PAUSE,
            Err(st) => {
                tracing::debug!(api, code = ?st.code(), message = st.message(), "the stream of attempts broke; opening it again");
                return REOPEN_PAUSE;
            }
        }
    }
}
