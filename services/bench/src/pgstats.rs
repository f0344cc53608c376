//! Postgres's own counters around a run: statements executed (from
//! `pg_stat_statements`, when the server loads it), WAL written and
//! transactions committed. Divided by the deliveries made they are the
//! budget a delivery spends in the database.

use serde::Serialize;
use sqlx::{PgConnection, Row};

/// Counter readings (totals; a run's figures are the difference of two).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PgCounters {
    /// Statements the bench database ran; `None` without `pg_stat_statements`.
    pub statements: Option<i64>,
    /// WAL bytes the server wrote (all databases: nothing else runs here).
    pub wal_bytes: Option<i64>,
    /// Transactions the bench database committed.
    pub commits: Option<i64>,
    /// Table rows the bench database read by sequential scan: a hot path
    /// should find its rows through an index, so this stays near zero.
    pub rows_seq_scanned: Option<i64>,
    /// Bytes on disk (heap, indexes, TOAST) of the tables that grow with
    /// traffic — events, deliveries, the attempt log, the expansion ledger,
    /// dead letters — and their rows: what a delivery leaves behind for the
    /// retention window (`RELAY_RETENTION_DAYS`).
    pub stored_bytes: Option<i64>,
    pub stored_rows: Option<i64>,
    /// Where the statements went: each statement of the bench database with
    /// its calls and time (the run's share once `since` has subtracted the
    /// reading before), most called first. Empty without `pg_stat_statements`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_statement: Vec<StatementCost>,
}

/// One normalised statement's share of a run, as `pg_stat_statements` counts it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StatementCost {
    #[serde(skip)]
    pub queryid: i64,
    /// The statement's text, whitespace collapsed, cut at 160 characters.
    pub query: String,
    pub calls: i64,
    /// Milliseconds spent executing and planning it.
    pub exec_ms: f64,
    pub plan_ms: f64,
    /// Shared buffers it touched (hit or read): what it scanned.
    pub blocks: i64,
}

/// The tables whose size grows with traffic (and shrinks with retention).
const STORED_TABLES: &[&str] = &["events", "webhook_deliveries", "delivery_attempts", "consumed_events", "webhook_dead_letters"];

/// How many statements a run's breakdown keeps.
const BREAKDOWN: usize = 25;

impl PgCounters {
    pub fn since(&self, before: &Self) -> Self {
        let d = |a: Option<i64>, b: Option<i64>| Some(a? - b?);
        let earlier: std::collections::HashMap<i64, &StatementCost> = before.by_statement.iter().map(|s| (s.queryid, s)).collect();
        let mut by_statement: Vec<StatementCost> = self
            .by_statement
            .iter()
            .map(|s| match earlier.get(&s.queryid) {
                Some(b) => StatementCost {
                    calls: s.calls - b.calls,
                    exec_ms: s.exec_ms - b.exec_ms,
                    plan_ms: s.plan_ms - b.plan_ms,
                    blocks: s.blocks - b.blocks,
                    ..s.clone()
                },
                None => s.clone(),
            })
            .filter(|s| s.calls > 0)
            .collect();
        by_statement.sort_by_key(|s| std::cmp::Reverse(s.calls));
        by_statement.truncate(BREAKDOWN);
        Self {
            statements: d(self.statements, before.statements),
            wal_bytes: d(self.wal_bytes, before.wal_bytes),
            commits: d(self.commits, before.commits),
            rows_seq_scanned: d(self.rows_seq_scanned, before.rows_seq_scanned),
            stored_bytes: d(self.stored_bytes, before.stored_bytes),
            stored_rows: d(self.stored_rows, before.stored_rows),
            by_statement,
        }
    }
}

/// Makes `pg_stat_statements` readable from the admin connection if the
/// server loads it; says once how to turn it on if not.
pub async fn prepare(admin: &mut PgConnection) {
    let _ = sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&mut *admin).await;
    if sqlx::raw_sql("SELECT 1 FROM pg_stat_statements LIMIT 1").execute(&mut *admin).await.is_err() {
        eprintln!(
            "statements per delivery: not measured (the server does not load pg_stat_statements; \
             ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements' and restart Postgres)"
        );
    }
}

/// Waits (up to five seconds) until no backend serves database `db`: an
/// exiting backend publishes the counts it has not reported yet.
pub async fn await_backends_gone(admin: &mut PgConnection, db: &str) {
    for _ in 0..50 {
        let left: Option<i64> =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1").bind(db).fetch_one(&mut *admin).await.ok();
        if left == Some(0) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Reads the counters of database `db` (the commit count as published by
/// its backends: read it once they have exited, see `await_backends_gone`).
/// WAL is the insert position, which moves at once: every byte written
/// since, by this database's work and anything else the server does.
pub async fn read(admin: &mut PgConnection, db: &str, db_url: &str) -> PgCounters {
    // This connection's own pending counts (creating the database wrote a
    // copy of the template to the WAL) are published at the end of this.
    let _ = sqlx::raw_sql("SELECT pg_stat_force_next_flush()").execute(&mut *admin).await;
    let one = |sql: &'static str| sqlx::query(sql);
    let statements = one("SELECT sum(calls)::bigint FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1")
        .bind(db)
        .fetch_one(&mut *admin)
        .await
        .ok()
        .and_then(|r| r.try_get::<Option<i64>, _>(0).ok().flatten());
    let wal_bytes = one("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint")
        .fetch_one(&mut *admin)
        .await
        .ok()
        .and_then(|r| r.try_get::<i64, _>(0).ok());
    let commits = one("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(&mut *admin)
        .await
        .ok()
        .and_then(|r| r.try_get::<i64, _>(0).ok());
    let by_statement =
        one("SELECT s.queryid, regexp_replace(s.query, '\\s+', ' ', 'g') AS query, s.calls, s.total_exec_time, s.total_plan_time,
                (s.shared_blks_hit + s.shared_blks_read)::bigint
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1")
        .bind(db)
        .fetch_all(&mut *admin)
        .await
        .map(|rows| {
            rows.iter()
                .filter_map(|r| {
                    let query: String = r.try_get(1).ok()?;
                    Some(StatementCost {
                        queryid: r.try_get(0).ok()?,
                        query: query.chars().take(160).collect(),
                        calls: r.try_get(2).ok()?,
                        exec_ms: r.try_get(3).ok()?,
                        plan_ms: r.try_get(4).ok()?,
                        blocks: r.try_get(5).ok()?,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    // Table statistics are per database: ask the bench database itself.
    let (rows_seq_scanned, stored_bytes, stored_rows) = match <PgConnection as sqlx::Connection>::connect(db_url).await {
        Ok(mut conn) => {
            let _ = sqlx::raw_sql("SELECT pg_stat_clear_snapshot()").execute(&mut conn).await;
            let scanned = one("SELECT coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_user_tables")
                .fetch_one(&mut conn)
                .await
                .ok()
                .and_then(|r| r.try_get::<i64, _>(0).ok());
            let stored = one("SELECT (SELECT sum(pg_total_relation_size(t::regclass))::bigint FROM unnest($1::text[]) t),
                        (SELECT count(*) FROM events) + (SELECT count(*) FROM webhook_deliveries) + (SELECT count(*) FROM delivery_attempts)
                          + (SELECT count(*) FROM consumed_events) + (SELECT count(*) FROM webhook_dead_letters)")
            .bind(STORED_TABLES)
            .fetch_one(&mut conn)
            .await
            .ok();
            let get = |i: usize| stored.as_ref().and_then(|r| r.try_get::<Option<i64>, _>(i).ok().flatten());
            (scanned, get(0), get(1))
        }
        Err(_) => (None, None, None),
    };
    PgCounters { statements, wal_bytes, commits, rows_seq_scanned, stored_bytes, stored_rows, by_statement }
}
