-- Relays claim rows with a lease instead of holding row locks while they
-- talk to the broker, and a dispatcher claims an attempt before sending it.

-- The outbox relay's claim on unpublished events: set in one statement
-- before publishing, cleared (or left to expire, after a crash) after. An
-- event whose claim has expired is published again under the same message
-- id, which the broker drops inside its duplicate window.
ALTER TABLE events ADD COLUMN relay_claim_until timestamptz;

-- Who is sending the current attempt, and until when: set when a dispatcher
-- fetches the attempt's material, cleared by its outcome. Another dispatcher
-- holding a second copy of the same job is refused the material while the
-- claim lasts, so an attempt already sent and recorded is not sent again.
ALTER TABLE webhook_deliveries ADD COLUMN sending_by uuid, ADD COLUMN sending_until timestamptz;
