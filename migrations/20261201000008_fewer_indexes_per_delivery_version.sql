-- Every new version of a delivery row (written, leased, recorded) adds an
-- entry to each index whose predicate it meets. Two of them only restated
-- what the narrower partial indexes already hold:
-- - `webhook_deliveries_due_idx` (next_attempt_at) WHERE pending: every
--   pending row is either waiting (`webhook_deliveries_waiting_idx`) or
--   leased (`..._leased_idx`, `..._lease_expiry_idx`); the earliest due time
--   is now read from those (one probe per endpoint with waiting rows, and
--   the earliest lease), and the queue depths count them separately;
-- - `webhook_deliveries_endpoint_pending_idx` (endpoint_id) WHERE pending:
--   an endpoint's pending rows are its waiting rows and its leased rows,
--   both indexed by endpoint, and the two statements that read them
--   (switching an endpoint off, holding its deliveries) say so.
-- A delivery handed out with its expansion now writes 6 index entries over
-- its life instead of 8; one that waits behind its endpoint's cap, 9
-- instead of 13. The planner also can no longer take the time-ordered index
-- for a per-endpoint read (it did, for the refill, when the statistics said
-- few rows were pending, reading every waiting row of every endpoint).
DROP INDEX IF EXISTS webhook_deliveries_due_idx;
DROP INDEX IF EXISTS webhook_deliveries_endpoint_pending_idx;
