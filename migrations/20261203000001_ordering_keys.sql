-- Ordering keys (issue 28): an event may name one. The events of one key in
-- one environment are numbered from 1 without gaps in the order the api
-- accepted them (`ordering_sequence`), from `ordering_keys`, whose row a
-- publish locks before it writes its events and holds until it commits: a
-- key's numbers are its commit order and its outbox (`seq`) order.
ALTER TABLE events
  ADD COLUMN ordering_key text CHECK (octet_length(ordering_key) BETWEEN 1 AND 256),
  ADD COLUMN ordering_sequence bigint;

-- One row per key ever published, never deleted: a key's numbers only grow,
-- even after its events are gone.
CREATE TABLE ordering_keys (
    environment_id  uuid NOT NULL,
    ordering_key    text NOT NULL,
    last_sequence   bigint NOT NULL CHECK (last_sequence >= 0),
    PRIMARY KEY (environment_id, ordering_key)
);

-- A key's events by number, for deliveries that keep their order (and a
-- proof that no number is taken twice).
CREATE UNIQUE INDEX events_ordering_idx ON events (environment_id, ordering_key, ordering_sequence)
  WHERE ordering_key IS NOT NULL;
