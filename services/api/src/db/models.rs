//! What `db` returns is the domain's (`relay_domain::models`): re-exported
//! here for the statements that fill them, with the one row parse they
//! share.

pub use relay_domain::{
    Timestamp,
    delivery::{Decision, DeliveryState},
    health::{Circuit, DisabledReason, EndpointHealth, FailureWindow},
    models::{
        ApiKey, Attempt, DeadLetter, Delivery, Endpoint, Environment, EventFilter, HeldDelivery, LoggedEvent, Operation, QueueDepths,
    },
};

/// An endpoint's stored `signature_scheme`, read. The column's CHECK allows
/// only known names; one this build does not know means a newer schema.
pub fn stored_scheme(endpoint_id: relay_domain::EndpointId, stored: &str) -> anyhow::Result<relay_signing::Scheme> {
    relay_signing::Scheme::parse(stored)
        .ok_or_else(|| anyhow::anyhow!("endpoint {endpoint_id} has signature scheme {stored:?}, which this api does not know"))
}
