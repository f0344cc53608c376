//! Payload filters at expansion: which (event, endpoint) pairs of a batch
//! a filter refuses, so that the expansion statement writes no delivery for
//! them and a non-matching event costs nothing downstream.
//!
//! Invariants:
//! - the filters are read after the events were published (a dispatcher
//!   asks for an expansion only once the event is in the stream), so an
//!   event published after a filter change is always judged by the new
//!   filter; a change that lands between this read and the statement
//!   concerns only events published before it;
//! - an endpoint without a filter, and an operational event's one target,
//!   are never looked at here;
//! - a filter is judged on the payload exactly as published (numbers as
//!   written, see `relay_domain::filter`); a stored filter that no longer
//!   parses (it cannot, it was checked when written) refuses nothing and is
//!   logged.

use std::collections::HashMap;

use relay_domain::{
    EndpointId, EnvironmentId, EventId,
    filter::{Document, Filter},
};
use serde_json::value::RawValue;
use sqlx::PgConnection;

use super::deliveries::ExpandItem;
use crate::{db, error::AppResult};

/// Pairs a filter refused, by the ask's position (from 1) and endpoint:
/// the expansion statement's `$10`/`$11`.
#[derive(Debug, Default)]
pub(super) struct Refused {
    pub ord: Vec<i64>,
    pub endpoint_id: Vec<EndpointId>,
}

#[derive(serde::Deserialize)]
struct Envelope<'a> {
    #[serde(borrow)]
    payload: &'a RawValue,
}

/// The filtered endpoints a batch's asks must be judged against, and the
/// judgement.
pub(super) async fn refused(conn: &mut PgConnection, asks: &[&ExpandItem]) -> AppResult<Refused> {
    let mut environments: Vec<EnvironmentId> = asks.iter().filter(|a| a.target.is_none()).map(|a| a.environment_id).collect();
    environments.sort_unstable();
    environments.dedup();
    if environments.is_empty() {
        return Ok(Refused::default());
    }
    let endpoints = db::deliveries::filtered_endpoints(conn, &environments).await?;
    if endpoints.is_empty() {
        return Ok(Refused::default());
    }
    let filters: Vec<(&db::deliveries::FilteredEndpoint, Filter)> = endpoints
        .iter()
        .filter_map(|e| match Filter::parse(&e.filter) {
            Ok(f) => Some((e, f)),
            Err(err) => {
                tracing::error!(endpoint_id = %e.id, error = %err, "a stored payload filter does not parse; it refuses nothing");
                None
            }
        })
        .collect();
    // Each ask with the filters that apply to it.
    let judged: Vec<(usize, Vec<&(&db::deliveries::FilteredEndpoint, Filter)>)> = asks
        .iter()
        .enumerate()
        .filter(|(_, a)| a.target.is_none())
        .map(|(i, a)| {
            let applying = filters
                .iter()
                .filter(|(e, _)| e.environment_id == a.environment_id && e.event_types.contains(&a.event_type))
                .collect::<Vec<_>>();
            (i, applying)
        })
        .filter(|(_, applying)| !applying.is_empty())
        .collect();
    if judged.is_empty() {
        return Ok(Refused::default());
    }
    let (env_ids, event_ids): (Vec<EnvironmentId>, Vec<EventId>) =
        judged.iter().map(|(i, _)| (asks[*i].environment_id, asks[*i].event_id)).unzip();
    let bodies: HashMap<(EnvironmentId, EventId), Vec<u8>> = db::deliveries::event_bodies(conn, &env_ids, &event_ids)
        .await?
        .into_iter()
        .map(|b| ((b.environment_id, b.id), b.envelope))
        .collect();
    let mut out = Refused::default();
    for (i, applying) in judged {
        let ask = asks[i];
        // No body: no such event, which the statement answers for.
        let Some(body) = bodies.get(&(ask.environment_id, ask.event_id)) else { continue };
        let envelope: Envelope<'_> = match serde_json::from_slice(body) {
            Ok(e) => e,
            Err(err) => {
                tracing::error!(event_id = %ask.event_id, error = %err, "a stored envelope does not parse; no filter refuses it");
                continue;
            }
        };
        let document = Document::new(envelope.payload);
        for (endpoint, filter) in applying {
            if !filter.matches(&document) {
                out.ord.push(i as i64 + 1);
                out.endpoint_id.push(endpoint.id);
            }
        }
    }
    Ok(out)
}
