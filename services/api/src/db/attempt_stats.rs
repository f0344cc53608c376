//! `endpoint_attempt_stats`: per-endpoint attempt sums in 5-minute buckets,
//! written by each api from what it recorded (see `app::attempt_stats`).

use std::time::Duration;

use relay_domain::EndpointId;
use sqlx::PgPool;

use super::{interval, models::Timestamp};
use crate::error::AppResult;

/// Sums to add, column by column; the histograms flattened, each
/// `LATENCY_BUCKETS` long.
#[derive(Default)]
pub struct Rows {
    endpoint_id: Vec<EndpointId>,
    bucket_start: Vec<Timestamp>,
    attempts: Vec<i64>,
    succeeded: Vec<i64>,
    latency_counts: Vec<String>,
}

impl Rows {
    pub fn push(&mut self, endpoint_id: EndpointId, bucket_start: Timestamp, attempts: i64, succeeded: i64, latency_counts: &[i64]) {
        self.endpoint_id.push(endpoint_id);
        self.bucket_start.push(bucket_start);
        self.attempts.push(attempts);
        self.succeeded.push(succeeded);
        // An array literal per row: UNNEST cannot take a two-dimensional
        // parameter apart into one array per row.
        let list: Vec<String> = latency_counts.iter().map(i64::to_string).collect();
        self.latency_counts.push(format!("{{{}}}", list.join(",")));
    }
}

/// Adds the sums to what is stored, in (endpoint, bucket) order so that two
/// apis writing the same rows lock them in the same order.
pub async fn add(db: &PgPool, rows: &Rows) -> AppResult<()> {
    sqlx::query!(
        "INSERT INTO endpoint_attempt_stats AS s (endpoint_id, bucket_start, attempts, succeeded, latency_counts)
         SELECT u.endpoint_id, u.bucket_start, u.attempts, u.succeeded, u.counts::bigint[]
         FROM UNNEST($1::uuid[], $2::timestamptz[], $3::bigint[], $4::bigint[], $5::text[])
           AS u(endpoint_id, bucket_start, attempts, succeeded, counts)
         -- An endpoint deleted for good (never, today: deletion is soft) has no row to chart.
         WHERE EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = u.endpoint_id)
         ORDER BY u.endpoint_id, u.bucket_start
         ON CONFLICT (endpoint_id, bucket_start) DO UPDATE SET
           attempts = s.attempts + EXCLUDED.attempts,
           succeeded = s.succeeded + EXCLUDED.succeeded,
           latency_counts = ARRAY(SELECT coalesce(a, 0) + coalesce(b, 0)
                                  FROM UNNEST(s.latency_counts, EXCLUDED.latency_counts) WITH ORDINALITY AS t(a, b, i) ORDER BY i)",
        &rows.endpoint_id as _,
        &rows.bucket_start,
        &rows.attempts,
        &rows.succeeded,
        &rows.latency_counts,
    )
    .execute(db)
    .await?;
    Ok(())
}

/// An endpoint's buckets from `from` on.
pub struct StoredBucket {
    pub bucket_start: Timestamp,
    pub attempts: i64,
    pub succeeded: i64,
    pub latency_counts: Vec<i64>,
}

pub async fn of_endpoint(db: &PgPool, endpoint_id: EndpointId, from: Timestamp) -> AppResult<Vec<StoredBucket>> {
    Ok(sqlx::query_as!(
        StoredBucket,
        "SELECT bucket_start, attempts, succeeded, latency_counts FROM endpoint_attempt_stats
         WHERE endpoint_id = $1 AND bucket_start >= $2 ORDER BY bucket_start",
        endpoint_id as _,
        from,
    )
    .fetch_all(db)
    .await?)
}

/// Deletes buckets that started more than `older_than` ago.
pub async fn prune(db: &PgPool, older_than: Duration) -> AppResult<u64> {
    Ok(sqlx::query!("DELETE FROM endpoint_attempt_stats WHERE bucket_start < now() - $1::interval", interval(older_than)?)
        .execute(db)
        .await?
        .rows_affected())
}
