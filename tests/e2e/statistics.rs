//! Issue 30: a new installation does not run on statistics it never
//! gathered, nor on statistics gathered while its tables were small. The
//! api analyses a hot table once it holds 1,000 rows and doubles since its
//! last analysis, and leaves a small one to the planner's own assumption,
//! with or without Postgres's autovacuum (these machines run without it).

use std::time::{Duration, Instant};

use relay_tests::{Options, Stack};

async fn last_analyzed(pg: &sqlx::PgPool, table: &str) -> anyhow::Result<Option<chrono::DateTime<chrono::Utc>>> {
    // The statistics views are a snapshot per transaction: read fresh.
    Ok(sqlx::query_scalar("SELECT greatest(last_analyze, last_autoanalyze) FROM pg_stat_user_tables WHERE relname = $1")
        .bind(table)
        .fetch_one(pg)
        .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_analyses_a_hot_table_once_it_has_grown_and_leaves_small_ones_alone() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let pg = stack.pg().await?;
    let tenant = stack.tenant("statistics").await?;
    // Small tables are left alone: an empty table analysed would be planned
    // as empty until its next analysis. (Past two passes of the keeper.)
    tokio::time::sleep(Duration::from_secs(6)).await;
    for table in ["events", "webhook_deliveries", "delivery_attempts", "ordering_lanes"] {
        assert_eq!(last_analyzed(&pg, table).await?, None, "{table}, still small, was analysed");
    }
    // 5,000 events written straight in: past 1,000 rows and doubled.
    sqlx::query(
        "INSERT INTO events (id, environment_id, event_type, envelope, created_at, published_at)
         SELECT gen_random_uuid(), $1::uuid, 'grown.event', convert_to('{}', 'UTF8'), now(), now() FROM generate_series(1, 5000)",
    )
    .bind(&tenant.environment_id)
    .execute(&pg)
    .await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let analysed = loop {
        if let Some(at) = last_analyzed(&pg, "events").await? {
            let rows: f32 = sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE relname = 'events'").fetch_one(&pg).await?;
            assert!(rows >= 5_000.0, "the planner now knows the table's size: {rows}");
            break at;
        }
        anyhow::ensure!(Instant::now() < deadline, "events grew to 5,000 rows and was not analysed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Not doubled since: not analysed again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(last_analyzed(&pg, "events").await?, Some(analysed), "a table that has not doubled is not analysed again");
    assert_eq!(last_analyzed(&pg, "webhook_deliveries").await?, None, "a small table is still left alone");
    Ok(())
}
