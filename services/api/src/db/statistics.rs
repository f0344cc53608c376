//! The planner's statistics of the hot tables, kept by the api itself.
//! Postgres's autovacuum analyses a table once a tenth of it has changed,
//! but a database may run without it (these machines ship with it off), and
//! a new installation's tables are never analysed at all: the planner
//! assumes ten pages for those, but once one has been analysed small it
//! believes it small (an empty table costs nothing to scan whole) until the
//! next analysis, and the generic plans made then stay. So the api analyses
//! a hot table once it holds 1,000 rows and again each time it has doubled
//! since its last analysis (never one still small: that is the trap); one
//! api at a time (an advisory lock), never the same table twice at once.

use sqlx::PgPool;

use crate::error::AppResult;

/// The tables whose plans the delivery path depends on.
pub const HOT_TABLES: &[&str] = &[
    "events",
    "webhook_deliveries",
    "delivery_attempts",
    "consumed_events",
    "attempt_claims",
    "webhook_endpoints",
    "endpoint_health",
    "webhook_dead_letters",
    "ordering_keys",
    "ordering_lanes",
    "event_types",
];

/// A table past this many rows, and this many times the rows it had at its
/// last analysis (none: 0), is analysed.
const GROWN_ROWS: f32 = 1_000.0;
const GROWN_FACTOR: f32 = 2.0;

/// The advisory lock the api that analyses holds (any other skips its turn).
const LOCK_KEY: i64 = 0x7265_6c61_795f_7374; // "relay_st"

/// Hot tables past 1,000 rows and doubled since their last analysis.
pub async fn stale(db: &PgPool) -> AppResult<Vec<String>> {
    let tables: Vec<String> = HOT_TABLES.iter().map(|t| (*t).to_owned()).collect();
    Ok(sqlx::query_scalar!(
        r#"SELECT s.relname AS "relname!" FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
           WHERE s.schemaname = current_schema() AND s.relname = ANY ($1)
             AND s.n_live_tup > greatest($2, $3 * greatest(c.reltuples, 0))
           ORDER BY s.relname"#,
        &tables,
        GROWN_ROWS,
        GROWN_FACTOR,
    )
    .fetch_all(db)
    .await?)
}

/// Analyses `table` (one of [`HOT_TABLES`]) unless another api is
/// analysing; whether this one did.
pub async fn analyze(db: &PgPool, table: &str) -> AppResult<bool> {
    let Some(table) = HOT_TABLES.iter().find(|t| **t == table) else { return Ok(false) };
    let mut tx = db.begin().await?;
    let locked: bool = sqlx::query_scalar!(r#"SELECT pg_try_advisory_xact_lock($1) AS "locked!""#, LOCK_KEY).fetch_one(&mut *tx).await?;
    if !locked {
        return Ok(false);
    }
    // The name is one of HOT_TABLES, never input.
    sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}"))).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(true)
}
