-- Retired objects: what an earlier schema file created and no current file defines any more.
-- Applied (by `thumbq db init` and the generated Supabase migrations) after the versioned files
-- and before the function files, whenever this file changes, so that a database upgraded from
-- any release holds exactly what a fresh one holds (tests/db/test_migrations.py compares their
-- pg_dump) and no dead function stays callable. A fresh database runs it too: 002 and 003
-- still create what is listed here.
--
-- When a function file drops a function or changes its arguments, add the old signature here
-- (never a signature a function file still defines: a test checks that none of these exists
-- after `thumbq db init`). Objects go in the order their dependencies allow.

-- 0.1.0's group bookkeeping (002), replaced by apply_group_changes and thumbq.group_change.
drop function if exists thumbq.apply_group_deltas(thumbq.group_delta[]);
drop type if exists thumbq.group_delta;

-- 0.1.0's enqueue stage (003), replaced by enqueue_items_v2.
drop function if exists thumbq.enqueue_items(jsonb, text);

-- claim's earlier signatures: 0.1.0's (003), and two from before priorities had ageing.
drop function if exists thumbq.claim(text, integer, integer, text);
drop function if exists thumbq.claim(text, integer, integer, text, boolean);
drop function if exists thumbq.claim(text, integer, integer, text, boolean, integer);
drop function if exists thumbq.claim_job(text, bigint, integer, text, boolean);

-- 0.1.0's reap_stale() (003), replaced by reap_stale(p_limit integer default 5000): the same
-- call without arguments.
drop function if exists thumbq.reap_stale();

-- Helpers of the pre-release engine: locks by source key (now thumbq.lock_keys), and the
-- grants of the priority queues (now done where sql/010_engine.sql creates them).
drop function if exists thumbq.lock_source_keys(text[]);
drop function if exists thumbq.grant_queue(text);
