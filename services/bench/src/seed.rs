//! What a run's database holds before it is measured: a delivered history
//! (every run), and W3's backlog of deliveries not yet due.

use anyhow::{Result, bail};
use sqlx::{Connection, Executor};

/// Deliveries a run finds already made: a system in service has history.
const HISTORY_DELIVERIES: i64 = 100_000;

/// Every run starts on a database that has been in service: past events
/// delivered to the endpoints just registered (about `HISTORY_DELIVERIES`
/// deliveries, each with its logged attempt), vacuumed and analysed. On an
/// empty database Postgres plans every statement for tables of a few rows
/// (scanning them whole) and keeps those plans as the tables grow until
/// autovacuum's first ANALYZE, which may come a minute in: a run would time
/// that start-up, different on every run, instead of the steady state.
pub(crate) async fn seed_history(db_url: &str) -> Result<()> {
    let mut c = sqlx::PgConnection::connect(db_url).await?;
    let endpoints: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_endpoints").fetch_one(&mut c).await?;
    let events = (HISTORY_DELIVERIES / endpoints.max(1)).max(100);
    sqlx::query(
        "INSERT INTO events (id, environment_id, event_type, envelope, created_at, published_at)
         SELECT relay_uuid_v7(), v.id, 'history.event', convert_to(repeat('h', 1000), 'UTF8'), now() - interval '1 hour', now() - interval '1 hour'
         FROM environments v CROSS JOIN generate_series(1, $1)",
    )
    .bind(events)
    .execute(&mut c)
    .await?;
    sqlx::query(
        "INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id, state, last_status, created_at, updated_at)
         SELECT relay_uuid_v7(), v.environment_id, e.id, v.id, 'delivered', 200, v.created_at, v.created_at
         FROM events v JOIN webhook_endpoints e ON e.environment_id = v.environment_id
         WHERE v.event_type = 'history.event'",
    )
    .execute(&mut c)
    .await?;
    sqlx::query(
        "INSERT INTO delivery_attempts (delivery_id, generation, attempt, environment_id, http_status, latency_ms, response_body, decision)
         SELECT id, 0, 1, environment_id, 200, 3, '\\x6f6b'::bytea, 'delivered' FROM webhook_deliveries WHERE state = 'delivered'",
    )
    .execute(&mut c)
    .await?;
    sqlx::query("INSERT INTO consumed_events (consumer, environment_id, event_id) SELECT 'expand', environment_id, id FROM events WHERE event_type = 'history.event'")
        .execute(&mut c)
        .await?;
    c.execute("VACUUM (ANALYZE)").await?;
    c.execute("CHECKPOINT").await?;
    Ok(())
}

/// W3's backlog: pending deliveries due tomorrow, on endpoints of their own,
/// written straight into the table (the API would take hours to make them).
pub(crate) async fn seed_backlog(db_url: &str, environment_id: &str, rows: u64, endpoints: u64) -> Result<()> {
    let mut c = sqlx::PgConnection::connect(db_url).await?;
    let events = rows.div_ceil(endpoints);
    let env: uuid::Uuid = environment_id.parse()?;
    sqlx::query(
        "INSERT INTO webhook_endpoints (id, environment_id, url, event_types, secret_key_id, secret_ciphertext)
         SELECT gen_random_uuid(), $1, 'http://127.0.0.1:9/backlog', ARRAY['backlog.event'], 'dev', '\\x00'::bytea
         FROM generate_series(1, $2)",
    )
    .bind(env)
    .bind(endpoints as i64)
    .execute(&mut c)
    .await?;
    // Every registered endpoint has its health row (the expansion and the
    // relay join it); without them the planner sees a table of 10 rows.
    sqlx::query(
        "INSERT INTO endpoint_health (endpoint_id)
         SELECT id FROM webhook_endpoints WHERE environment_id = $1 AND url = 'http://127.0.0.1:9/backlog'",
    )
    .bind(env)
    .execute(&mut c)
    .await?;
    sqlx::query(
        "INSERT INTO events (id, environment_id, event_type, envelope, published_at)
         SELECT gen_random_uuid(), $1, 'backlog.event', '\\x7b7d'::bytea, now() FROM generate_series(1, $2)",
    )
    .bind(env)
    .bind(events as i64)
    .execute(&mut c)
    .await?;
    sqlx::query(
        "INSERT INTO webhook_deliveries (id, environment_id, endpoint_id, event_id, next_attempt_at)
         SELECT relay_uuid_v7(), $1, e.id, v.id, now() + interval '1 day'
         FROM (SELECT id FROM events WHERE environment_id = $1 AND event_type = 'backlog.event') v
         CROSS JOIN (SELECT id FROM webhook_endpoints WHERE environment_id = $1 AND url = 'http://127.0.0.1:9/backlog') e
         LIMIT $2",
    )
    .bind(env)
    .bind(rows as i64)
    .execute(&mut c)
    .await?;
    // A backlog that has been sitting there is vacuumed (hint bits set,
    // visibility map current) and checkpointed; measuring the first pass of
    // autovacuum over a bulk load, or the load's checkpoint, would time the
    // seeding rather than the relay's queries.
    c.execute("VACUUM (ANALYZE) webhook_deliveries, events, webhook_endpoints, endpoint_health").await?;
    c.execute("CHECKPOINT").await?;
    // A relay pass that began while the rows were being written walks every
    // one of them, not yet committed, endpoint by endpoint (seen: one pass of
    // 15 s over 10,000,000 rows, inside the measured window): the run starts
    // once no statement of the services is running.
    for _ in 0..600 {
        let busy: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
               AND query_start < now() - interval '1 second'",
        )
        .fetch_one(&mut c)
        .await?;
        if busy == 0 {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    bail!("a statement of the services still runs 5 minutes after the backlog was seeded")
}
