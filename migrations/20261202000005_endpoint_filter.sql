-- An endpoint's payload filter (issue 27), as the tenant wrote it (JSON
-- text: numbers are compared exactly as written, so the text is kept rather
-- than jsonb). Expansion reads the filters of the environments it expands
-- for, through the partial index: environments without filters pay one
-- empty index probe per batch.
ALTER TABLE webhook_endpoints ADD COLUMN filter text CHECK (octet_length(filter) <= 16384);
CREATE INDEX webhook_endpoints_filtered ON webhook_endpoints (environment_id) WHERE filter IS NOT NULL AND deleted_at IS NULL;
