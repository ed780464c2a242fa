-- The operator page (GET /operator): one read of everything it shows, and the dead-letter
-- replay. Every figure is bounded by the backlog or by a recent window (the last hour of
-- finished jobs, the last day of errors), never by the whole history, so the page costs the
-- same with a million finished jobs as with none.

-- Each of thumbq's queues: its messages, the oldest one's age, and how many of its jobs run now
-- (a running job keeps its message, invisible, until it ends).
-- pgmq.metrics is called from plpgsql, resolved at call time, so that `alter extension pgmq
-- update` can re-create it under thumbq (as queue_metrics does).
create or replace function thumbq.operator_queues()
returns table (queue_name text, priority integer, depth bigint, oldest_age_s integer,
               in_flight bigint)
language plpgsql
stable
as $$
begin
  return query
    with q as (
      select thumbq.band_queue(p.p) as queue_name, p.p as priority from generate_series(0, 9) p(p)
      union all
      select 'thumbq_dlq', null
    ), running as (
      select j.priority::integer as priority, count(*) as n from thumbq.jobs j
       where j.status = 'processing' group by j.priority
    )
    select q.queue_name, q.priority, m.queue_length, m.oldest_msg_age_sec,
           coalesce(r.n, 0)::bigint
      from q
     cross join lateral pgmq.metrics(q.queue_name) m
      left join running r on r.priority = q.priority
     order by q.priority nulls last;
end
$$;

-- Everything the operator page shows, as one JSON document: queues, tasks, throughput per
-- minute over the last hour, failures of the last day by code with example files, the
-- dead-letter queue, running jobs and recent batch runs (at most p_limit rows per list).
create or replace function thumbq.operator_overview(p_limit integer default 50)
returns jsonb
language sql
stable
as $$
  with lim as (select least(greatest(coalesce(p_limit, 50), 1), 500) as n),
  q_all as (select * from thumbq.operator_queues()),
  queues as (
    select coalesce(jsonb_agg(jsonb_build_object(
             'queue', q.queue_name, 'priority', q.priority, 'depth', q.depth,
             'waiting', greatest(q.depth - q.in_flight, 0), 'in_flight', q.in_flight,
             'oldest_age_s', q.oldest_age_s)
             order by q.priority nulls last), '[]'::jsonb) as v
      from q_all q
     where q.priority is null or q.priority = 0 or q.depth > 0 or q.in_flight > 0
  ),
  task_counts as (
    select j.task,
           count(*) filter (where j.status = 'pending') as pending,
           count(*) filter (where j.status = 'processing') as processing,
           0::bigint as completed_1h, 0::bigint as failed_1h
      from thumbq.jobs j where j.status in ('pending', 'processing') group by j.task
    union all
    select j.task, 0, 0,
           count(*) filter (where j.status = 'completed'),
           count(*) filter (where j.status = 'failed')
      from thumbq.jobs j
     where j.completed_at >= date_trunc('minute', now()) - interval '59 minutes'
     group by j.task
  ),
  tasks as (
    select coalesce(jsonb_agg(jsonb_build_object(
             'task', t.task, 'pending', t.pending, 'processing', t.processing,
             'completed_1h', t.completed_1h, 'failed_1h', t.failed_1h) order by t.task),
             '[]'::jsonb) as v
      from (select c.task, sum(c.pending)::bigint as pending,
                   sum(c.processing)::bigint as processing,
                   sum(c.completed_1h)::bigint as completed_1h,
                   sum(c.failed_1h)::bigint as failed_1h
              from task_counts c group by c.task) t
  ),
  done as (
    select date_trunc('minute', j.completed_at) as minute,
           count(*) filter (where j.status = 'completed') as completed,
           count(*) filter (where j.status in ('failed', 'unsupported')) as failed
      from thumbq.jobs j
     where j.completed_at >= date_trunc('minute', now()) - interval '59 minutes'
     group by 1
  ),
  throughput as (
    select jsonb_agg(jsonb_build_object('minute', m.minute,
                                        'completed', coalesce(d.completed, 0),
                                        'failed', coalesce(d.failed, 0)) order by m.minute) as v
      from generate_series(date_trunc('minute', now()) - interval '59 minutes',
                           date_trunc('minute', now()), interval '1 minute') m(minute)
      left join done d on d.minute = m.minute
  ),
  errors as (
    select j.id, j.error_code, j.status, j.task, j.group_id, j.source_key, j.last_error,
           j.updated_at
      from thumbq.jobs j
     where j.error_code is not null and j.updated_at > now() - interval '1 day'
       and j.status <> 'completed'
       -- A cancel on request is no failure; a file missing from storage is.
       and (j.status <> 'cancelled' or j.error_code = 'source_missing')
  ),
  failures as (
    select coalesce(jsonb_agg(jsonb_build_object(
             'error_code', c.error_code, 'count', c.n, 'statuses', c.statuses,
             'examples', c.examples) order by c.n desc, c.error_code), '[]'::jsonb) as v
      from (select s.error_code, sum(s.n)::bigint as n,
                   jsonb_object_agg(s.status, s.n) as statuses,
                   (select jsonb_agg(x.v) from (
                      select jsonb_build_object(
                               'job_id', e.id, 'task', e.task, 'group_id', e.group_id,
                               'source_key', e.source_key, 'status', e.status,
                               'message', left(e.last_error, 300)) as v
                        from errors e where e.error_code = s.error_code
                       order by e.updated_at desc, e.id desc limit 3) x) as examples
              from (select e.error_code, e.status, count(*) as n from errors e group by 1, 2) s
             group by s.error_code) c
  ),
  dead as (
    select coalesce(jsonb_agg(jsonb_build_object(
             'job_id', d.id, 'task', d.task, 'group_id', d.group_id,
             'source_key', d.source_key, 'error_code', d.error_code,
             'message', left(d.last_error, 300), 'attempts', d.attempts,
             'failed_at', d.completed_at) order by d.completed_at desc, d.id desc),
             '[]'::jsonb) as v
      from (select j.* from thumbq.jobs j
             where j.status = 'failed' and j.dlq_msg_id is not null
             order by j.completed_at desc, j.id desc
             limit (select n from lim)) d
  ),
  dead_total as (
    -- The dead-letter queue's length: one message per dead-lettered job.
    select coalesce(sum(q.depth), 0)::bigint as n from q_all q where q.queue_name = 'thumbq_dlq'
  ),
  running as (
    select coalesce(jsonb_agg(jsonb_build_object(
             'job_id', r.id, 'task', r.task, 'group_id', r.group_id,
             'source_key', r.source_key, 'worker_id', r.worker_id, 'attempts', r.attempts,
             'max_attempts', r.max_attempts, 'started_at', r.started_at,
             'lease_expires_at', r.lease_expires_at, 'progress_done', r.progress_done,
             'progress_total', r.progress_total) order by r.started_at, r.id), '[]'::jsonb) as v
      from (select j.* from thumbq.jobs j where j.status = 'processing'
             order by j.started_at, j.id limit (select n from lim)) r
  ),
  runs as (
    select coalesce(jsonb_agg(jsonb_build_object(
             'id', r.id, 'worker_id', r.worker_id, 'started_at', r.started_at,
             'finished_at', r.finished_at, 'claimed', r.claimed, 'processed', r.processed,
             'succeeded', r.succeeded, 'failed', r.failed, 'retried', r.retried,
             'remaining', r.remaining, 'stopped_reason', r.stopped_reason,
             'duration_ms', r.duration_ms, 'budget_ms', r.budget_ms)
             order by r.started_at desc), '[]'::jsonb) as v
      from (select b.* from thumbq.batch_runs b order by b.started_at desc
             limit least((select n from lim), 20)) r
  )
  select jsonb_build_object(
    'generated_at', now(),
    'queues', (select v from queues),
    'tasks', (select v from tasks),
    'throughput', (select v from throughput),
    'failures', (select v from failures),
    'dead_letters', (select v from dead),
    'dead_letters_total', (select n from dead_total),
    'running', (select v from running),
    'runs', (select v from runs))
$$;

-- Replay dead letters: each job in p_job_ids (every dead-lettered job when null) that failed
-- for good with a dead letter is queued again as retry_failed does for a group: fresh attempts,
-- its dead letter removed, exactly one new message (a job of an ordering key only when it is
-- the key's head; the rest get theirs when the head is done). Returns the ids replayed.
create or replace function thumbq.replay_dead_letters(p_job_ids bigint[])
returns bigint[]
language sql
as $$
  select thumbq.requeue_jobs(array(
    select j.id from thumbq.jobs j
     where j.status = 'failed' and j.dlq_msg_id is not null
       and (p_job_ids is null or j.id = any(p_job_ids))))
$$;

-- Operators only: the page calls these with the admin secret, never as a Supabase user.
revoke all on function thumbq.operator_queues() from public;
revoke all on function thumbq.operator_overview(integer) from public;
revoke all on function thumbq.replay_dead_letters(bigint[]) from public;
do $$
begin
  if exists (select 1 from pg_roles where rolname = 'anon') then
    revoke all on function thumbq.operator_queues() from anon, authenticated;
    revoke all on function thumbq.operator_overview(integer) from anon, authenticated;
    revoke all on function thumbq.replay_dead_letters(bigint[]) from anon, authenticated;
  end if;
end
$$;
