//! Use-cases, free of any transport: the gRPC adapters and the relays call
//! these. Each takes the tenant's environment as an argument resolved from a
//! verified credential, never from the request body.

pub mod admin;
pub mod deliveries;
pub mod endpoints;
pub mod events;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use relay_netguard::Policy;
use sqlx::PgPool;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::{
    error::{AppError, AppResult},
    schedule::RetrySchedule,
    secrets::Keyring,
};

/// Wakes a relay that is asleep waiting for work.
#[derive(Debug, Clone, Default)]
pub struct Wake(Arc<Notify>);

impl Wake {
    pub fn wake(&self) {
        self.0.notify_one();
    }

    pub async fn wait(&self) {
        self.0.notified().await
    }
}

#[derive(Debug, Clone)]
pub struct App {
    pub db: PgPool,
    pub keyring: Keyring,
    pub url_policy: Policy,
    pub resolver: std::sync::Arc<dyn relay_netguard::Resolve>,
    pub schedule: RetrySchedule,
    pub outbox_wake: Wake,
    pub deliveries_wake: Wake,
    pub metrics: crate::metrics::Metrics,
}

/// An environment, resolved from a verified credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant {
    pub environment_id: Uuid,
}

pub type Timestamp = DateTime<Utc>;

pub(crate) fn require_nonempty(field: &'static str, value: &str) -> AppResult<()> {
    if value.trim().is_empty() {
        return Err(AppError::invalid("missing_field", format!("{field} is required")));
    }
    Ok(())
}
