//! `webhook_deliveries` and `attempt_claims`: every statement that writes a
//! delivery's state, one function each, by flow: [`expansion`], [`material`]
//! (and claims), [`outcomes`], [`due`] work for the relay, a tenant's
//! [`switch_off`], and the promotions of ordered endpoints' [`lanes`]. What the new state is comes from `relay_domain::delivery`;
//! these functions only store it. How these statements are written so that
//! their plans do not depend on row estimates: see [`crate::db`].

mod due;
mod expansion;
mod filters;
pub mod lanes;
mod material;
mod outcomes;
mod switch_off;

use sqlx::PgConnection;

pub use self::{due::*, expansion::*, filters::*, material::*, outcomes::*, switch_off::*};
use crate::error::AppResult;

/// The Postgres channel that says "deliveries are due now". Every api
/// process's delivery relay listens, so a row written by one api wakes the
/// relays of all of them; delivered at commit, so never before the rows exist.
pub const DUE_CHANNEL: &str = "relay_deliveries_due";

pub async fn notify_due(tx: &mut PgConnection) -> AppResult<()> {
    notify(tx, DUE_NOW).await
}

/// Rows were written waiting behind their endpoints' in-flight caps: no
/// relay pass can take them before an outcome frees a slot, and the outcome
/// that does fills it (see `app::outcomes`), so this tells every api to
/// refill rather than waking its relay for a pass that finds nothing.
pub async fn notify_capped(tx: &mut PgConnection) -> AppResult<()> {
    notify(tx, BEHIND_CAPS).await
}

/// What a notification on [`DUE_CHANNEL`] says.
pub const DUE_NOW: &str = "";
pub const BEHIND_CAPS: &str = "capped";

async fn notify(tx: &mut PgConnection, what: &str) -> AppResult<()> {
    sqlx::query_scalar!(r#"SELECT 1 AS "notified!" FROM pg_notify($1, $2)"#, DUE_CHANNEL, what).fetch_one(&mut *tx).await?;
    Ok(())
}
