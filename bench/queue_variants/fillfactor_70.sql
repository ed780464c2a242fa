-- A variant for bench/queue_indexes.py --compare, not a migration: room on each page of
-- thumbq.jobs for the new row versions of its updates (which are never HOT: every transition
-- changes status, and status is in jobs_group_status_idx and in seven partial indexes'
-- predicates).
alter table thumbq.jobs set (fillfactor = 70);
