//! Relay's domain, with no I/O: what the services mean by an id, a
//! delivery's state and the decision an attempt's result makes, an
//! endpoint's health and the circuit's rules, the retry schedule, and the
//! reasons a tenant or the seam is told. The api's storage maps its rows to
//! these types (feature `sqlx`); transports map them to the contracts.
//!
//! Every rule here is a pure function of its inputs and the time it is
//! given, unit-tested in this crate.

pub mod catalogue;
pub mod client_identity;
pub mod delivery;
pub mod filter;
pub mod headers;
pub mod health;
pub mod ids;
pub mod models;
pub mod ordering;
pub mod rate;
pub mod reason;
pub mod schedule;
pub mod signing;

/// An instant, as every rule reads and the database stores it (UTC).
pub type Timestamp = chrono::DateTime<chrono::Utc>;

pub use ids::{ApiKeyId, DeadLetterId, DeliveryId, DispatcherId, EndpointId, EnvironmentId, EventId, OperationId};
pub use reason::Reason;
