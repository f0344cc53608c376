-- A lane known to be idle: no head and nothing queued, as its last
-- promotion found it under the lane's lock. An expansion whose event opens
-- such a lane writes its delivery as the head at once (pending, numbered
-- `last_position + 1`) instead of queueing it for a promotion of its own
-- (a second transaction, and a second version of the delivery row). Only a
-- promotion sets it, only under the lane's lock; a promotion or an
-- expansion that makes a head clears it under the same lock. `false` says
-- nothing (the lane may be idle or not) and is always safe: the delivery
-- is queued and promoted as before. Existing lanes start unknown.
ALTER TABLE ordering_lanes ADD COLUMN idle boolean NOT NULL DEFAULT false;
