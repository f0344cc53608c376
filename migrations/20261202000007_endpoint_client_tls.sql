-- TLS towards a receiver (issue 27): a client certificate and its key the
-- dispatcher presents (sealed with the key ring like a signing secret, as
-- one PEM text; reads show client_certificate_shown), and a CA bundle the
-- endpoint pins (public PEM).
ALTER TABLE webhook_endpoints
  ADD COLUMN client_tls_key_id text,
  ADD COLUMN client_tls_ciphertext bytea,
  ADD COLUMN client_certificate_shown jsonb,
  ADD COLUMN ca_bundle text CHECK (octet_length(ca_bundle) <= 65536),
  ADD CONSTRAINT webhook_endpoints_client_tls_whole CHECK ((client_tls_key_id IS NULL) = (client_tls_ciphertext IS NULL));
