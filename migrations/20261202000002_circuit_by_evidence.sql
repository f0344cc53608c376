-- The circuit opens on evidence that an endpoint is down, not on a run of
-- unlucky attempts (issue 25): a failure rate over a sliding window, with a
-- minimum of attempts, no success for a while, and retries failing too.

-- `recovering`: a probe succeeded; new deliveries flow, and the held ones
-- are released as the receiver's answers come back (two more for each
-- success), so a receiver that just came back is not flooded.
ALTER TABLE endpoint_health DROP CONSTRAINT endpoint_health_circuit_check;
ALTER TABLE endpoint_health ADD CONSTRAINT endpoint_health_circuit_check
    CHECK (circuit IN ('closed', 'open', 'half_open', 'recovering'));

-- The window, as two aligned buckets of the window's length (the estimate
-- weighs the previous bucket by how much of it is still inside the window):
-- `window_ms` is that length (kept with the counts, so a read needs no
-- settings, and a changed setting starts the counts again),
-- `window_bucket` the current bucket's number (epoch ms / window_ms).
-- Counted from an endpoint's first failure on: while no failure is inside
-- the window, successes are not written here (they cost no statement).
-- `failed_retries`: failures of attempts after the first in the current run
-- of failures (evidence that retrying does not help either).
ALTER TABLE endpoint_health
    ADD COLUMN window_ms          bigint NOT NULL DEFAULT 120000 CHECK (window_ms > 0),
    ADD COLUMN window_bucket      bigint NOT NULL DEFAULT 0,
    ADD COLUMN window_attempts    integer NOT NULL DEFAULT 0 CHECK (window_attempts >= 0),
    ADD COLUMN window_failures    integer NOT NULL DEFAULT 0 CHECK (window_failures >= 0),
    ADD COLUMN previous_attempts  integer NOT NULL DEFAULT 0 CHECK (previous_attempts >= 0),
    ADD COLUMN previous_failures  integer NOT NULL DEFAULT 0 CHECK (previous_failures >= 0),
    ADD COLUMN failed_retries     integer NOT NULL DEFAULT 0 CHECK (failed_retries >= 0);

-- An endpoint is handed one attempt at a time (instead of its in-flight
-- cap) only while failing costs its lane: its last failure went unanswered
-- (a timeout, a connection refused), or its retries fail too. A fast 5xx
-- from a receiver that fails sometimes no longer narrows it (it did after
-- any failure, which slowed receivers that accept retries).
ALTER TABLE endpoint_health ADD COLUMN one_at_a_time boolean NOT NULL DEFAULT false;
UPDATE endpoint_health SET one_at_a_time = consecutive_failures > 0;

-- Circuits opened by the old rule (five failures in a row) are re-judged by
-- the new one: they recover, releasing what they hold as answers come back;
-- an endpoint that is really down opens again on evidence.
UPDATE endpoint_health SET circuit = 'recovering', next_probe_at = now(), probe_interval_ms = 0
WHERE circuit IN ('open', 'half_open')
  AND NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = endpoint_id AND e.disabled_reason IS NOT NULL);

-- The probe is the held delivery with the most attempts among those due
-- (a receiver that accepts retries answers it): per endpoint and attempt,
-- the earliest due.
CREATE INDEX webhook_deliveries_held_attempt_idx ON webhook_deliveries (endpoint_id, attempt, next_attempt_at) WHERE state = 'held';

-- Holding is bounded: a delivery held longer than its environment's
-- `max_held_secs` (7 days, the dead-letter window, by default) becomes a
-- dead letter `endpoint_failing`, replayable like any other.
ALTER TABLE webhook_deliveries ADD COLUMN held_since timestamptz;
UPDATE webhook_deliveries SET held_since = updated_at WHERE state = 'held';
CREATE INDEX webhook_deliveries_held_since_idx ON webhook_deliveries (held_since) WHERE state = 'held';
ALTER TABLE environments ADD COLUMN max_held_secs integer NOT NULL DEFAULT 604800 CHECK (max_held_secs > 0);

ALTER TABLE webhook_dead_letters DROP CONSTRAINT webhook_dead_letters_reason_check;
ALTER TABLE webhook_dead_letters ADD CONSTRAINT webhook_dead_letters_reason_check
    CHECK (reason IN ('attempts_exhausted', 'endpoint_disabled', 'endpoint_deleted', 'endpoint_failing'));
