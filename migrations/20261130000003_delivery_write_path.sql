-- The delivery tables take the most writes; these changes take cost off each
-- one without giving up a guarantee.

-- Every change of a delivery's schedule (lease, outcome) writes a new row
-- version into each of the table's indexes. Nothing reads deliveries by
-- environment alone (tenants read them by event, which the unique
-- (event_id, endpoint_id) index serves), so this index was pure write cost.
DROP INDEX IF EXISTS webhook_deliveries_environment_idx;

-- A foreign key to environments makes every inserted delivery and attempt
-- row lock the (one, shared) environment row, so concurrent expansions and
-- outcome batches pile multixacts onto it. Both references are implied by
-- the keys that stay: a delivery's (environment_id, event_id) references its
-- event, whose environment is checked; an attempt references its delivery.
ALTER TABLE webhook_deliveries DROP CONSTRAINT IF EXISTS webhook_deliveries_environment_id_fkey;
ALTER TABLE delivery_attempts DROP CONSTRAINT IF EXISTS delivery_attempts_environment_id_fkey;
