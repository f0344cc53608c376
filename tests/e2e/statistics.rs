//! Issue 30: a new installation does not run on statistics it never
//! gathered. The api analyses the hot tables at start (never analysed,
//! still small) and again once one has grown tenfold, with or without
//! Postgres's autovacuum (these machines run without it).

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
async fn the_api_analyses_hot_tables_at_start_and_when_they_grow_tenfold() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let pg = stack.pg().await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    for table in ["events", "webhook_deliveries", "delivery_attempts", "ordering_lanes"] {
        while last_analyzed(&pg, table).await?.is_none() {
            anyhow::ensure!(Instant::now() < deadline, "{table} was never analysed after the api started");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let before = last_analyzed(&pg, "events").await?;
    let tenant = stack.tenant("statistics").await?;
    // 5,000 events written straight in: growth past 1,000 rows and tenfold.
    sqlx::query(
        "INSERT INTO events (id, environment_id, event_type, envelope, created_at, published_at)
         SELECT gen_random_uuid(), $1::uuid, 'grown.event', convert_to('{}', 'UTF8'), now(), now() FROM generate_series(1, 5000)",
    )
    .bind(&tenant.environment_id)
    .execute(&pg)
    .await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = last_analyzed(&pg, "events").await?;
        if now > before {
            let rows: f32 = sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE relname = 'events'").fetch_one(&pg).await?;
            assert!(rows >= 5_000.0, "the planner now knows the table's size: {rows}");
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "events grew to 5,000 rows and was not analysed again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Unchanged tables are left alone: no analysis on every pass.
    let deliveries = last_analyzed(&pg, "webhook_deliveries").await?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(last_analyzed(&pg, "webhook_deliveries").await?, deliveries, "an unchanged table is not analysed again");
    Ok(())
}
