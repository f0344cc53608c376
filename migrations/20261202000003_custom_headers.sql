-- Custom headers per endpoint (issue 27): sent with every delivery. The
-- pairs are stored encrypted like signing secrets (a header is often a
-- credential), under the key ring's key id; reads show the names with the
-- values masked from `headers_shown`, so listing endpoints decrypts nothing.
ALTER TABLE webhook_endpoints
  ADD COLUMN headers_key_id text,
  ADD COLUMN headers_ciphertext bytea,
  ADD COLUMN headers_shown jsonb NOT NULL DEFAULT '[]',
  ADD CONSTRAINT webhook_endpoints_headers_sealed CHECK ((headers_key_id IS NULL) = (headers_ciphertext IS NULL));
