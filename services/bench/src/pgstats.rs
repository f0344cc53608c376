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
}

impl PgCounters {
    pub fn since(&self, before: &Self) -> Self {
        let d = |a: Option<i64>, b: Option<i64>| Some(a? - b?);
        Self {
            statements: d(self.statements, before.statements),
            wal_bytes: d(self.wal_bytes, before.wal_bytes),
            commits: d(self.commits, before.commits),
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

/// Reads the counters of database `db`. Backends publish their WAL and
/// commit counts at most once a second, so read a second after the work.
pub async fn read(admin: &mut PgConnection, db: &str) -> PgCounters {
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
    let wal_bytes =
        one("SELECT wal_bytes::bigint FROM pg_stat_wal").fetch_one(&mut *admin).await.ok().and_then(|r| r.try_get::<i64, _>(0).ok());
    let commits = one("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(&mut *admin)
        .await
        .ok()
        .and_then(|r| r.try_get::<i64, _>(0).ok());
    PgCounters { statements, wal_bytes, commits }
}
