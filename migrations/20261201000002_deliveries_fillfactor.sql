-- A dispatcher's claim on an attempt (sending_by, sending_until) changes no
-- indexed column, so it can be a heap-only update that writes no index
-- entry, but only where the row's page has room for the new version. Rows
-- are written densely by expansion; leaving a fifth of each page free lets
-- the claim stay on the page.
ALTER TABLE webhook_deliveries SET (fillfactor = 80);
