-- The outbox relay takes unpublished events environment by environment
-- (the oldest few of each, round robin), so one tenant's burst is not a
-- queue every other tenant's events wait behind.
CREATE INDEX events_unpublished_by_environment_idx ON events (environment_id, seq) WHERE published_at IS NULL;
