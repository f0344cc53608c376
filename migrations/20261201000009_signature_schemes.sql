-- Each endpoint picks how its deliveries are signed (issue 13):
-- 'relay-v1' (the shared contract, what every endpoint so far used),
-- 'standard-webhooks' (HMAC-SHA256 keyed with the secret's base64-decoded
-- bytes) or 'standard-webhooks-ed25519' (a key pair; receivers hold only the
-- public half).
--
-- The signing material stays in the secret columns whatever the scheme:
-- a `whsec_` secret under the two symmetric schemes, an ed25519 private key
-- (`whsk_`, its 32-byte seed) under the asymmetric one, encrypted and
-- re-wrapped exactly like any secret, rotated with the same 24 h window. So
-- the reads that hand out material, and the re-wrap, need no second set of
-- columns; only the public halves are new, kept in clear because they are
-- public.
ALTER TABLE webhook_endpoints
    ADD COLUMN signature_scheme text NOT NULL DEFAULT 'relay-v1'
        CONSTRAINT webhook_endpoints_signature_scheme_check
        CHECK (signature_scheme IN ('relay-v1', 'standard-webhooks', 'standard-webhooks-ed25519')),
    -- `whpk_` + base64 of the 32-byte ed25519 public key, while the scheme is
    -- the asymmetric one; the previous key's through its rotation window.
    ADD COLUMN public_key text,
    ADD COLUMN previous_public_key text,
    -- When the scheme last changed (NULL: as created).
    ADD COLUMN signature_scheme_changed_at timestamptz,
    ADD CONSTRAINT webhook_endpoints_public_key_check
        CHECK ((signature_scheme = 'standard-webhooks-ed25519') = (public_key IS NOT NULL));
