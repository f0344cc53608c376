-- Each logged attempt records the scheme it was signed with (issue 13: a
-- change of an endpoint's scheme signs the next attempt, and the log shows
-- which attempt that was). NULL for attempts logged before, and for reports
-- of a dispatcher that predates the field.
ALTER TABLE delivery_attempts
    ADD COLUMN signature_scheme text
        CONSTRAINT delivery_attempts_signature_scheme_check
        CHECK (signature_scheme IN ('relay-v1', 'standard-webhooks', 'standard-webhooks-ed25519'));
