-- The whole data model of the foundation. Every tenant table carries
-- environment_id NOT NULL with a foreign key, and nothing cascades: deletion
-- of endpoints is soft, so a customer's dead letters outlive the endpoint.

CREATE TABLE environments (
    id              uuid PRIMARY KEY,
    name            text NOT NULL,
    endpoint_quota  integer NOT NULL DEFAULT 5 CHECK (endpoint_quota >= 0),
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- API keys are verified, never used: only a salted hash is kept, with a short
-- clear prefix to find the row without scanning.
CREATE TABLE api_keys (
    id              uuid PRIMARY KEY,
    environment_id  uuid NOT NULL REFERENCES environments (id),
    name            text NOT NULL,
    lookup_prefix   text NOT NULL UNIQUE,
    salt            bytea NOT NULL,
    key_hash        bytea NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    revoked_at      timestamptz
);
CREATE INDEX api_keys_environment_idx ON api_keys (environment_id);

-- The event record and the outbox in one: a row is written in the same
-- transaction as the request that produced it, and published_at marks the
-- relay's progress. The envelope is stored as the exact bytes every attempt
-- sends, so the body is byte-identical across attempts by construction.
CREATE TABLE events (
    -- Event ids are the tenant's to choose, so they are unique per
    -- environment: one tenant's id can never collide with, or reveal, another's.
    environment_id  uuid NOT NULL REFERENCES environments (id),
    id              uuid NOT NULL,
    -- The outbox's order and the relay's handle on a row.
    seq             bigserial NOT NULL UNIQUE,
    event_type      text NOT NULL,
    envelope        bytea NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    PRIMARY KEY (environment_id, id)
);
-- The outbox relay's only query: unpublished events, oldest first.
CREATE INDEX events_unpublished_idx ON events (seq) WHERE published_at IS NULL;

-- The dedup ledger: a consumer claims an event id in the same transaction as
-- the effect of handling it. Platform bookkeeping with no tenant content.
CREATE TABLE consumed_events (
    consumer        text NOT NULL,
    environment_id  uuid NOT NULL,
    event_id        uuid NOT NULL,
    handled_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, environment_id, event_id)
);

CREATE TABLE webhook_endpoints (
    id                          uuid PRIMARY KEY,
    environment_id              uuid NOT NULL REFERENCES environments (id),
    url                         text NOT NULL,
    event_types                 text[] NOT NULL CHECK (cardinality(event_types) > 0),
    -- AES-256-GCM, nonce || ciphertext || tag, under the key named beside it.
    secret_key_id               text NOT NULL,
    secret_ciphertext           bytea NOT NULL,
    previous_secret_key_id      text,
    previous_secret_ciphertext  bytea,
    secret_rotated_at           timestamptz,
    enabled                     boolean NOT NULL DEFAULT true,
    created_at                  timestamptz NOT NULL DEFAULT now(),
    deleted_at                  timestamptz
);
CREATE INDEX webhook_endpoints_environment_idx ON webhook_endpoints (environment_id) WHERE deleted_at IS NULL;

-- The retry schedule lives here, never in the broker. `attempt` is the index
-- into the tier table (1..7), so the next due time is a lookup.
-- `dispatched_at` marks a lease: when the relay hands an attempt to the broker
-- it pushes next_attempt_at out by the lease length, so an attempt whose
-- outcome never arrives falls due again by itself and is re-published.
CREATE TABLE webhook_deliveries (
    id               uuid PRIMARY KEY,
    environment_id   uuid NOT NULL REFERENCES environments (id),
    endpoint_id      uuid NOT NULL REFERENCES webhook_endpoints (id),
    event_id         uuid NOT NULL,
    attempt          integer NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    -- 0 for the original run of attempts, +1 for each dead-letter replay, so
    -- a replayed attempt 1 is never mistaken for the original attempt 1.
    generation       integer NOT NULL DEFAULT 0,
    state            text NOT NULL DEFAULT 'pending',
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    dispatched_at    timestamptz,
    last_status      integer,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_deliveries_event_fk FOREIGN KEY (environment_id, event_id) REFERENCES events (environment_id, id),
    CONSTRAINT webhook_deliveries_event_endpoint_unique UNIQUE (event_id, endpoint_id),
    CONSTRAINT webhook_deliveries_state_check CHECK (state IN ('pending', 'delivered', 'dead'))
);
-- The delivery relay's only query; partial, so finished rows cost nothing.
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_environment_idx ON webhook_deliveries (environment_id);

-- One row per attempt that reported an outcome. The primary key is what makes
-- outcome recording idempotent: a repeated report finds its row and changes
-- nothing.
CREATE TABLE delivery_attempts (
    delivery_id     uuid NOT NULL REFERENCES webhook_deliveries (id),
    generation      integer NOT NULL,
    attempt         integer NOT NULL,
    environment_id  uuid NOT NULL REFERENCES environments (id),
    http_status     integer,
    error           text,
    latency_ms      bigint NOT NULL,
    response_body   bytea,
    decision        text NOT NULL CHECK (decision IN ('delivered', 'rescheduled', 'dead_lettered')),
    next_attempt_at timestamptz,
    attempted_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (delivery_id, generation, attempt)
);

CREATE TABLE webhook_dead_letters (
    id                uuid PRIMARY KEY,
    environment_id    uuid NOT NULL REFERENCES environments (id),
    delivery_id       uuid NOT NULL REFERENCES webhook_deliveries (id),
    endpoint_id       uuid NOT NULL REFERENCES webhook_endpoints (id),
    event_id          uuid NOT NULL,
    attempts          integer NOT NULL,
    last_status       integer,
    last_error        text,
    dead_lettered_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_dead_letters_event_fk FOREIGN KEY (environment_id, event_id) REFERENCES events (environment_id, id)
);
CREATE INDEX webhook_dead_letters_environment_idx ON webhook_dead_letters (environment_id, dead_lettered_at DESC);
CREATE INDEX webhook_dead_letters_age_idx ON webhook_dead_letters (dead_lettered_at);
