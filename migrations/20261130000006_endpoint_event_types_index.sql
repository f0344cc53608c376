-- Expansion matches an event's type against each live endpoint's
-- subscriptions. Through this index that is a lookup of the type, not a test
-- of every endpoint of the environment (an operator may raise the quota to
-- hundreds or thousands of endpoints).
CREATE INDEX webhook_endpoints_event_types_idx ON webhook_endpoints USING gin (event_types) WHERE deleted_at IS NULL;
