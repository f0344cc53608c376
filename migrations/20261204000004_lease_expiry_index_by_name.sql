-- The leased rows had two indexes with one predicate: by endpoint
-- (`webhook_deliveries_leased_idx`, which counts an endpoint's attempts in
-- flight) and by expiry (this one, which finds leases that ran out). With
-- the same predicate the planner could serve an endpoint's count from the
-- expiry index, reading every leased row and filtering by endpoint, and it
-- did whenever the statistics of the moment made that index look smaller:
-- the generic plans of the expansion, the refill and the relay's due walk
-- then read every lease once per endpoint (relay-bench `w4`: 430 buffers
-- and 3 ms per count instead of 5 and 0.1 ms; half its runs collapsed to a
-- healthy p99 of 25 s). The expiry index now carries a clause only the
-- statements that want it state (`next_attempt_at > '-infinity'`, true of
-- every row), so no other statement can be planned on it.
DROP INDEX webhook_deliveries_lease_expiry_idx;
CREATE INDEX webhook_deliveries_lease_expiry_idx ON webhook_deliveries (next_attempt_at)
    WHERE state = 'pending' AND dispatched_at IS NOT NULL AND next_attempt_at > '-infinity';
