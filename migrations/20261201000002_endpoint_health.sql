-- Endpoint health: a circuit per endpoint, automatic disabling, and
-- deliveries held (not dropped, not scanned) while an endpoint is down.

-- A delivery waiting for its endpoint to recover: its circuit is open, or
-- the endpoint was disabled automatically. Not in the due index, so a large
-- held backlog costs the delivery relay nothing; released (back to pending,
-- in order and throttled) when the endpoint recovers.
ALTER TABLE webhook_deliveries DROP CONSTRAINT webhook_deliveries_state_check;
ALTER TABLE webhook_deliveries ADD CONSTRAINT webhook_deliveries_state_check
    CHECK (state IN ('pending', 'held', 'delivered', 'dead'));
-- A held delivery keeps its attempt and its due time, so holding never
-- spends or hastens a retry. Held deliveries of an endpoint in the order
-- they fall due: the probe is the first of them (and only once it is due),
-- the release goes in this order, the tenant lists them so.
CREATE INDEX webhook_deliveries_held_idx ON webhook_deliveries (endpoint_id, next_attempt_at, id) WHERE state = 'held';

-- Why an endpoint is disabled; NULL exactly when it is enabled. `manual`:
-- the tenant switched it off (pending deliveries became dead letters).
-- `gone`: the receiver answered 410. `failing`: every attempt failed for the
-- environment's window. The last two hold matching deliveries.
ALTER TABLE webhook_endpoints ADD COLUMN disabled_reason text
    CHECK (disabled_reason IN ('manual', 'gone', 'failing'));
UPDATE webhook_endpoints SET disabled_reason = 'manual' WHERE NOT enabled;
ALTER TABLE webhook_endpoints ADD CONSTRAINT webhook_endpoints_enabled_matches_reason
    CHECK (enabled = (disabled_reason IS NULL));

-- Apart from the endpoint row: outcomes update it often, and an update of
-- the endpoint row would wait for (and block) expansions, which share-lock
-- their subscribers. Expansions take KEY SHARE here, which routine counter
-- updates do not conflict with; a change of `circuit` locks FOR UPDATE, so
-- it waits for expansions that read the old circuit, and no delivery is
-- written pending for an open circuit, or held for a closed one, unseen.
CREATE TABLE endpoint_health (
    endpoint_id           uuid PRIMARY KEY REFERENCES webhook_endpoints (id),
    circuit               text NOT NULL DEFAULT 'closed' CHECK (circuit IN ('closed', 'open', 'half_open')),
    consecutive_failures  integer NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    -- The first failure of the current run of failures.
    failing_since         timestamptz,
    last_success_at       timestamptz,
    last_failure_at       timestamptz,
    -- While open: when a held delivery is next sent as a probe.
    next_probe_at         timestamptz,
    -- The wait before the next probe; doubles after each failed probe.
    probe_interval_ms     bigint NOT NULL DEFAULT 0 CHECK (probe_interval_ms >= 0)
);
INSERT INTO endpoint_health (endpoint_id) SELECT id FROM webhook_endpoints;
CREATE INDEX endpoint_health_probe_idx ON endpoint_health (next_probe_at) WHERE circuit <> 'closed';

-- When an environment's endpoints are disabled for failing: every attempt
-- failed for this long, and at least this many.
ALTER TABLE environments
    ADD COLUMN disable_after_secs integer NOT NULL DEFAULT 86400 CHECK (disable_after_secs > 0),
    ADD COLUMN disable_min_failures integer NOT NULL DEFAULT 10 CHECK (disable_min_failures > 0);
