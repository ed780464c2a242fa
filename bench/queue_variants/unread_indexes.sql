-- A variant for bench/queue_indexes.py --compare, not a migration (the pages, metrics and
-- retention read these): every index of thumbq.jobs that no statement of enqueue, claim or
-- complete reads, dropped, to measure what they cost the transitions together.
drop index thumbq.jobs_dead_letters_idx, thumbq.jobs_delayed_idx, thumbq.jobs_errors_idx,
  thumbq.jobs_finished_idx, thumbq.jobs_group_errors_idx, thumbq.jobs_group_status_idx,
  thumbq.jobs_held_idx, thumbq.jobs_task_idempotency_key;
