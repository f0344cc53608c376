-- Why a delivery was dead-lettered, so an operator can tell a customer's
-- failing endpoint (attempts_exhausted) from one the tenant switched off.
ALTER TABLE webhook_dead_letters
    ADD COLUMN reason text NOT NULL DEFAULT 'attempts_exhausted'
        CHECK (reason IN ('attempts_exhausted', 'endpoint_disabled', 'endpoint_deleted'));

-- Pending deliveries of one endpoint: read when an endpoint is disabled or
-- deleted, and when counting what an endpoint has outstanding.
CREATE INDEX webhook_deliveries_endpoint_pending_idx ON webhook_deliveries (endpoint_id) WHERE state = 'pending';
