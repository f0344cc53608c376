//! Issue 30: a new installation does not run on statistics it never
//! gathered, nor on statistics gathered while its tables were small. The
//! api analyses a hot table once it holds 1,000 rows and doubles since its
//! last analysis, and leaves a small one to the planner's own assumption,
//! with or without Postgres's autovacuum (these machines run without it).
//! Issue 28's lanes, likewise: what their bookkeeping reads and runs per
//! delivery stays per lane, whatever else is queued.

use std::time::{Duration, Instant};

use relay_tests::{
    Options, Receiver, Reply, Rest, Stack,
    flaky::{Behaviour, Flaky},
};
use serde_json::json;

async fn last_analyzed(pg: &sqlx::PgPool, table: &str) -> anyhow::Result<Option<chrono::DateTime<chrono::Utc>>> {
    // The statistics views are a snapshot per transaction: read fresh.
    Ok(sqlx::query_scalar("SELECT greatest(last_analyze, last_autoanalyze) FROM pg_stat_user_tables WHERE relname = $1")
        .bind(table)
        .fetch_one(pg)
        .await?)
}

/// Stops the api and waits until its connections are gone: a backend's
/// counts reach the statistics when it is idle for a while or when it
/// exits, so what the api's statements read is counted once this returns.
async fn stop_api_and_its_counts(stack: &mut Stack, pg: &sqlx::PgPool) -> anyhow::Result<()> {
    stack.stop_api().await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let others: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
                .fetch_one(pg)
                .await?;
        // This pool's own other connections stay; the api's go.
        if others <= 1 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "{others} connections still open after the api stopped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

/// Waits (10 s at most) until `lanes` lanes are marked idle.
async fn until_lanes_idle(pg: &sqlx::PgPool, lanes: usize, when: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let idle: i64 = sqlx::query_scalar("SELECT count(*) FROM ordering_lanes WHERE idle").fetch_one(pg).await?;
        if idle == lanes as i64 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{idle} of {lanes} lanes idle {when}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

/// Plans made on the statistics of the moment: the leased rows' two indexes
/// had one predicate, and a count of one endpoint's attempts in flight was
/// planned on the expiry index (every lease read, filtered by endpoint)
/// whenever that index looked the smaller; relay-bench `w4` collapsed in
/// half its runs. Now only a statement that states the expiry index's own
/// clause can use it. Shown with the endpoint index out of the way (dropped
/// inside a transaction that is rolled back) and sequential scans off, where
/// the old schema's planner took the expiry index for the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoints_count_of_leases_is_never_planned_on_the_expiry_index() -> anyhow::Result<()> {
    let stack = Stack::start(Options { dispatcher: false, ..Options::default() }).await?;
    let pg = stack.pg().await?;
    let plan = async |statement: &str| -> anyhow::Result<String> {
        let mut tx = pg.begin().await?;
        sqlx::query("DROP INDEX webhook_deliveries_leased_idx").execute(&mut *tx).await?;
        sqlx::query("SET LOCAL enable_seqscan = off").execute(&mut *tx).await?;
        let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {statement}"))).fetch_all(&mut *tx).await?;
        tx.rollback().await?;
        Ok(lines.join("\n"))
    };
    let count = plan(
        "SELECT count(*) FROM (SELECT 1 FROM webhook_deliveries l
          WHERE l.state = 'pending' AND l.dispatched_at IS NOT NULL AND l.endpoint_id = gen_random_uuid() LIMIT 64) s",
    )
    .await?;
    assert!(!count.contains("lease_expiry"), "an endpoint's leases were counted through the expiry index:\n{count}");
    let expiry = plan(
        "SELECT min(next_attempt_at) FROM webhook_deliveries
         WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > '-infinity'",
    )
    .await?;
    assert!(expiry.contains("webhook_deliveries_lease_expiry_idx"), "the earliest lease is not read from its index:\n{expiry}");
    Ok(())
}

/// A new installation's lanes table is empty when the promotions' plans are
/// made, and where something analysed it so (relay-bench does, after its
/// seeding) a plan made then read the whole table to lock the lanes asked
/// for, and again for each lane, for as long as its connection lived
/// (auto_explain under `w6`: 256 scans of it per promotion). Promotions run
/// with sequential scans off: with the table analysed while empty, keyed
/// events through their promotions (queued behind heads, lanes going idle
/// and taken again) never scan it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_endpoints_lanes_are_never_read_whole_by_their_promotions() -> anyhow::Result<()> {
    let mut stack = Stack::start(Options::default()).await?;
    let pg = stack.pg().await?;
    let scans = async || -> anyhow::Result<(i64, i64)> {
        Ok(sqlx::query_as("SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relname = 'ordering_lanes'")
            .fetch_one(&pg)
            .await?)
    };
    sqlx::query("ANALYZE ordering_lanes").execute(&pg).await?;
    let tenant = stack.tenant("lanes-by-key").await?;
    let receiver = Receiver::start().await?;
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (status, created) =
        rest.post("/v1/webhooks", json!({"url": receiver.url("/lanes"), "event_types": ["o"], "ordering": "per_key"})).await?;
    anyhow::ensure!(status == 201, "{created}");
    const KEYS: usize = 20;
    const EACH: usize = 4;
    for n in 0..EACH {
        for k in 0..KEYS {
            let (status, reply) =
                rest.post("/v1/events", json!({"type": "o", "payload": {"n": n}, "ordering_key": format!("k{k}")})).await?;
            anyhow::ensure!(status == 202, "{reply}");
        }
        if n % 2 == 1 {
            // Every lane idle before the next round (taken by its expansion).
            receiver.wait_at("/lanes", KEYS * (n + 1), Duration::from_secs(30)).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    assert_eq!(receiver.wait_at("/lanes", KEYS * EACH, Duration::from_secs(30)).await.len(), KEYS * EACH);
    // Every lane goes idle once its last delivery's outcome is recorded.
    until_lanes_idle(&pg, KEYS, "after their last deliveries").await?;
    stop_api_and_its_counts(&mut stack, &pg).await?;
    let (seq, idx) = scans().await?;
    assert!(idx > 0, "the promotions' lookups were counted ({idx} index scans)");
    // One scan is the migration's: building the key's index read the
    // (empty) table. A promotion planned on the empty table scanned it at
    // each of its dozens of calls here.
    assert!(seq <= 1, "the lanes table was read whole {} times ({idx} index scans)", seq - 1);
    stack.stop().await
}

/// Issue 28: an expansion that finds a lane idle takes it only if nothing
/// is queued in it, and asks that of the lane alone. Asked as `NOT EXISTS`,
/// the planner (estimating a short queue) hashed every queued delivery of
/// every endpoint once per expansion that met an idle lane: 200 rows queued
/// behind one hanging receiver were read again for each of another
/// endpoint's takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taking_an_idle_lane_never_reads_the_queues_of_other_lanes() -> anyhow::Result<()> {
    // The backlog's head stays on the wire for the whole test.
    let mut stack = Stack::start(Options { attempt_timeout: Duration::from_secs(60), ..Options::default() }).await?;
    let pg = stack.pg().await?;
    let tenant = stack.tenant("takes-by-key").await?;
    let receiver = Receiver::start().await?;
    receiver.reply("/backlog", Reply::Hang(Duration::from_secs(60)));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    for (path, event_type) in [("/backlog", "b"), ("/lanes", "o")] {
        let (status, created) =
            rest.post("/v1/webhooks", json!({"url": receiver.url(path), "event_types": [event_type], "ordering": "per_key"})).await?;
        anyhow::ensure!(status == 201, "{created}");
    }
    const BACKLOG: i64 = 200;
    let publish = async |event_type: &str, key: &str, n: usize| -> anyhow::Result<()> {
        let (status, reply) = rest.post("/v1/events", json!({"type": event_type, "payload": {"n": n}, "ordering_key": key})).await?;
        anyhow::ensure!(status == 202, "{reply}");
        Ok(())
    };
    publish("b", "held", 0).await?;
    receiver.wait_at("/backlog", 1, Duration::from_secs(30)).await;
    for n in 1..=BACKLOG as usize {
        publish("b", "held", n).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Counted without the queue's index, whose reads are what is measured.
        let queued: i64 =
            sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE lower(state) = 'queued'").fetch_one(&pg).await?;
        if queued == BACKLOG {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "{queued} of {BACKLOG} deliveries queued behind the hanging head");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What the backlog's expansions and promotions read (each queued row
    // probed for once) counted and set aside: the api restarted.
    stop_api_and_its_counts(&mut stack, &pg).await?;
    sqlx::query("SELECT pg_stat_reset_single_table_counters('webhook_deliveries_lane_queue_idx'::regclass)").execute(&pg).await?;
    stack.start_api().await?;
    // Another endpoint's lanes opened, gone idle, then taken, round by round:
    // each round starts with every lane idle (waited for below), so each of
    // its expansions asks the take's question of an idle lane.
    const KEYS: usize = 10;
    const ROUNDS: usize = 4;
    for round in 0..ROUNDS {
        for k in 0..KEYS {
            publish("o", &format!("k{k}"), round).await?;
        }
        assert_eq!(receiver.wait_at("/lanes", KEYS * (round + 1), Duration::from_secs(30)).await.len(), KEYS * (round + 1));
        until_lanes_idle(&pg, KEYS, &format!("after round {round}")).await?;
    }
    let taken: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE ordering_position > 1 AND event_id IN (SELECT id FROM events WHERE event_type = 'o')")
        .fetch_one(&pg)
        .await?;
    assert_eq!(taken, (KEYS * (ROUNDS - 1)) as i64, "every key's later deliveries numbered after its first");
    stop_api_and_its_counts(&mut stack, &pg).await?;
    let read: i64 = sqlx::query_scalar(
        "SELECT coalesce(idx_tup_read, 0) FROM pg_stat_user_indexes WHERE indexrelname = 'webhook_deliveries_lane_queue_idx'",
    )
    .fetch_one(&pg)
    .await?;
    // What reads the queue here legitimately: the upkeep's sweep (the
    // backlog lane's first queued row, once a pass), the takes' probes and
    // the promotions' (an empty queue each).
    assert!(read < BACKLOG / 4, "{read} queue entries read for {} takes of idle lanes beside {BACKLOG} queued", KEYS * (ROUNDS - 1));
    stack.stop().await
}

/// Issue 28: a lane head that ends with nothing queued behind it leaves
/// its lane idle through the outcome's own statement, with no promotion's
/// transaction after it (under `w6`, 163–207 of them a run before); a lane
/// with deliveries queued behind its head is promoted as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_ends_with_nothing_behind_it_costs_its_lane_no_promotion() -> anyhow::Result<()> {
    let stack = Stack::start(Options::default()).await?;
    let pg = stack.pg().await?;
    let tenant = stack.tenant("ended-lanes").await?;
    let receiver = Receiver::start().await?;
    // Each head on the wire long enough for a key's next events to queue.
    receiver.reply("/ended", Reply::Flaky(Flaky::new(Behaviour::Slow(Duration::from_millis(300)))));
    let rest = Rest::new(&stack.rest_url, Some(&tenant.api_key));
    let (status, created) =
        rest.post("/v1/webhooks", json!({"url": receiver.url("/ended"), "event_types": ["o"], "ordering": "per_key"})).await?;
    anyhow::ensure!(status == 201, "{created}");
    let publish = async |key: &str, n: usize| -> anyhow::Result<()> {
        let (status, reply) = rest.post("/v1/events", json!({"type": "o", "payload": {"n": n}, "ordering_key": key})).await?;
        anyhow::ensure!(status == 202, "{reply}");
        Ok(())
    };
    const SINGLES: usize = 20;
    for k in 0..SINGLES {
        publish(&format!("single-{k}"), 0).await?;
    }
    // Three at once: the first is the head, the other two queue behind it.
    for n in 0..3 {
        publish("busy", n).await?;
    }
    let total = SINGLES + 3;
    assert_eq!(receiver.wait_at("/ended", total, Duration::from_secs(30)).await.len(), total);
    until_lanes_idle(&pg, SINGLES + 1, "after their last deliveries").await?;
    // Counted right after each lane's statement: read once both are there.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (idle, promoted) = loop {
        let idle = stack.metric(r#"relay_ended_lanes_total{settled="idle"}"#).await?;
        let promoted = stack.metric(r#"relay_ended_lanes_total{settled="promoted"}"#).await?;
        if let (Some(idle), Some(promoted)) = (idle, promoted)
            && idle >= (SINGLES + 1) as f64
        {
            break (idle, promoted);
        }
        anyhow::ensure!(Instant::now() < deadline, "ended lanes counted idle {idle:?}, promoted {promoted:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Each single key's lane and the busy key's last: idle at once.
    assert_eq!(idle, (SINGLES + 1) as f64, "ended heads with nothing queued behind them, settled idle");
    // The busy key's first two heads had rows queued behind them.
    assert!((1.0..=2.0).contains(&promoted), "{promoted} ended lanes promoted; the busy key's first two heads had rows behind them");
    stack.stop().await
}
