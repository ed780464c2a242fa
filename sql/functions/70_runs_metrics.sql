-- Batch runs, the metrics an operator scrapes, and the events outbox webhooks deliver.

create or replace function thumbq.start_run(p_worker_id text, p_budget_ms integer,
                                            p_buffer_ms integer, p_concurrency integer)
returns jsonb
language sql
as $$
  with ins as (
    insert into thumbq.batch_runs (worker_id, budget_ms, buffer_ms, concurrency)
    values (p_worker_id, p_budget_ms, p_buffer_ms, p_concurrency)
    returning id
  )
  select jsonb_build_object(
    'run_id', (select id from ins),
    'stats', coalesce((select jsonb_agg(jsonb_build_object(
                         'kind', s.kind, 'size_class', s.size_class, 'ewma_ms', s.ewma_ms,
                         'max_ms', s.max_ms, 'samples', s.samples))
                       from thumbq.render_stats s), '[]'::jsonb))
$$;

-- Close a run: write its counts, merge the durations it observed into render_stats, and
-- return what is left (the work queues' length, since every job that waits or runs has exactly
-- one message, and the jobs of ordering keys waiting behind their heads) and which alerts are
-- raised (the same names as thumbq.alerts).
create or replace function thumbq.finish_run(p_run_id bigint, p_summary jsonb,
                                             p_stats jsonb default '[]')
returns jsonb
language plpgsql
as $$
declare
  v_remaining integer;
  v_alerts text[];
begin
  insert into thumbq.render_stats as s (kind, size_class, samples, ewma_ms, max_ms)
  select e->>'kind', (e->>'size_class')::integer, (e->>'samples')::bigint,
         (e->>'mean_ms')::double precision, (e->>'max_ms')::double precision
    from jsonb_array_elements(p_stats) e
   order by 1, 2
  on conflict (kind, size_class) do update set
    -- Weight the new mean by its samples, but never let old history outweigh recent runs.
    ewma_ms = s.ewma_ms + (excluded.ewma_ms - s.ewma_ms)
              * least(1.0, excluded.samples::double precision
                           / least(s.samples + excluded.samples, 50)),
    samples = s.samples + excluded.samples,
    max_ms = greatest(s.max_ms * 0.9, excluded.max_ms),
    updated_at = clock_timestamp();

  select m.queue_length + (select count(*) from thumbq.jobs j
                            where j.status = 'pending' and j.msg_id is null)
    into v_remaining from thumbq.work_metrics() m;

  update thumbq.batch_runs
     set finished_at = clock_timestamp(),
         claimed = (p_summary->>'claimed')::integer,
         processed = (p_summary->>'processed')::integer,
         succeeded = (p_summary->>'succeeded')::integer,
         failed = (p_summary->>'failed')::integer,
         retried = (p_summary->>'retried')::integer,
         skipped = (p_summary->>'skipped')::integer,
         released = (p_summary->>'released')::integer,
         remaining = v_remaining,
         stopped_reason = p_summary->>'stopped_reason',
         duration_ms = (p_summary->>'duration_ms')::integer,
         retry_after_ms = (p_summary->>'retry_after_ms')::integer
   where id = p_run_id;

  select coalesce(array_agg(a.name order by a.name), '{}') into v_alerts from thumbq.alerts a;
  update thumbq.batch_runs set alerts = v_alerts where id = p_run_id;
  return jsonb_build_object('remaining', v_remaining, 'alerts', to_jsonb(v_alerts));
end
$$;

-- pgmq's metrics through a plpgsql function, whose body is resolved at call time: a view that
-- called pgmq.metrics directly would stop `alter extension pgmq update` (1.4.4 -> 1.5) from
-- re-creating it (the queue_overview view reads it the same way).
create or replace function thumbq.queue_metrics(p_queue text)
returns table (queue_length bigint, newest_msg_age_sec integer, oldest_msg_age_sec integer)
language plpgsql
stable
as $$
begin
  return query
    select m.queue_length, m.newest_msg_age_sec, m.oldest_msg_age_sec from pgmq.metrics(p_queue) m;
end
$$;

-- The work queues (one per priority) together: how many messages, and the oldest one's age.
create or replace function thumbq.work_metrics()
returns table (queue_length bigint, newest_msg_age_sec integer, oldest_msg_age_sec integer)
language plpgsql
stable
as $$
begin
  return query
    select sum(m.queue_length)::bigint, min(m.newest_msg_age_sec)::integer,
           max(m.oldest_msg_age_sec)::integer
      from generate_series(0, 9) p(p)
     cross join lateral thumbq.queue_metrics(thumbq.band_queue(p.p)) m;
end
$$;

-- Metrics --------------------------------------------------------------------------------

-- One row per sample: metric name, labels, value. A plpgsql function, whose body is resolved
-- at call time, so that pgmq can be upgraded under it (see queue_metrics above). Histograms
-- are cumulative buckets (`le`) plus their `_count` and `_sum`: render times over the last
-- 15 minutes (three ticks of the 5-minute schedule), batch runs over the last hour (a few
-- rows). Each is one pass over its window: rows are counted by bucket (width_bucket), then
-- summed up to each bound. JIT is off: the planner's guesses for these small sets reached its
-- threshold, and compiling took 4 s of a 10 ms scrape (measured with 20 000 recent jobs).
create or replace function thumbq.metrics_rows()
returns table (metric text, labels jsonb, value double precision)
language plpgsql
stable
set jit = off
as $$
declare
  v_queue text;
  v_visible bigint;
  v_invisible bigint;
  v_oldest integer;
  v_jobs_since timestamptz := now() - interval '15 minutes';
  v_runs_since timestamptz := now() - interval '1 hour';
  -- Bucket bounds in ms (durations are whole ms): a duration d is within bound b when d <= b,
  -- i.e. width_bucket(d, bounds + 1) < the bound's position.
  v_batch_ms integer[] := array[250, 500, 1000, 2500, 5000, 7500, 10000, 15000, 30000, 60000];
  v_render_ms integer[] := array[10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000];
begin
  -- Jobs that wait or run, by task and status (a backlog, bounded by jobs_live_task_idx); 0
  -- for the tasks the engine knows (thumbnail and thumbq.tasks) with none, so that a series
  -- drops to zero instead of vanishing.
  return query
    with c as (
      select j.task, j.status, count(*) as n
        from thumbq.jobs j
       where j.status in ('pending', 'processing')
       group by j.task, j.status
    ), known as (
      select t.task, s.status
        from (select 'thumbnail' as task union select t.name from thumbq.tasks t) t
       cross join (values ('pending'), ('processing')) s(status)
      union
      select c.task, c.status from c
    )
    select 'thumbq_jobs', jsonb_build_object('task', k.task, 'status', k.status),
           coalesce(c.n, 0)::double precision
      from known k left join c on c.task = k.task and c.status = k.status;

  -- Jobs that ended in the last 15 minutes, by task and status (jobs_finished_idx).
  return query
    select 'thumbq_jobs_finished_15m', jsonb_build_object('task', j.task, 'status', j.status),
           count(*)::double precision
      from thumbq.jobs j
     where j.completed_at > v_jobs_since
       and j.status in ('completed', 'failed', 'unsupported', 'cancelled')
     group by j.task, j.status;

  -- Errors recorded in the last 15 minutes, by code (jobs_errors_idx): failures, retries and
  -- files that cannot be made.
  return query
    select 'thumbq_failures_15m', jsonb_build_object('code', j.error_code),
           count(*)::double precision
      from thumbq.jobs j
     where j.error_code is not null and j.updated_at > v_jobs_since
     group by j.error_code;

  -- Each queue: messages waiting (visible now) and in flight (invisible: read by a worker, or
  -- waiting out a retry's backoff), and the oldest message's age; as pgmq.metrics counts them.
  foreach v_queue in array array['thumbq_jobs', 'thumbq_jobs_p1', 'thumbq_jobs_p2',
                                 'thumbq_jobs_p3', 'thumbq_jobs_p4', 'thumbq_jobs_p5',
                                 'thumbq_jobs_p6', 'thumbq_jobs_p7', 'thumbq_jobs_p8',
                                 'thumbq_jobs_p9', 'thumbq_dlq'] loop
    if to_regclass(format('pgmq.%I', 'q_' || v_queue)) is null then
      continue;
    end if;
    execute format('select count(*) filter (where vt <= now()), count(*) filter (where vt > now()),'
                   ' extract(epoch from (now() - min(enqueued_at)))::integer from pgmq.%I',
                   'q_' || v_queue)
      into v_visible, v_invisible, v_oldest;
    return query values
      ('thumbq_queue_messages', jsonb_build_object('queue', v_queue, 'state', 'waiting'),
       v_visible::double precision),
      ('thumbq_queue_messages', jsonb_build_object('queue', v_queue, 'state', 'in_flight'),
       v_invisible::double precision),
      ('thumbq_queue_oldest_message_age_seconds', jsonb_build_object('queue', v_queue),
       coalesce(v_oldest, 0)::double precision);
  end loop;

  -- Tokens in each bucket now (refilled as take_tokens would), and its capacity.
  return query
    select m.metric, jsonb_build_object('bucket', b.name), m.value
      from thumbq.rate_limits b
     cross join lateral (values
       ('thumbq_rate_limit_tokens',
        least(b.capacity, b.tokens + b.refill_per_second
                                     * greatest(0, extract(epoch from now() - b.refilled_at)))),
       ('thumbq_rate_limit_capacity', b.capacity)) m(metric, value);

  -- Batch runs that started in the last hour and ended (batch_runs_started_idx), and
  -- thumbnails made in the last 15 minutes by the source's content type (jobs_finished_idx).
  return query
    with g as (
      select 'thumbq_batch_duration_seconds' as name, '{}'::jsonb as labels, v_batch_ms as bounds,
             width_bucket(r.duration_ms, array(select b + 1 from unnest(v_batch_ms) b)) as idx,
             count(*) as n, sum(r.duration_ms) as ms
        from thumbq.batch_runs r
       where r.started_at > v_runs_since and r.finished_at is not null
         and r.duration_ms is not null
       group by 4
      union all
      select 'thumbq_render_duration_seconds',
             jsonb_build_object('content_type', coalesce(x.content_type, 'unknown')), v_render_ms,
             x.idx, x.n, x.ms
        from (select j.content_type,
                     width_bucket(j.duration_ms, array(select b + 1 from unnest(v_render_ms) b))
                       as idx,
                     count(*) as n, sum(j.duration_ms) as ms
                from thumbq.jobs j
               where j.completed_at > v_jobs_since and j.status = 'completed'
                 and j.task = 'thumbnail' and j.duration_ms is not null
               group by 1, 2) x
    ), series as (
      -- A histogram with no sample still has its buckets (all zero).
      select 'thumbq_batch_duration_seconds' as name, '{}'::jsonb as labels,
             v_batch_ms as bounds
      union
      select g.name, g.labels, g.bounds from g
    )
    select s.name || '_bucket',
           s.labels || jsonb_build_object('le', (s.bounds[k]::double precision / 1000)::text),
           coalesce((select sum(g.n) from g where g.name = s.name and g.labels = s.labels
                       and g.idx < k), 0)::double precision
      from series s cross join generate_subscripts(s.bounds, 1) k
    union all
    select s.name || '_count', s.labels,
           coalesce((select sum(g.n) from g where g.name = s.name and g.labels = s.labels), 0)
             ::double precision
      from series s
    union all
    select s.name || '_sum', s.labels,
           coalesce((select sum(g.ms) from g where g.name = s.name and g.labels = s.labels), 0)
             ::double precision / 1000
      from series s;
end
$$;

-- The group webhook jobs live in; its own completion is never an event.
create or replace function thumbq.webhook_group()
returns text
language sql
immutable
as $$ select 'thumbq_webhooks'::text $$;

-- A group whose last waiting or running job ended: one group.completed event with its counts.
create or replace function thumbq.groups_completed_event()
returns trigger
language plpgsql
as $$
begin
  if exists (select 1 from thumbq.event_sinks s
              where s.name = 'webhook' and s.seen_at > now() - interval '1 day') then
    insert into thumbq.events (type, group_id, payload)
    values ('group.completed', new.group_id,
            jsonb_build_object('group_id', new.group_id, 'total', new.total,
                               'pending', new.pending, 'processing', new.processing,
                               'completed', new.completed, 'failed', new.failed,
                               'unsupported', new.unsupported, 'cancelled', new.cancelled,
                               'completed_at', clock_timestamp()));
  end if;
  return null;
end
$$;

drop trigger if exists groups_completed_event on thumbq.groups;
create trigger groups_completed_event after update on thumbq.groups
  for each row
  when (old.pending + old.processing > 0 and new.pending + new.processing = 0
        and new.group_id <> 'thumbq_webhooks')
  execute function thumbq.groups_completed_event();

-- Up to p_limit undelivered events become `webhook` jobs (priority 9, idempotency key from the
-- event id, so an event is enqueued once however often this runs), in this call's own
-- transaction; delivered events older than 30 days are pruned, p_limit at a time. Returns how
-- many jobs were enqueued.
create or replace function thumbq.enqueue_events(p_limit integer default 100,
                                                 p_max_attempts integer default 10)
returns integer
language plpgsql
as $$
declare
  v_ids uuid[];
  v_items jsonb;
  n integer := 0;
begin
  insert into thumbq.event_sinks as s (name) values ('webhook')
  on conflict (name) do update set seen_at = clock_timestamp()
   where s.seen_at < clock_timestamp() - interval '1 minute';

  select array_agg(e.id order by e.created_at, e.id),
         jsonb_agg(jsonb_build_object(
           'task', 'webhook', 'group_id', thumbq.webhook_group(), 'priority', 9,
           'idempotency_key', 'event:' || e.id, 'max_attempts', p_max_attempts,
           'payload', jsonb_build_object('id', e.id, 'type', e.type,
                                         'timestamp', e.created_at, 'data', e.payload))
           order by e.created_at, e.id)
    into v_ids, v_items
    from (select * from thumbq.events
           where job_id is null
           order by created_at
           limit greatest(p_limit, 0)
             for update skip locked) e;

  if v_ids is not null then
    update thumbq.events e set job_id = j.job_id
      from unnest(v_ids) with ordinality as i(id, ord)
      join thumbq.enqueue_jobs(v_items, thumbq.webhook_group(), p_max_attempts)
           with ordinality as j
        on j.ordinality = i.ord
     where e.id = i.id;
    get diagnostics n = row_count;
  end if;

  delete from thumbq.events
   where id in (select id from thumbq.events
                 where job_id is not null and created_at < now() - interval '30 days'
                 order by created_at
                 limit greatest(p_limit, 0));
  return n;
end
$$;

revoke execute on function thumbq.metrics_rows(), thumbq.webhook_group(),
  thumbq.groups_completed_event(), thumbq.enqueue_events(integer, integer)
  from public, anon, authenticated;

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.start_run(text, integer, integer, integer),
  thumbq.finish_run(bigint, jsonb, jsonb),
  thumbq.queue_metrics(text),
  thumbq.work_metrics()
  from public, anon, authenticated;
