-- Listeners (issue 29, relay-dev listen): a temporary endpoint whose
-- deliveries travel over a tenant's open call instead of HTTP. The endpoint
-- is an ordinary row (URL `listen://<its id>`); this row says whose it is and
-- whether its call is alive: the api holding the call stamps `seen_at`; when
-- the call ends (`ended_at`), or its api stops stamping, the upkeep deletes
-- the endpoint after a grace period, its pending deliveries ending as dead
-- letters with reason `listener_gone`. One live listener per API key.
CREATE TABLE listeners (
    endpoint_id     uuid PRIMARY KEY REFERENCES webhook_endpoints (id),
    environment_id  uuid NOT NULL REFERENCES environments (id),
    -- The API key's lookup prefix (unique per key): one listener per key.
    api_key_prefix  text NOT NULL,
    seen_at         timestamptz NOT NULL DEFAULT now(),
    ended_at        timestamptz,
    removed_at      timestamptz
);
CREATE UNIQUE INDEX listeners_one_per_key_idx ON listeners (api_key_prefix) WHERE removed_at IS NULL;

ALTER TABLE webhook_dead_letters DROP CONSTRAINT webhook_dead_letters_reason_check;
ALTER TABLE webhook_dead_letters ADD CONSTRAINT webhook_dead_letters_reason_check
    CHECK (reason IN ('attempts_exhausted', 'endpoint_disabled', 'endpoint_deleted', 'endpoint_failing', 'listener_gone'));
