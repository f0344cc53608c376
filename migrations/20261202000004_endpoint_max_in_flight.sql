-- How many attempts an endpoint may have out at once, chosen by its tenant
-- (issue 27); NULL: the platform's RELAY_ENDPOINT_IN_FLIGHT_CAP, which also
-- bounds any choice. After an unanswered failure the endpoint gets one slot
-- whatever this says.
ALTER TABLE webhook_endpoints ADD COLUMN max_in_flight integer CHECK (max_in_flight BETWEEN 1 AND 1000);
