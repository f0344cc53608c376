-- The three foreign keys on the rows every delivery writes check what the
-- statement writing them already guarantees, at a price paid per row: a
-- lookup through the SPI and a KEY SHARE lock on the referenced row (a
-- WAL record, and a multixact when another transaction holds that row
-- too), for each delivery inserted and each attempt logged. Measured on
-- relay-bench W1@150 they were a tenth to a fifth of Postgres's CPU
-- (`AfterTriggerEndQuery`, `SPI_execute_snapshot` in `perf`).
--
-- What each guaranteed holds by construction:
-- - a delivery's event: the expansion inserts deliveries only for events
--   it read and claimed in the same statement's transaction, and events are
--   never deleted;
-- - a delivery's endpoint: the expansion inserts them from the endpoint rows
--   it holds FOR SHARE in the same statement, and endpoints are deleted only
--   softly (`deleted_at`);
-- - an attempt's delivery: an attempt is logged only for a delivery the same
--   statement (or transaction) updated, and deliveries are never deleted.
-- Cold tables keep theirs (dead letters, health, recoveries, keys).
ALTER TABLE webhook_deliveries DROP CONSTRAINT IF EXISTS webhook_deliveries_event_fk;
ALTER TABLE webhook_deliveries DROP CONSTRAINT IF EXISTS webhook_deliveries_endpoint_id_fkey;
ALTER TABLE delivery_attempts DROP CONSTRAINT IF EXISTS delivery_attempts_delivery_id_fkey;
