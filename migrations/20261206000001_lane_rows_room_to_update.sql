-- The counters of ordered delivery are updated many times over their life:
-- a key's row (`ordering_keys`) once per publish batch that uses the key, a
-- lane's row (`ordering_lanes`) when an expansion takes it, when a promotion
-- numbers a head and when an ended head leaves it idle. None of those
-- updates changes an indexed column, so each can be a heap-only tuple
-- (no new primary key entry, the old version pruned on the page) if the
-- page has room for the new version. Packed full, as inserts leave them,
-- they mostly had none: under `relay-bench w6` 62 % of the lanes' updates
-- were heap-only, each of the rest a new index entry and a page more to
-- read. Room for one more version of each row on its page. Applies to
-- pages written from now on (an existing installation's full pages keep
-- their rows until they are rewritten).
ALTER TABLE ordering_lanes SET (fillfactor = 50);
ALTER TABLE ordering_keys SET (fillfactor = 50);
