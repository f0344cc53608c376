-- The delivery relay finds due work endpoint by endpoint: a walk over the
-- endpoints that have unleased pending rows, each asked for its oldest due
-- rows only when it has a free slot. An endpoint at its in-flight cap then
-- costs one index probe per pass however large its parked backlog, where the
-- scan in due order used to read every row of that backlog on every pass.
CREATE INDEX webhook_deliveries_waiting_idx ON webhook_deliveries (endpoint_id, next_attempt_at)
    WHERE state = 'pending' AND dispatched_at IS NULL;

-- Leases that ran out (their attempt was lost) in expiry order, without
-- reading the waiting rows that are due beside them.
CREATE INDEX webhook_deliveries_lease_expiry_idx ON webhook_deliveries (next_attempt_at)
    WHERE state = 'pending' AND dispatched_at IS NOT NULL;
