//! Publishing events into the outbox, and reading what became of them.

use anyhow::Context;
use relay_domain::{DeliveryId, EnvironmentId, EventId, Reason};
use serde::Serialize;
use serde_json::value::RawValue;

use super::{App, Tenant, Timestamp, check_time, endpoints::check_event_type, require_nonempty};
pub use crate::db::models::{Attempt, Delivery};
use crate::{
    db,
    error::{AppError, AppResult},
};

/// The webhook body. Serialised once, at publish time, and stored as bytes:
/// every attempt sends exactly these bytes, so the body a recipient verifies
/// never changes between attempts.
#[derive(Serialize)]
struct Envelope<'a> {
    id: EventId,
    #[serde(rename = "type")]
    event_type: &'a str,
    environment_id: EnvironmentId,
    occurred_at: String,
    /// The tenant's JSON text, exactly as published.
    payload: &'a RawValue,
}

/// Payloads are bounded so one request cannot fill the outbox.
pub const MAX_ENVELOPE_BYTES: usize = 256 * 1024;
/// The deepest nesting of arrays and objects a payload may have. Receivers
/// parse what we send: common parsers stop at 128 (serde_json) or a few
/// hundred levels, so this leaves them room for the envelope and their own.
pub const MAX_PAYLOAD_DEPTH: usize = 64;

/// How deeply arrays and objects nest in JSON text (one pass that never
/// recurses, safe on any input); the filter language bounds its own with it.
pub use relay_domain::filter::json_depth;

/// A payload as JSON text, checked: bounded in size and nesting, and one
/// valid JSON value. Empty text is JSON `null`. Nothing is re-serialised, so
/// what is delivered is what was published, digit for digit and key by key.
pub fn checked_payload(text: &str) -> AppResult<&RawValue> {
    let text = text.trim_matches(|c| matches!(c, ' ' | '\t' | '\n' | '\r'));
    let text = if text.is_empty() { "null" } else { text };
    if text.len() > MAX_ENVELOPE_BYTES {
        return Err(AppError::invalid(
            Reason::PayloadTooLarge,
            format!("a payload may be at most {MAX_ENVELOPE_BYTES} bytes as delivered; this one is {}", text.len()),
        ));
    }
    let depth = json_depth(text.as_bytes());
    if depth > MAX_PAYLOAD_DEPTH {
        return Err(AppError::invalid(
            Reason::PayloadTooDeep,
            format!("a payload may nest arrays and objects at most {MAX_PAYLOAD_DEPTH} deep; this one nests {depth}"),
        ));
    }
    serde_json::from_str::<&RawValue>(text)
        .map_err(|e| AppError::invalid(Reason::InvalidPayload, format!("payload is not valid JSON: {e}")))
}

/// The bytes every attempt of an event sends: its envelope around the
/// payload text, which is kept exactly as given. Public for the micro
/// benchmarks.
pub fn envelope(
    id: EventId,
    event_type: &str,
    environment_id: EnvironmentId,
    occurred_at: Timestamp,
    payload: &RawValue,
) -> AppResult<Vec<u8>> {
    Ok(serde_json::to_vec(&Envelope {
        id,
        event_type,
        environment_id,
        occurred_at: occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        payload,
    })
    .context("serialising an envelope")?)
}

pub use super::outbox_offers::OutboxOffers;

/// An event to write, as the publish batcher takes it.
#[derive(Debug)]
pub struct NewEvent {
    pub id: EventId,
    pub environment_id: EnvironmentId,
    pub event_type: String,
    pub envelope: Vec<u8>,
    pub occurred_at: Timestamp,
    pub trace_context: Option<String>,
    pub ordering_key: Option<String>,
}

/// What a publish wrote: the event's place in the outbox and, with an
/// ordering key, in its key's publish order.
#[derive(Debug, Clone, Copy)]
pub struct Written {
    pub seq: i64,
    pub ordering_sequence: Option<i64>,
}

#[derive(Debug, Clone, Copy)]
pub struct Published {
    pub event_id: EventId,
    pub duplicate: bool,
    /// The event's number in its key's publish order (from 1, no gaps);
    /// `None` without a key, or for a duplicate.
    pub ordering_sequence: Option<i64>,
}

impl App {
    pub async fn publish_event(
        &self,
        tenant: Tenant,
        id: Option<EventId>,
        event_type: &str,
        payload: &str,
        ordering_key: &str,
    ) -> AppResult<Published> {
        require_nonempty("type", event_type)?;
        let event_type = event_type.trim();
        check_event_type(event_type)?;
        // Taken as sent (no trimming): a key is an id the tenant compares.
        let ordering_key = (!ordering_key.is_empty()).then(|| ordering_key.to_owned());
        if let Some(key) = &ordering_key {
            relay_domain::ordering::check_key(key).map_err(|m| AppError::invalid(Reason::InvalidOrderingKey, m))?;
        }
        let payload = checked_payload(payload)?;
        // The environment's catalogue and publish limit, read once.
        let catalogue = self.known_catalogue(tenant.environment_id).await?;
        self.check_against_catalogue(&catalogue, event_type, payload.get())?;
        let event_id = id.unwrap_or_else(EventId::mint);
        let occurred_at = self.clock.now();
        let envelope = envelope(event_id, event_type, tenant.environment_id, occurred_at, payload)?;
        if envelope.len() > MAX_ENVELOPE_BYTES {
            return Err(AppError::invalid(
                Reason::PayloadTooLarge,
                format!("an event may be at most {MAX_ENVELOPE_BYTES} bytes as delivered; this one is {}", envelope.len()),
            ));
        }

        // Last of the checks: a request refused for its content takes
        // nothing from the environment's publish limit.
        self.admit_publish(tenant.environment_id, &catalogue).await?;

        // The event row is the outbox row: one insert, through the publish
        // batcher (concurrent publishes share its statements and commits). Ids
        // are unique per environment, so a conflict is this tenant's own
        // earlier publish of the same id. The relays continue this trace
        // from the row.
        let trace_context = relay_telemetry::current_traceparent();
        let ordered = ordering_key.is_some();
        let new = NewEvent {
            id: event_id,
            environment_id: tenant.environment_id,
            event_type: event_type.to_owned(),
            envelope,
            occurred_at,
            trace_context: trace_context.clone(),
            ordering_key,
        };
        let written = self.batchers().publishes.call(new).await?;
        if let Some(Written { seq, .. }) = written {
            tracing::debug!(target: "relay_hops", hop = "publish_written", event_id = %event_id);
            let row = crate::db::events::OutboxRow {
                seq,
                id: event_id,
                environment_id: tenant.environment_id,
                event_type: event_type.to_owned(),
                trace_context,
                target_endpoint_id: None,
            };
            // Expanded here and sent straight to a dispatcher when nothing
            // waits ahead of it (`at_publish`); else to this process's
            // outbox relay, which publishes it without looking for it,
            // unless it is catching up on a backlog.
            if let Err(row) = self.expand_at_publish(row, ordered) {
                self.outbox_offers.offer(row, ordered);
                self.outbox_wake.wake();
            }
        }
        Ok(Published { event_id, duplicate: written.is_none(), ordering_sequence: written.and_then(|w| w.ordering_sequence) })
    }

    /// One batch of the publish batcher: every event in one insert (a batch
    /// with keyed events locks its keys first and numbers them as they are
    /// written). Each answers with what
    /// this publish wrote, `None` if the environment already had an event
    /// with its id.
    pub(crate) async fn insert_events_on(
        &self,
        conn: &mut sqlx::PgConnection,
        events: &[NewEvent],
    ) -> AppResult<Vec<AppResult<Option<Written>>>> {
        let mut rows = db::events::NewEvents::default();
        for e in events {
            rows.id.push(e.id);
            rows.environment_id.push(e.environment_id);
            rows.event_type.push(e.event_type.clone());
            rows.envelope.push(e.envelope.clone());
            rows.occurred_at.push(e.occurred_at);
            rows.trace_context.push(e.trace_context.clone());
            rows.ordering_key.push(e.ordering_key.clone());
        }
        let (key_environments, keys): (Vec<EnvironmentId>, Vec<String>) =
            events.iter().filter_map(|e| e.ordering_key.clone().map(|k| (e.environment_id, k))).unzip();
        let inserted = if keys.is_empty() {
            // The common case: one statement, committed by itself.
            db::events::insert(conn, &rows).await?
        } else {
            // Keys first (see `lock_keys`), then the events with their
            // numbers, in one transaction: nobody sees a keyed event without
            // its number, and the keys stay locked until the commit.
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            db::events::lock_keys(&mut tx, &key_environments, &keys).await?;
            match db::events::insert_numbered(&mut tx, &rows).await? {
                Some(inserted) => {
                    tx.commit().await?;
                    inserted
                }
                None => {
                    tx.rollback().await?;
                    insert_then_number(conn, &rows, &key_environments, &keys).await?
                }
            }
        };
        let mut written_of: std::collections::HashMap<(EnvironmentId, EventId), Written> = inserted
            .iter()
            .map(|e| {
                let key = (e.environment_id, e.id);
                (key, Written { seq: e.seq, ordering_sequence: e.ordering_sequence })
            })
            .collect();
        // The same id twice in one batch: the first is the one written.
        Ok(events.iter().map(|e| Ok(written_of.remove(&(e.environment_id, e.id)))).collect())
    }

    pub async fn list_event_deliveries(&self, tenant: Tenant, event_id: EventId) -> AppResult<Vec<Delivery>> {
        // One snapshot for the deliveries and their attempt logs: read apart,
        // an outcome committing in between would show a delivery still dead
        // beside the attempt that made it delivered.
        let mut tx = self.db.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY").await?;
        let exists = db::events::exists(&mut tx, tenant.environment_id, event_id).await?;
        if !exists {
            return Err(AppError::not_found("event"));
        }
        let mut deliveries = db::events::deliveries_of(&mut tx, tenant.environment_id, event_id).await?;
        let ids: Vec<DeliveryId> = deliveries.iter().map(|d| d.id).collect();
        let attempts = db::attempts::of_deliveries(&mut tx, tenant.environment_id, &ids).await?;
        for a in attempts {
            if let Some(d) = deliveries.iter_mut().find(|d| d.id == a.delivery_id) {
                d.attempts.push(a);
            }
        }
        tx.commit().await?;
        Ok(deliveries)
    }
}

/// How many events a page of the event log shows.
pub const EVENT_PAGE: i64 = 50;

impl App {
    /// A page of the tenant's events, newest first.
    pub async fn list_events(
        &self,
        tenant: Tenant,
        filter: &relay_domain::models::EventFilter,
    ) -> AppResult<Vec<relay_domain::models::LoggedEvent>> {
        // Checked before Postgres sees it: text cannot hold a NUL, and a
        // time out of its range fails the statement (a 500, not the
        // caller's mistake named). No event has a type the rule refuses.
        if let Some(t) = &filter.event_type {
            check_event_type(t)?;
        }
        for (field, t) in [("since", filter.since), ("until", filter.until), ("before", filter.before.map(|(at, _)| at))] {
            if let Some(t) = t {
                check_time(field, t)?;
            }
        }
        db::events::list_recent(&self.db, tenant.environment_id, filter, EVENT_PAGE).await
    }

    /// One of the tenant's events.
    pub async fn get_event(&self, tenant: Tenant, id: EventId) -> AppResult<db::events::StoredEvent> {
        db::events::get(&self.db, tenant.environment_id, id).await?.ok_or_else(|| AppError::not_found("event"))
    }
}

/// The long way of a keyed batch, for when a repeat of one of its ids
/// committed under another key while it was being written
/// (`db::events::insert_numbered`): the keys, the events, then numbers for
/// the events written and no others, so a repeat publish leaves no gap in
/// its key's order.
async fn insert_then_number(
    conn: &mut sqlx::PgConnection,
    rows: &db::events::NewEvents,
    key_environments: &[EnvironmentId],
    keys: &[String],
) -> AppResult<Vec<db::events::Inserted>> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    db::events::lock_keys(&mut tx, key_environments, keys).await?;
    let mut inserted = db::events::insert(&mut tx, rows).await?;
    let keyed: Vec<&db::events::Inserted> = inserted.iter().filter(|e| e.ordering_key.is_some()).collect();
    let numbers = if keyed.is_empty() { Vec::new() } else { db::events::number_by_key(&mut tx, &keyed).await? };
    tx.commit().await?;
    let mut number_of: std::collections::HashMap<(EnvironmentId, EventId), i64> =
        numbers.into_iter().map(|(env, id, n)| ((env, id), n)).collect();
    for e in &mut inserted {
        e.ordering_sequence = number_of.remove(&(e.environment_id, e.id));
    }
    Ok(inserted)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Depth the slow, obvious way: through a parsed value.
    fn parsed_depth(v: &serde_json::Value) -> usize {
        match v {
            serde_json::Value::Array(a) => 1 + a.iter().map(parsed_depth).max().unwrap_or(0),
            serde_json::Value::Object(o) => 1 + o.values().map(parsed_depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(Into::into),
            any::<i64>().prop_map(Into::into),
            any::<u64>().prop_map(Into::into),
            "[\\PC\"\\\\{}\\[\\]]{0,12}".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(8, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                prop::collection::btree_map("[a-z\"{}\\[\\]\\\\]{0,6}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn the_scanner_measures_depth_as_a_parser_does(v in json_value(), pretty in any::<bool>()) {
            let text = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { serde_json::to_string(&v).unwrap() };
            prop_assert_eq!(json_depth(text.as_bytes()), parsed_depth(&v));
        }

        #[test]
        fn a_checked_payload_is_the_text_as_given(v in json_value()) {
            let text = serde_json::to_string_pretty(&v).unwrap();
            if parsed_depth(&v) <= MAX_PAYLOAD_DEPTH {
                prop_assert_eq!(checked_payload(&text).unwrap().get(), text.as_str());
            }
        }

        #[test]
        fn arbitrary_text_is_refused_or_kept_never_a_panic(text in "\\PC{0,64}") {
            if let Ok(raw) = checked_payload(&text) {
                prop_assert!(serde_json::from_str::<serde_json::Value>(raw.get()).is_ok());
            }
        }
    }

    #[test]
    fn nesting_up_to_the_limit_is_accepted_and_deeper_refused() {
        for depth in [1, 33, 34, 50, MAX_PAYLOAD_DEPTH] {
            let text = format!("{}{}", "{\"a\":".repeat(depth), "1") + &"}".repeat(depth);
            checked_payload(&text).unwrap_or_else(|e| panic!("depth {depth}: {e:?}"));
        }
        let deep = "[".repeat(MAX_PAYLOAD_DEPTH + 1) + &"]".repeat(MAX_PAYLOAD_DEPTH + 1);
        assert_eq!(checked_payload(&deep).unwrap_err().reason, Reason::PayloadTooDeep);
        let very_deep = "[".repeat(1_000_000);
        assert_eq!(checked_payload(&very_deep).unwrap_err().reason, Reason::PayloadTooLarge);
    }

    #[test]
    fn numbers_keys_and_duplicates_stay_as_written() {
        let text = r#"{"id": 9007199254740993, "max": 18446744073709551615, "min": -9223372036854775808, "b": 1, "a": 2.50, "b": 1e400}"#;
        assert_eq!(checked_payload(text).unwrap().get(), text);
        assert_eq!(checked_payload("").unwrap().get(), "null");
        assert_eq!(checked_payload("{\"a\": 1} {}").unwrap_err().reason, Reason::InvalidPayload);
    }
}
