-- A variant for bench/queue_indexes.py --compare, not a migration (the group counts would go
-- wrong): the statement trigger that keeps thumbq.groups exact on each status change, off, to
-- measure what it costs the transitions.
alter table thumbq.jobs disable trigger jobs_groups_update;
