//! The planner's statistics of the hot tables, kept by the api itself.
//! Postgres's autovacuum analyses a table once a tenth of it has changed,
//! but a database may run without it (these machines ship with it off), and
//! a new installation starts with tables never analysed: its plans are then
//! made for tables of a few rows and kept as they grow. So the api analyses
//! a hot table that was never analysed (at start, after the migrations,
//! while it is still small) and one that has grown tenfold since it last
//! was; one api at a time (an advisory lock), never the same table twice
//! at once.

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

/// A table grown past this many rows since its last analysis, and this
/// many times the rows it had then, is analysed again.
const GROWN_ROWS: f32 = 1_000.0;
const GROWN_FACTOR: f32 = 10.0;

/// The advisory lock the api that analyses holds (any other skips its turn).
const LOCK_KEY: i64 = 0x7265_6c61_795f_7374; // "relay_st"

/// Hot tables never analysed, or grown tenfold since.
pub async fn stale(db: &PgPool) -> AppResult<Vec<String>> {
    let tables: Vec<String> = HOT_TABLES.iter().map(|t| (*t).to_owned()).collect();
    Ok(sqlx::query_scalar!(
        r#"SELECT s.relname AS "relname!" FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
           WHERE s.schemaname = current_schema() AND s.relname = ANY ($1)
             AND ((s.last_analyze IS NULL AND s.last_autoanalyze IS NULL)
                  OR s.n_live_tup > greatest($2, $3 * greatest(c.reltuples, 0)))
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
