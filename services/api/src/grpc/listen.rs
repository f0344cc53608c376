//! The listener's call (`relay-dev listen`, `app::listen`): opens the
//! listener's endpoint, then relays: each attempt a dispatcher sends on the
//! endpoint's core-NATS subject goes down the call as a `forward`, and the
//! listener's `result` goes back as the NATS reply, which the dispatcher
//! reports as the attempt's outcome. Every api can hold calls: the subject
//! reaches whichever holds this one. While the call lasts it is stamped
//! alive; when it ends, its grace period starts (the upkeep does the rest),
//! and attempts it had not answered are answered "disconnected".

use std::{collections::HashMap, pin::Pin};

use futures::{Stream, StreamExt};
use prost::Message;
use relay_contracts::{
    StreamNames,
    relay::{
        queue::v1::{ListenAnswer, ListenAttempt},
        tenant::v1::{self as pb, listen_service_server::ListenService},
    },
};
use relay_domain::{EndpointId, Reason};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::status;
use crate::{
    app::{App, listen::STAMP_EVERY},
    auth,
    error::AppError,
};

pub struct ListenApi {
    pub app: App,
    pub nats: async_nats::Client,
    pub names: StreamNames,
}

type Forwards = Pin<Box<dyn Stream<Item = Result<pb::ListenResponse, Status>> + Send>>;

fn refused(message: &str) -> Status {
    status(AppError::invalid(Reason::MissingField, message))
}

#[tonic::async_trait]
impl ListenService for ListenApi {
    type ListenStream = Forwards;

    async fn listen(&self, req: Request<Streaming<pb::ListenRequest>>) -> Result<Response<Forwards>, Status> {
        let tenant = auth::tenant(&self.app, &req).await?;
        let key_prefix = auth::key_prefix(&req)?;
        let mut inbound = req.into_inner();
        let start = match inbound.message().await? {
            Some(pb::ListenRequest { kind: Some(pb::listen_request::Kind::Start(start)) }) => start,
            _ => return Err(refused("a listen call starts with `start` (the event types to receive)")),
        };
        let (endpoint, secret) = self.app.open_listener(tenant, &key_prefix, &start.event_types).await.map_err(status)?;
        let subject = self.names.listen_subject(&endpoint.id.to_string());
        let attempts = self.nats.subscribe(subject).await.map_err(|e| Status::unavailable(format!("the broker is unreachable: {e}")))?;
        let (tx, rx) = mpsc::channel(64);
        let ready = pb::ListenReady {
            endpoint_id: endpoint.id.to_string(),
            secret: secret.expose().to_owned(),
            signature_scheme: endpoint.signature_scheme.as_str().to_owned(),
        };
        let _ = tx.send(Ok(pb::ListenResponse { kind: Some(pb::listen_response::Kind::Ready(ready)) })).await;
        tokio::spawn(relay(self.app.clone(), self.nats.clone(), endpoint.id, inbound, attempts, tx));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// Relays attempts and results until the call, the listener or the broker
/// subscription ends.
async fn relay(
    app: App,
    nats: async_nats::Client,
    id: EndpointId,
    mut inbound: Streaming<pb::ListenRequest>,
    mut attempts: async_nats::Subscriber,
    tx: mpsc::Sender<Result<pb::ListenResponse, Status>>,
) {
    let mut waiting: HashMap<String, async_nats::Subject> = HashMap::new();
    let mut stamp = tokio::time::interval(STAMP_EVERY);
    stamp.tick().await;
    loop {
        tokio::select! {
            msg = attempts.next() => {
                let Some(msg) = msg else { break };
                let (Some(reply), Ok(a)) = (msg.reply, ListenAttempt::decode(msg.payload)) else { continue };
                let forward_id = uuid::Uuid::new_v4().to_string();
                let forward = pb::ListenForward {
                    forward_id: forward_id.clone(),
                    delivery_id: a.delivery_id,
                    attempt: a.attempt,
                    event_id: a.event_id,
                    headers: a.headers.into_iter().map(|h| pb::ListenHeader { name: h.name, value: h.value }).collect(),
                    body: a.body,
                };
                if tx.send(Ok(pb::ListenResponse { kind: Some(pb::listen_response::Kind::Forward(forward)) })).await.is_err() {
                    answer(&nats, reply, ListenAnswer { error: "the listener disconnected before it was sent".into(), ..Default::default() }).await;
                    break;
                }
                waiting.insert(forward_id, reply);
            }
            req = inbound.message() => match req {
                Ok(Some(pb::ListenRequest { kind: Some(pb::listen_request::Kind::Result(r)) })) => {
                    if let Some(reply) = waiting.remove(&r.forward_id) {
                        let mut body = r.response_body;
                        body.truncate(relay_contracts::RESPONSE_BODY_KEPT_BYTES);
                        answer(&nats, reply, ListenAnswer { http_status: r.http_status, error: r.error, response_body: body }).await;
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            },
            _ = stamp.tick() => match app.stamp_listener(id).await {
                Ok(true) => {}
                // Deleted (by the tenant, or removed after its api lost it).
                Ok(false) => {
                    let _ = tx.send(Err(Status::failed_precondition("this listener's endpoint was deleted"))).await;
                    break;
                }
                Err(e) => tracing::warn!(error = ?e, "stamping a listener failed; trying again"),
            },
            _ = tx.closed() => break,
        }
    }
    let _ = attempts.unsubscribe().await;
    for (_, reply) in waiting {
        answer(&nats, reply, ListenAnswer { error: "the listener disconnected before answering".into(), ..Default::default() }).await;
    }
    if let Err(e) = app.end_listener(id).await {
        tracing::warn!(error = ?e, endpoint_id = %id, "recording a listener's end failed; its api's silence ends it");
    }
}

async fn answer(nats: &async_nats::Client, reply: async_nats::Subject, a: ListenAnswer) {
    if let Err(e) = nats.publish(reply, a.encode_to_vec().into()).await {
        tracing::warn!(error = %e, "answering a listener's attempt failed; the dispatcher's wait runs out");
    }
}
