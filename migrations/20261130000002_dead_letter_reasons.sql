-- Why a delivery was dead-lettered, so an operator can tell a customer's
-- failing endpoint (attempts_exhausted) from one the tenant switched off.
ALTER TABLE webhook_dead_letters
    ADD COLUMN reason text NOT NULL DEFAULT 'attempts_exhausted'
        CHECK (reason IN ('attempts_exhausted', 'endpoint_disabled', 'endpoint_deleted'));

-- Pending deliveries of one endpoint: read when an endpoint is disabled or
-- deleted, and when counting what an endpoint has outstanding.
CREATE INDEX webhook_deliveries_endpoint_pending_idx ON webhook_deliveries (endpoint_id) WHERE state = 'pending';

-- Attempts handed to the broker and not yet reported, per endpoint: the
-- delivery relay counts these to cap what one endpoint can have outstanding.
-- Holds at most the cap per endpoint (plus expired leases), so counting is cheap.
CREATE INDEX webhook_deliveries_leased_idx ON webhook_deliveries (endpoint_id) WHERE state = 'pending' AND dispatched_at IS NOT NULL;
