-- Bulk recovery of an endpoint: dead letters and held deliveries in a time
-- range sent again, throttled, as an operation that survives an api crash.

-- A recovery and its progress. The cursor is the (created_at, id) of the
-- last delivery handled: a pass takes the next few after it, sends them
-- again and moves the cursor in one transaction, so a crash between passes
-- loses nothing and repeats nothing.
CREATE TABLE recover_operations (
    id               uuid PRIMARY KEY,
    environment_id   uuid NOT NULL REFERENCES environments (id),
    endpoint_id      uuid NOT NULL REFERENCES webhook_endpoints (id),
    since            timestamptz NOT NULL,
    until            timestamptz NOT NULL,
    state            text NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'done', 'failed')),
    total            integer NOT NULL CHECK (total >= 0),
    completed        integer NOT NULL DEFAULT 0 CHECK (completed >= 0),
    cursor_at        timestamptz,
    cursor_id        uuid,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CHECK (since < until)
);
CREATE INDEX recover_operations_running_idx ON recover_operations (endpoint_id, created_at) WHERE state = 'running';

-- An endpoint's dead and held deliveries by creation time: what a recovery
-- reads, a range at a time.
CREATE INDEX webhook_deliveries_recoverable_idx ON webhook_deliveries (endpoint_id, created_at, id) WHERE state IN ('dead', 'held');
-- Whether a dead delivery still has its dead letter (kept 7 days): only
-- those are recovered.
CREATE INDEX webhook_dead_letters_delivery_idx ON webhook_dead_letters (delivery_id);
