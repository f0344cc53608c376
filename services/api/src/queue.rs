//! The DELIVERIES queue as the api hands work to it: what a job message
//! carries, and the publisher the use-cases see as a trait (so they hold no
//! broker connection of their own). The delivery relay and the expansion's
//! direct dispatch both publish through here, under the same message ids.

use std::{future::Future, pin::Pin};

use async_nats::{HeaderMap, jetstream};
use prost::Message;
use relay_contracts::{StreamNames, relay::queue::v1::DeliveryJob};
use relay_domain::{DeliveryId, EndpointId, EnvironmentId};

/// One attempt to hand to the broker.
pub struct Job<'a> {
    pub delivery_id: DeliveryId,
    pub endpoint_id: EndpointId,
    pub environment_id: EnvironmentId,
    pub attempt: i32,
    pub generation: i32,
    pub trace_context: Option<&'a str>,
}

/// The DELIVERIES message for an attempt: ids only, deduplicated by
/// `<delivery>:<attempt>` (and generation), with a short span in the event's
/// trace whose context rides in the headers to the attempt.
pub fn job_message(names: &StreamNames, j: &Job<'_>) -> (String, HeaderMap, bytes::Bytes) {
    let job = DeliveryJob {
        delivery_id: j.delivery_id.to_string(),
        endpoint_id: j.endpoint_id.to_string(),
        environment_id: j.environment_id.to_string(),
        attempt: j.attempt as u32,
        generation: j.generation as u32,
    };
    let mut headers = HeaderMap::new();
    let span = tracing::info_span!("delivery_relay", delivery_id = %j.delivery_id, attempt = j.attempt, generation = j.generation);
    if let Some(tc) = j.trace_context {
        relay_telemetry::set_parent_from_traceparent(&span, tc);
    }
    span.in_scope(|| relay_telemetry::inject_current(&mut relay_telemetry::NatsHeaders(&mut headers)));
    headers.insert("Nats-Msg-Id", relay_contracts::AttemptKey::of(&job).to_string().as_str());
    (names.deliveries_subject(&job.environment_id), headers, job.encode_to_vec().into())
}

/// Which jobs the broker stored, in order, and the first error if any was refused.
pub type Stored = (Vec<bool>, Option<anyhow::Error>);

/// Hands jobs to the broker.
pub trait JobQueue: Send + Sync {
    fn publish<'a>(&'a self, jobs: &'a [Job<'a>]) -> Pin<Box<dyn Future<Output = Stored> + Send + 'a>>;
}

/// The DELIVERIES stream of one NATS JetStream.
pub struct NatsJobs {
    pub js: jetstream::Context,
    pub names: StreamNames,
}

impl JobQueue for NatsJobs {
    fn publish<'a>(&'a self, jobs: &'a [Job<'a>]) -> Pin<Box<dyn Future<Output = Stored> + Send + 'a>> {
        Box::pin(async move {
            let messages = jobs.iter().map(|j| job_message(&self.names, j)).collect();
            crate::broker::publish_all(&self.js, messages).await
        })
    }
}
