-- The portal (issue 15): one-time links a tenant's backend mints for its
-- customer, and the sessions they are exchanged for. Only hashes of the
-- tokens are stored: a copy of the table opens nothing.
CREATE TABLE portal_links (
    token_hash      bytea PRIMARY KEY,
    environment_id  uuid NOT NULL REFERENCES environments (id),
    expires_at      timestamptz NOT NULL,
    used_at         timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX portal_links_expiry_idx ON portal_links (expires_at);

CREATE TABLE portal_sessions (
    token_hash      bytea PRIMARY KEY,
    environment_id  uuid NOT NULL REFERENCES environments (id),
    -- Every state-changing form carries it; a request without it is refused.
    csrf_token      text NOT NULL,
    expires_at      timestamptz NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX portal_sessions_expiry_idx ON portal_sessions (expires_at);
