-- The portal's pages (issue 15).
--
-- The event log lists an environment's events newest first, filtered by a
-- time range: without this index each page would read every event of the
-- environment. One more entry per event (not per delivery).
CREATE INDEX events_environment_recent_idx ON events (environment_id, created_at DESC, seq DESC);

-- Per-endpoint attempt statistics in 5-minute buckets, for the portal's
-- charts (success rate, p50/p99 latency over the last 24 h). Each api
-- process adds up the attempts it recorded in memory and writes its sums
-- every few seconds, so the outcome path gains no statement and no hot
-- row; a crash loses at most those seconds of chart data, never an
-- attempt (the attempt log is the record). `latency_counts[i]` counts the
-- attempts whose latency fell in bucket i of the api's fixed bounds
-- (`app::attempt_stats::LATENCY_BOUNDS_MS`, the last one open-ended).
CREATE TABLE endpoint_attempt_stats (
    endpoint_id     uuid NOT NULL REFERENCES webhook_endpoints (id),
    bucket_start    timestamptz NOT NULL,
    attempts        bigint NOT NULL,
    succeeded       bigint NOT NULL,
    latency_counts  bigint[] NOT NULL,
    PRIMARY KEY (endpoint_id, bucket_start)
);
CREATE INDEX endpoint_attempt_stats_age_idx ON endpoint_attempt_stats (bucket_start);
