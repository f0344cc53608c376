-- An endpoint's rate limit (issue 27): at most rate_per_second attempts a
-- second with bursts of rate_burst, for the endpoint across every api and
-- dispatcher. NULL: unlimited.
ALTER TABLE webhook_endpoints
  ADD COLUMN rate_per_second integer CHECK (rate_per_second BETWEEN 1 AND 10000),
  ADD COLUMN rate_burst integer CHECK (rate_burst BETWEEN 1 AND 10000),
  ADD CONSTRAINT webhook_endpoints_rate_whole CHECK ((rate_per_second IS NULL) = (rate_burst IS NULL));
-- The endpoint's rate gate, a generic cell rate algorithm's theoretical
-- arrival time: an attempt may be leased at t when t >= rate_tat - (burst -
-- 1) / rate, and each lease moves it on by 1 / rate from max(rate_tat, t).
-- Updated by the statement that leases (the row lock serialises leases of
-- one endpoint across processes); -infinity: nothing sent yet.
ALTER TABLE endpoint_health ADD COLUMN rate_tat timestamptz NOT NULL DEFAULT '-infinity';
