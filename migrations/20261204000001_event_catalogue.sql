-- The event catalogue (issue 29): an environment's event types as a
-- resource, each with a description, an optional JSON Schema (2020-12) that
-- publishes of the type are checked against, examples, and a deprecation
-- mark. Types not in the catalogue keep working unless the environment
-- requires known types.
ALTER TABLE environments
  ADD COLUMN require_known_event_types boolean NOT NULL DEFAULT false;

-- `schema` and `examples` are kept as the text the tenant sent (jsonb would
-- reorder keys and rewrite numbers); `revision` grows with every change, so
-- an api can tell whether the validator it compiled is still the type's.
CREATE TABLE event_types (
    environment_id  uuid NOT NULL REFERENCES environments (id),
    name            text NOT NULL,
    description     text NOT NULL DEFAULT '',
    schema          text,
    examples        text NOT NULL DEFAULT '[]',
    deprecated      boolean NOT NULL DEFAULT false,
    revision        bigint NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (environment_id, name)
);
