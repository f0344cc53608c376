-- Ordered delivery per key (issue 28). An endpoint opts in with
-- `ordering = 'per_key'`: its deliveries of keyed events form one lane per
-- (endpoint, ordering key), and only a lane's head is ever pending or held;
-- the rest wait `queued` behind it, invisible to every relay pass, until the
-- head ends (delivered or dead) and the next is promoted.
ALTER TABLE webhook_endpoints
  ADD COLUMN ordering text NOT NULL DEFAULT 'none' CHECK (ordering IN ('none', 'per_key'));

ALTER TABLE webhook_deliveries DROP CONSTRAINT webhook_deliveries_state_check;
ALTER TABLE webhook_deliveries ADD CONSTRAINT webhook_deliveries_state_check
  CHECK (state IN ('pending', 'held', 'queued', 'delivered', 'dead'));

-- Set only on a delivery in a lane (decided when it is created, so a change
-- of the endpoint's ordering applies to deliveries created after it):
-- `ordering_key` names the lane; `ordering_rank` is its place in the lane's
-- queue (twice the event's number; a replay's is twice the key's last number
-- then, plus one: after everything published before the replay, before
-- everything published after); `ordering_position` is the number the lane
-- gave it when it became the head, sent as its sequence header.
ALTER TABLE webhook_deliveries
  ADD COLUMN ordering_key text,
  ADD COLUMN ordering_rank bigint,
  ADD COLUMN ordering_position bigint,
  ADD CONSTRAINT webhook_deliveries_lane_check CHECK ((ordering_key IS NULL) = (ordering_rank IS NULL)),
  ADD CONSTRAINT webhook_deliveries_queued_check CHECK (state <> 'queued' OR ordering_key IS NOT NULL);

-- A lane's head (whether it has one) and its queue in order (which row is
-- next). Rows outside lanes are in neither, so unordered traffic pays
-- nothing; a long queue costs its head's check nothing.
CREATE INDEX webhook_deliveries_lane_head_idx ON webhook_deliveries (endpoint_id, ordering_key)
  WHERE ordering_key IS NOT NULL AND state IN ('pending', 'held');
CREATE INDEX webhook_deliveries_lane_queue_idx ON webhook_deliveries (endpoint_id, ordering_key, ordering_rank, id)
  WHERE state = 'queued';

-- One row per lane ever used, never deleted: its lock serialises promotions
-- (so a lane never has two heads), and `last_position` only grows, so
-- the numbers a receiver sees for a key rise for ever.
CREATE TABLE ordering_lanes (
    endpoint_id    uuid NOT NULL,
    ordering_key   text NOT NULL,
    last_position  bigint NOT NULL DEFAULT 0 CHECK (last_position >= 0),
    PRIMARY KEY (endpoint_id, ordering_key)
);
