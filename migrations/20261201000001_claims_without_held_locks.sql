-- Relays claim rows with a lease instead of holding row locks while they
-- talk to the broker, and a dispatcher claims an attempt before sending it.

-- The outbox relay's claim on unpublished events: set in one statement
-- before publishing, cleared (or left to expire, after a crash) after. An
-- event whose claim has expired is published again under the same message
-- id, which the broker drops inside its duplicate window.
ALTER TABLE events ADD COLUMN relay_claim_until timestamptz;

-- Who is sending a delivery's attempt, and until when: taken when a
-- dispatcher fetches the attempt's material. Another dispatcher holding a
-- second copy of the same job is refused the material while the claim lasts,
-- so an attempt already sent (and perhaps recorded) is not sent again. A
-- claim for an earlier attempt or generation is simply replaced; claims are
-- pruned once long expired.
-- Unlogged, and apart from the deliveries: a claim is written for every
-- attempt, and here it costs one narrow row with one index and no WAL,
-- instead of a new version of a delivery row and of each of its indexes. A
-- crash of Postgres empties the table, which only reopens, for attempts in
-- flight at that moment, the window the claims close.
CREATE UNLOGGED TABLE attempt_claims (
    delivery_id  uuid PRIMARY KEY,
    generation   integer NOT NULL,
    attempt      integer NOT NULL,
    claimant     uuid NOT NULL,
    until        timestamptz NOT NULL
);
