-- Operational events: Relay tells a tenant about its endpoints' health
-- (disabled, recovered, failing, dead letters) by sending signed events to
-- an endpoint the tenant names, through the same outbox, stream and
-- delivery path as its own events.

-- The environment's operations endpoint; NULL: none (nothing is sent).
ALTER TABLE environments ADD COLUMN operations_endpoint_id uuid REFERENCES webhook_endpoints (id);

-- An operational event is for this endpoint only, whatever it subscribes
-- to; NULL for a tenant's events, which go to their subscribers.
ALTER TABLE events ADD COLUMN target_endpoint_id uuid;

-- Dead letters not yet announced, per endpoint: announced at most once a
-- minute per endpoint, as one event with the count.
CREATE TABLE dead_letter_notices (
    endpoint_id     uuid PRIMARY KEY REFERENCES webhook_endpoints (id),
    environment_id  uuid NOT NULL REFERENCES environments (id),
    pending         integer NOT NULL DEFAULT 0 CHECK (pending >= 0),
    first_at        timestamptz,
    last_sent_at    timestamptz
);
CREATE INDEX dead_letter_notices_pending_idx ON dead_letter_notices (first_at) WHERE pending > 0;
