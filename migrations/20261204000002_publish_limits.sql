-- Admission control (issue 30): an operator may limit how fast an
-- environment publishes. A GCRA gate over one instant per environment
-- (`publish_tat`, the theoretical arrival time), taken by every api in one
-- statement, so the limit holds across apis. No limit (NULL): nothing is
-- taken and publishing costs no statement.
ALTER TABLE environments
  ADD COLUMN publish_per_second integer CHECK (publish_per_second BETWEEN 1 AND 10000),
  ADD COLUMN publish_burst integer CHECK (publish_burst BETWEEN 1 AND 10000),
  ADD COLUMN publish_tat timestamptz,
  ADD CONSTRAINT environments_publish_limit_check CHECK ((publish_per_second IS NULL) = (publish_burst IS NULL));
