-- The W3C traceparent of the request that published an event, and of the
-- expansion that created a delivery, so the relays (which run later, in
-- other tasks and processes) continue the same trace. NULL when tracing is
-- off. An identifier only: it carries no tenant data.
ALTER TABLE events ADD COLUMN trace_context text;
ALTER TABLE webhook_deliveries ADD COLUMN trace_context text;
