//! The Postgres pool, guarded against connections left inside a transaction.
//!
//! sqlx 0.9.0's `begin()` is not cancel-safe (transact-rs/sqlx#4393): when its
//! future is dropped while `BEGIN` is on the wire, nothing queues a rollback
//! and the connection returns to the pool inside an open transaction. Every
//! later autocommit statement on it (a publish answered 202, say) then waits
//! for a commit that may never come. Request handling runs detached from the
//! client (see [`crate::detach`]) so that drop should not happen; this pool
//! makes sure that if anything else ever drops a `begin()`, the connection
//! is discarded instead of handed out again.

use std::time::Duration;

use anyhow::{Context, Result};
use sqlx::{PgPool, postgres::PgPoolOptions};

/// First column true only outside a transaction block: sent as one
/// simple-protocol message, it starts its own transaction and both stamps
/// are the time that message arrived; inside a block opened earlier, the
/// transaction's stamp is older. (Over the extended protocol the stamps
/// differ even outside a block: the transaction starts at Parse, the
/// statement's stamp moves on with each later message.) Second column true
/// on a standby: after a failover a connection opened before it may reach a
/// server that no longer takes writes (see [`primary`]).
const FIT_FOR_USE: &str = "SELECT transaction_timestamp() = statement_timestamp(), pg_is_in_recovery()";

/// The pool, and when `url` lists several servers the follower that keeps
/// it on the primary (to be run until shutdown).
pub async fn connect(url: &str, max_connections: u32, acquire_timeout: Duration) -> Result<(PgPool, Option<primary::Follower>)> {
    let servers = primary::Servers::parse(url)?;
    let target = if servers.is_replicated() {
        // A failover may be under way while the api starts: wait for a primary
        // as long as a call would wait for a connection, and at least 30 s.
        servers.find_primary(acquire_timeout.max(Duration::from_secs(30))).await?
    } else {
        servers.first().clone()
    };
    tracing::info!(server = %primary::address(&target), servers = ?servers, "connecting to Postgres");
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        // The check below is a round trip that also proves the connection
        // alive, so it replaces sqlx's own ping rather than adding to it.
        .test_before_acquire(false)
        .before_acquire(|conn, _meta| {
            Box::pin(async move {
                let row = sqlx::raw_sql(FIT_FOR_USE).fetch_one(&mut *conn).await?;
                let idle: bool = sqlx::Row::try_get(&row, 0)?;
                let standby: bool = sqlx::Row::try_get(&row, 1)?;
                if !idle {
                    tracing::warn!("discarding a pooled Postgres connection left inside a transaction");
                }
                if standby {
                    tracing::warn!("discarding a pooled Postgres connection to a standby");
                }
                Ok(idle && !standby)
            })
        })
        .connect_with(target)
        .await
        .context("connecting to Postgres")?;
    let follower = servers.is_replicated().then(|| primary::Follower { servers, pool: pool.clone() });
    Ok((pool, follower))
}

pub mod attempt_stats;
pub mod attempts;
pub mod dead_letters;
pub mod deliveries;
pub mod depths;
pub mod endpoints;
pub mod environments;
pub mod events;
pub mod health;
pub mod keys;
pub mod lane;
pub mod models;
pub mod operations;
pub mod portal;
pub mod primary;
pub mod retention;

/// A duration as a statement's interval parameter.
pub fn interval(d: Duration) -> crate::error::AppResult<sqlx::postgres::types::PgInterval> {
    Ok(sqlx::postgres::types::PgInterval::try_from(d).map_err(|e| anyhow::anyhow!("{d:?} is not an interval: {e}"))?)
}

/// Whether Postgres answers a query now (readiness).
pub async fn answers(db: &PgPool) -> bool {
    sqlx::query_scalar!("SELECT 1 AS one").fetch_one(db).await.is_ok()
}
