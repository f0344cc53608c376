-- OAuth2 client credentials towards a receiver (issue 27): the whole
-- configuration sealed with the key ring as one JSON document (the client
-- secret is in it), and what reads show of it (no secret).
ALTER TABLE webhook_endpoints
  ADD COLUMN oauth2_key_id text,
  ADD COLUMN oauth2_ciphertext bytea,
  ADD COLUMN oauth2_shown jsonb,
  ADD CONSTRAINT webhook_endpoints_oauth2_whole CHECK ((oauth2_key_id IS NULL) = (oauth2_ciphertext IS NULL));
