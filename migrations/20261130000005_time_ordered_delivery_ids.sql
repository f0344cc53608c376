-- Delivery ids were random (v4): each expansion inserted its rows at random
-- places in the primary-key index, touching a different leaf page per row,
-- which grows costly once the table holds a large backlog. Version-7 UUIDs
-- (millisecond timestamp first, then random bits, RFC 9562) are still
-- unguessable enough for ids that are only ever looked up within a tenant,
-- and they append at the right edge of the index instead. Postgres 15 has
-- no built-in generator, hence this one.
CREATE FUNCTION relay_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;
