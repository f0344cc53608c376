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
//!
//! Statements whose plans must not depend on row estimates (a fresh
//! install has none worth trusting) follow two rules, named where they apply:
//!
//! `INDEXED_LOOKUPS`: a statement that joins a table to an `UNNEST` of ids
//! also says `id = ANY ($ids)`. Joined alone, the plan depends on the table's
//! size when the statement was planned: a plan cached while the table was
//! small (a fresh install, a pooled connection's first minutes) hashes the
//! ids and scans the whole table, and keeps doing so as the table grows
//! until an ANALYZE replaces it (seen: 8,700 rows read per material call at
//! 20,000 deliveries). With the ids as an index condition the primary key
//! serves the lookup at any size.
//!
//! `JOINS_BY_ESTIMATE`: the planner joins two row sets by nested loop when
//! it expects one of them to hold a row, and it expects one row of most
//! intermediate results of these statements: of a CTE joined to another on
//! two keys, of the rows a data-modifying CTE returns, of deliveries read by
//! id and filtered on a state the statistics say is rare. For a batch of n
//! items such a loop compares n² pairs, and re-reads (and re-forms, with
//! whole-row copies for an UPDATE's `FROM`) the inner set n times: 102,080
//! pairs for an expansion of 32 events to 10 endpoints, 65,280 for an
//! outcome batch of 256, most of the database's CPU per delivery under load.
//! So these statements do not join batch-sized sets to each other: each
//! step carries forward what the later ones need (ids minted before the
//! insert that uses them, a report's values in `RETURNING`), and a batch
//! meets a table only through an index.

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
pub mod batcher;
pub mod dead_letters;
pub mod deliveries;
pub mod depths;
pub mod endpoint_secrets;
pub mod endpoints;
pub mod environments;
pub mod event_types;
pub mod events;
pub mod health;
pub mod keys;
pub mod listeners;
pub mod models;
pub mod operations;
pub mod portal;
pub mod primary;
pub mod retention;
pub mod statistics;

/// A duration as a statement's interval parameter, in whole microseconds:
/// an interval holds no finer, and `PgInterval` refuses a duration that is
/// (one measured with `Instant::elapsed`, say) rather than round it.
pub fn interval(d: Duration) -> crate::error::AppResult<sqlx::postgres::types::PgInterval> {
    let d = Duration::from_micros(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    Ok(sqlx::postgres::types::PgInterval::try_from(d).map_err(|e| anyhow::anyhow!("{d:?} is not an interval: {e}"))?)
}

/// Whether a `timestamptz` can hold `t`. Postgres's range starts at its
/// Julian day 0, 4714-11-24 BC (proleptic year -4713) at midnight UTC, and
/// ends after 294276 AD, beyond the last year `chrono` represents (262143),
/// so only the start can be passed. A time outside it fails the statement
/// that binds it, as a server error, so callers' times are checked first.
pub fn storable(t: models::Timestamp) -> bool {
    let earliest = chrono::NaiveDate::from_ymd_opt(-4713, 11, 24).expect("a valid date").and_time(chrono::NaiveTime::MIN).and_utc();
    t >= earliest
}

/// Whether Postgres answers a query now (readiness).
pub async fn answers(db: &PgPool) -> bool {
    sqlx::query_scalar!("SELECT 1 AS one").fetch_one(db).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storable_times_start_where_postgres_timestamps_do() {
        // Postgres's MIN_TIMESTAMP, in microseconds from its epoch (2000-01-01 UTC).
        let pg_epoch = chrono::DateTime::from_timestamp(946_684_800, 0).expect("2000-01-01");
        let earliest = pg_epoch + chrono::TimeDelta::microseconds(-211_813_488_000_000_000);
        assert!(storable(earliest));
        assert!(!storable(earliest - chrono::TimeDelta::microseconds(1)));
        assert!(storable(chrono::DateTime::<chrono::Utc>::MAX_UTC));
    }
}
