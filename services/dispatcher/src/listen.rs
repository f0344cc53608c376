//! Attempts to a listener's endpoint (`relay-dev listen`): signed exactly
//! as an HTTP attempt, but handed over core NATS, on the endpoint's listen
//! subject, to whichever api holds the listener's call, which sends it down
//! the call and replies with what the listener's local receiver answered.
//! The dispatcher opens no connection towards a listener. No api holding
//! the call (it ended) is an attempt that failed, retried by the schedule
//! until the listener's endpoint is removed.

use std::time::Duration;

use prost::Message;
use relay_contracts::{
    StreamNames,
    relay::queue::v1::{HeaderPair, ListenAnswer, ListenAttempt},
};

/// The URL a listener's endpoint has (see the api's `app::listen`).
pub const LISTEN_SCHEME: &str = "listen://";

/// Where listeners' attempts go.
#[derive(Debug)]
pub struct Route {
    pub client: async_nats::Client,
    pub names: StreamNames,
    /// The attempt timeout: as long as an HTTP attempt may take.
    pub timeout: Duration,
}

/// What the listener's receiver answered: its status and the start of its
/// body.
pub struct Answered {
    pub status: u16,
    pub body: Vec<u8>,
}

pub struct Attempt<'a> {
    pub endpoint_id: &'a str,
    pub delivery_id: &'a str,
    pub attempt: u32,
    pub generation: u32,
    pub event_id: &'a str,
}

pub async fn send(route: &Route, a: Attempt<'_>, headers: &reqwest::header::HeaderMap, body: bytes::Bytes) -> Result<Answered, String> {
    let request = ListenAttempt {
        delivery_id: a.delivery_id.to_owned(),
        attempt: a.attempt,
        generation: a.generation,
        event_id: a.event_id.to_owned(),
        headers: headers
            .iter()
            .filter_map(|(n, v)| Some(HeaderPair { name: n.as_str().to_owned(), value: v.to_str().ok()?.to_owned() }))
            .collect(),
        body: body.to_vec(),
    };
    let subject = route.names.listen_subject(a.endpoint_id);
    let asked = route.client.request(subject, request.encode_to_vec().into());
    let reply = match tokio::time::timeout(route.timeout, asked).await {
        Err(_) => return Err(format!("timeout: the listener did not answer within {} s", route.timeout.as_secs())),
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            return Err("listener: no listener is connected for this endpoint".into());
        }
        Ok(Err(e)) => return Err(format!("listener: the broker could not carry the attempt: {e}")),
        Ok(Ok(reply)) => reply,
    };
    let answer = ListenAnswer::decode(reply.payload).map_err(|_| "listener: an answer that could not be read".to_owned())?;
    match answer.http_status {
        Some(status) if (100..=599).contains(&status) => Ok(Answered { status: status as u16, body: answer.response_body }),
        Some(status) => Err(format!("listener: the local receiver answered status {status}, outside 100-599")),
        None => Err(format!("listener: {}", if answer.error.is_empty() { "no answer" } else { &answer.error })),
    }
}
