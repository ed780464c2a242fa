-- A variant for bench/queue_indexes.py --compare, not a migration: one index of waiting and
-- running jobs by status, lease and task, in place of jobs_lease_idx (running jobs by lease)
-- and jobs_live_task_idx (waiting and running jobs by task): one index write fewer per claim.
drop index if exists thumbq.jobs_lease_idx;
drop index if exists thumbq.jobs_live_task_idx;
create index if not exists jobs_live_idx on thumbq.jobs (status, lease_expires_at, task)
  where status in ('pending', 'processing');
