-- State transitions, one round trip each, callable from any language (and via PostgREST RPC).
-- Only the pgmq 1.4.4 API is called: create, send, send_batch, read, delete, archive,
-- set_vt(queue, msg_id, int), metrics, metrics_all, list_queues, purge_queue, drop_queue.

-- Token bucket -------------------------------------------------------------------------------

-- Take p_n tokens from bucket p_name in one statement. With p_partial, take as many as there
-- are (up to p_n). The FOR UPDATE sub-select reads the latest committed bucket, so concurrent
-- callers are serialised on the row and never over-issue; elapsed time is never negative even
-- when the clock was read before a lock wait. A missing bucket returns no row (no limit).
create or replace function thumbq.take_tokens(p_name text, p_n integer default 1,
                                              p_partial boolean default false)
returns table (granted boolean, taken integer, tokens_left double precision,
               retry_after_ms integer)
language sql
as $$
  with b as (
    select s.name, s.t, s.refill_per_second,
           least(s.capacity, s.tokens + s.refill_per_second
                 * greatest(0, extract(epoch from s.t - s.refilled_at))) as avail
      from (select r.*, clock_timestamp() as t
              from thumbq.rate_limits r where r.name = p_name for update) s
  ), d as (
    select b.*,
           case when p_n <= 0 then 0
                when p_partial then least(p_n, floor(b.avail)::integer)
                when b.avail >= p_n then p_n
                else 0 end as take
      from b
  )
  update thumbq.rate_limits r
     set tokens = d.avail - d.take,
         refilled_at = greatest(r.refilled_at, d.t)
    from d
   where r.name = d.name
  returning d.take > 0 or p_n <= 0,
            d.take,
            r.tokens,
            case when d.take >= p_n then 0
                 when d.refill_per_second <= 0 then null
                 else ceil(((case when p_partial then 1 else p_n end) - r.tokens) * 1000.0
                           / d.refill_per_second)::integer end
$$;

-- Give back tokens that were taken but not used (claimed messages that were never started).
create or replace function thumbq.refund_tokens(p_name text, p_n integer)
returns void
language sql
as $$
  update thumbq.rate_limits
     set tokens = least(capacity, tokens + greatest(p_n, 0))
   where name = p_name and p_n > 0
$$;

-- Enqueue ------------------------------------------------------------------------------------

-- The items of an enqueue call as rows; the last one wins when a key appears twice.
create or replace function thumbq.enqueue_items(p_items jsonb, p_group_id text)
returns table (ord bigint, source_key text, source_etag text, content_type text,
               group_id text, source_bytes bigint)
language sql
immutable
as $$
  select distinct on (i.value->>'source_key')
         i.ord, i.value->>'source_key', coalesce(i.value->>'etag', ''),
         nullif(i.value->>'content_type', ''),
         coalesce(nullif(i.value->>'group_id', ''), p_group_id),
         (i.value->>'bytes')::bigint
    from jsonb_array_elements(p_items) with ordinality as i(value, ord)
   order by i.value->>'source_key', i.ord desc
$$;

-- Enqueue many objects: p_items is a JSON array of
-- {"source_key", "etag"?, "content_type"?, "group_id"?, "bytes"?}. One row per
-- (source_key, etag): enqueueing the same version again returns the existing job; a cancelled
-- one is queued again (into the new group); a new etag supersedes (cancels) the pending or
-- processing jobs of older versions of the same key. Job row and pgmq message are written in
-- the same transaction, the message first so that the row is inserted once, with its msg_id.
create or replace function thumbq.enqueue_batch(p_items jsonb,
                                                p_group_id text default 'default',
                                                p_max_attempts integer default 3)
returns table (job_id bigint, source_key text, source_etag text, created boolean,
               status text)
language plpgsql
as $$
#variable_conflict use_column
declare
  v_superseded bigint[];
begin
  if jsonb_typeof(p_items) is distinct from 'array' then
    raise exception 'thumbq.enqueue_batch: p_items must be a JSON array' using errcode = '22023';
  end if;
  if exists (select 1 from jsonb_array_elements(p_items) e
              where jsonb_typeof(e) <> 'object' or coalesce(e->>'source_key', '') = '') then
    raise exception 'thumbq.enqueue_batch: every item needs a source_key' using errcode = '22023';
  end if;

  -- Older versions still waiting or running are superseded by the new etag.
  with s as (
    update thumbq.jobs j
       set status = 'cancelled', error_code = 'superseded',
           last_error = 'a newer version of the object (etag ' || i.source_etag
                        || ') was enqueued',
           completed_at = clock_timestamp(), updated_at = clock_timestamp(),
           lease_expires_at = null
      from thumbq.enqueue_items(p_items, p_group_id) i
     where j.source_key = i.source_key and j.source_etag <> i.source_etag
       and j.status in ('pending', 'processing')
    returning j.msg_id
  )
  select array_agg(s.msg_id) into v_superseded from s where s.msg_id is not null;
  if v_superseded is not null then
    perform pgmq.delete('thumbq_jobs', v_superseded);
  end if;

  -- A cancelled version asked for again is queued again.
  update thumbq.jobs j
     set status = 'pending', attempts = 0, error_code = null, last_error = null,
         completed_at = null, started_at = null, next_attempt_at = null, worker_id = null,
         group_id = i.group_id, max_attempts = p_max_attempts,
         msg_id = (select pgmq.send('thumbq_jobs', jsonb_build_object('job_id', j.id))),
         updated_at = clock_timestamp()
    from thumbq.enqueue_items(p_items, p_group_id) i
   where j.source_key = i.source_key and j.source_etag = i.source_etag
     and j.status = 'cancelled';

  return query
  with items as (
    select * from thumbq.enqueue_items(p_items, p_group_id)
  ), fresh as (
    select i.*, nextval(pg_get_serial_sequence('thumbq.jobs', 'id')) as id
      from items i
     where not exists (select 1 from thumbq.jobs j
                        where j.source_key = i.source_key and j.source_etag = i.source_etag)
  ), sent as (
    -- A concurrent enqueue of the same version can win the insert below; its message then
    -- points at no job and claim() deletes it.
    select f.*, (select pgmq.send('thumbq_jobs', jsonb_build_object('job_id', f.id))) as msg_id
      from fresh f
  ), ins as (
    insert into thumbq.jobs as j (id, group_id, source_key, source_etag, source_bytes,
                                  content_type, max_attempts, msg_id)
    select s.id, s.group_id, s.source_key, s.source_etag, s.source_bytes, s.content_type,
           p_max_attempts, s.msg_id
      from sent s
     order by s.ord
    on conflict on constraint jobs_source_version_key do nothing
    returning j.id, j.source_key, j.source_etag, j.status
  )
  select ins.id, ins.source_key, ins.source_etag, true, ins.status from ins
  union all
  select j.id, j.source_key, j.source_etag, false, j.status
    from items i
    join thumbq.jobs j on j.source_key = i.source_key and j.source_etag = i.source_etag
   where not exists (select 1 from ins where ins.source_key = i.source_key);
end
$$;

-- Enqueue one object version; see enqueue_batch.
create or replace function thumbq.enqueue(p_source_key text, p_source_etag text default '',
                                          p_group_id text default 'default',
                                          p_content_type text default null,
                                          p_source_bytes bigint default null,
                                          p_max_attempts integer default 3)
returns table (job_id bigint, source_key text, source_etag text, created boolean,
               status text)
language sql
as $$
  select * from thumbq.enqueue_batch(
    jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
      'source_key', p_source_key, 'etag', p_source_etag, 'group_id', p_group_id,
      'content_type', p_content_type, 'bytes', p_source_bytes))),
    p_group_id, p_max_attempts)
$$;

-- Claim --------------------------------------------------------------------------------------

-- Read up to p_qty messages under the rate limit and mark their jobs processing with a lease
-- of p_vt_seconds (the messages' visibility timeout: longer than an invocation's budget, so a
-- live invocation is never double-served and a killed one's messages come back soon).
-- Tokens are taken for what may be read and the unused ones given back at once.
-- Messages whose job is gone or finished are deleted; a job whose lease was lost so often
-- that it has no attempts left goes to the dead-letter queue.
-- Returns {"jobs": [...], "rate_limited": bool, "retry_after_ms": int|null}.
create or replace function thumbq.claim(p_worker_id text, p_qty integer, p_vt_seconds integer,
                                        p_bucket text default 'thumbnail_generation')
returns jsonb
language plpgsql
as $$
declare
  v_allowed integer := greatest(p_qty, 0);
  v_retry integer;
  v_msg_ids bigint[];
  v_job_ids bigint[];
  v_jobs jsonb;
  v_claimed integer;
  v_claimed_msgs bigint[];
  v_done bigint[];
  v_limited boolean;
  r record;
begin
  if p_bucket is not null and v_allowed > 0 then
    select t.taken, t.retry_after_ms into v_allowed, v_retry
      from thumbq.take_tokens(p_bucket, v_allowed, true) t;
    if not found then
      v_allowed := greatest(p_qty, 0);
    end if;
  end if;
  if v_allowed = 0 then
    return jsonb_build_object('jobs', '[]'::jsonb, 'rate_limited', p_qty > 0,
                              'retry_after_ms', v_retry);
  end if;

  select coalesce(array_agg(m.msg_id order by m.msg_id), '{}'),
         coalesce(array_agg((m.message->>'job_id')::bigint order by m.msg_id), '{}')
    into v_msg_ids, v_job_ids
    from pgmq.read('thumbq_jobs', p_vt_seconds, v_allowed) m;

  -- Lost leases used up every attempt: dead-letter instead of trying again. Checked first
  -- with a read, so that the common case runs no extra UPDATE (and no trigger).
  if exists (select 1 from thumbq.jobs j join unnest(v_job_ids) as m(job_id) on j.id = m.job_id
              where j.attempts >= j.max_attempts and j.status in ('pending', 'processing')) then
  for r in
    update thumbq.jobs j
       set status = 'failed', error_code = coalesce(j.error_code, 'lease_expired'),
           last_error = coalesce(j.last_error, 'the worker lost its lease ' || j.attempts
                                 || ' times (killed or timed out) without reporting'),
           completed_at = clock_timestamp(), updated_at = clock_timestamp(),
           lease_expires_at = null, worker_id = null
      from unnest(v_msg_ids, v_job_ids) as m(msg_id, job_id)
     where j.id = m.job_id and j.status in ('pending', 'processing')
       and j.attempts >= j.max_attempts
    returning j.*
  loop
    update thumbq.jobs set dlq_msg_id = (select pgmq.send('thumbq_dlq', jsonb_build_object(
             'job_id', r.id, 'source_key', r.source_key, 'source_etag', r.source_etag,
             'group_id', r.group_id, 'error_code', r.error_code, 'last_error', r.last_error,
             'attempts', r.attempts)))
     where id = r.id;
  end loop;
  end if;

  with c as (
    update thumbq.jobs j
       set status = 'processing', attempts = j.attempts + 1, worker_id = p_worker_id,
           msg_id = m.msg_id, started_at = clock_timestamp(), next_attempt_at = null,
           lease_expires_at = clock_timestamp() + make_interval(secs => p_vt_seconds),
           updated_at = clock_timestamp()
      from unnest(v_msg_ids, v_job_ids) as m(msg_id, job_id)
     where j.id = m.job_id and j.status in ('pending', 'processing')
       and j.attempts < j.max_attempts
    returning j.id, j.msg_id, j.group_id, j.source_key, j.source_etag, j.source_bytes,
              j.content_type, j.attempts, j.max_attempts
  )
  select coalesce(jsonb_agg(jsonb_build_object(
           'id', c.id, 'msg_id', c.msg_id, 'group_id', c.group_id,
           'source_key', c.source_key, 'source_etag', c.source_etag,
           'source_bytes', c.source_bytes, 'content_type', c.content_type,
           'attempts', c.attempts, 'max_attempts', c.max_attempts) order by c.msg_id),
           '[]'::jsonb),
         coalesce(array_agg(c.msg_id), '{}'), count(*)
    into v_jobs, v_claimed_msgs, v_claimed
    from c;

  -- Everything read but not claimed is stale (job finished, cancelled, dead-lettered, gone).
  if v_claimed < cardinality(v_msg_ids) then
    select array_agg(m.msg_id) into v_done
      from unnest(v_msg_ids) as m(msg_id)
     where m.msg_id <> all(v_claimed_msgs);
    perform pgmq.delete('thumbq_jobs', v_done);
  end if;

  if p_bucket is not null then
    perform thumbq.refund_tokens(p_bucket, v_allowed - v_claimed);
  end if;
  -- The bucket, not the queue, cut this claim short when it granted fewer tokens than asked
  -- and the queue had a message for every one: say so, or the caller takes it for drained.
  v_limited := v_allowed < p_qty and cardinality(v_msg_ids) >= v_allowed;
  return jsonb_build_object('jobs', v_jobs, 'rate_limited', v_limited,
                            'retry_after_ms', case when v_limited then v_retry end);
end
$$;

-- Complete, fail, release --------------------------------------------------------------------

-- Record finished jobs: p_results is a JSON array of {"job_id", "msg_id", "thumbnail_key",
-- "thumbnail_content_type", "width", "height", "bytes", "duration_ms", "source_type"}.
-- Only jobs still leased by p_worker_id change; their messages are deleted. Returns how many
-- completed.
create or replace function thumbq.complete(p_worker_id text, p_results jsonb)
returns integer
language plpgsql
as $$
declare
  v_msgs bigint[];
  v_count integer;
begin
  with r as (
    select (e->>'job_id')::bigint as job_id, (e->>'msg_id')::bigint as msg_id, e
      from jsonb_array_elements(p_results) e
  ), u as (
    update thumbq.jobs j
       set status = 'completed', error_code = null, last_error = null,
           thumbnail_key = r.e->>'thumbnail_key',
           thumbnail_content_type = r.e->>'thumbnail_content_type',
           width = (r.e->>'width')::integer, height = (r.e->>'height')::integer,
           bytes = (r.e->>'bytes')::bigint, duration_ms = (r.e->>'duration_ms')::integer,
           content_type = coalesce(j.content_type, r.e->>'source_type'),
           completed_at = clock_timestamp(), updated_at = clock_timestamp(),
           lease_expires_at = null
      from r
     where j.id = r.job_id and j.msg_id = r.msg_id and j.status = 'processing'
       and j.worker_id = p_worker_id
    returning j.msg_id
  )
  select array_agg(u.msg_id), count(*) into v_msgs, v_count from u;
  if v_msgs is not null then
    perform pgmq.delete('thumbq_jobs', v_msgs);
  end if;
  return v_count;
end
$$;

-- Record a failed attempt. Permanent errors end the job at once (unsupported_type as
-- 'unsupported', source_missing as 'cancelled', others 'failed'); transient ones retry after
-- an exponential backoff with jitter, made by moving the message's visibility timeout (nobody
-- sleeps), until max_attempts, then the job is 'failed' and its message moves to the DLQ.
-- Returns {"status", "owned", "retry_in_s"}.
create or replace function thumbq.fail(p_worker_id text, p_msg_id bigint, p_job_id bigint,
                                       p_error_code text, p_message text,
                                       p_permanent boolean,
                                       p_backoff_base_s integer default 30,
                                       p_backoff_cap_s integer default 900)
returns jsonb
language plpgsql
as $$
declare
  j thumbq.jobs;
  v_status text;
  v_delay integer;
begin
  select * into j from thumbq.jobs where id = p_job_id for update;
  if not found or j.status <> 'processing' or j.worker_id is distinct from p_worker_id
     or j.msg_id is distinct from p_msg_id then
    return jsonb_build_object('status', j.status, 'owned', false, 'retry_in_s', null);
  end if;

  if p_permanent or j.attempts >= j.max_attempts then
    v_status := case when not p_permanent then 'failed'
                     when p_error_code = 'unsupported_type' then 'unsupported'
                     when p_error_code = 'source_missing' then 'cancelled'
                     else 'failed' end;
    update thumbq.jobs
       set status = v_status, error_code = p_error_code, last_error = left(p_message, 2000),
           completed_at = clock_timestamp(), updated_at = clock_timestamp(),
           lease_expires_at = null
     where id = j.id;
    if not p_permanent then
      update thumbq.jobs set dlq_msg_id = (select pgmq.send('thumbq_dlq', jsonb_build_object(
               'job_id', j.id, 'source_key', j.source_key, 'source_etag', j.source_etag,
               'group_id', j.group_id, 'error_code', p_error_code,
               'last_error', left(p_message, 2000), 'attempts', j.attempts)))
       where id = j.id;
    end if;
    perform pgmq.delete('thumbq_jobs', p_msg_id);
    return jsonb_build_object('status', v_status, 'owned', true, 'retry_in_s', null);
  end if;

  -- Equal jitter: half the exponential delay fixed, half random, so retries of many jobs
  -- that failed together (an outage) spread out instead of coming back at once.
  v_delay := least(p_backoff_cap_s, p_backoff_base_s * power(2, greatest(j.attempts - 1, 0)));
  v_delay := ceil(v_delay * (0.5 + random() * 0.5))::integer;
  update thumbq.jobs
     set status = 'pending', error_code = p_error_code, last_error = left(p_message, 2000),
         next_attempt_at = clock_timestamp() + make_interval(secs => v_delay),
         lease_expires_at = null, worker_id = null, updated_at = clock_timestamp()
   where id = j.id;
  perform pgmq.set_vt('thumbq_jobs', p_msg_id, v_delay);
  return jsonb_build_object('status', 'pending', 'owned', true, 'retry_in_s', v_delay);
end
$$;

-- Hand claimed but unstarted messages back at once, without counting an attempt, and give
-- their tokens back. Returns how many were released.
create or replace function thumbq.release(p_worker_id text, p_job_ids bigint[],
                                          p_bucket text default 'thumbnail_generation')
returns integer
language plpgsql
as $$
declare
  v_count integer := 0;
  r record;
begin
  for r in
    update thumbq.jobs j
       set status = 'pending', attempts = greatest(j.attempts - 1, 0), worker_id = null,
           lease_expires_at = null, started_at = null, updated_at = clock_timestamp()
     where j.id = any(p_job_ids) and j.status = 'processing'
       and j.worker_id = p_worker_id
    returning j.msg_id
  loop
    perform pgmq.set_vt('thumbq_jobs', r.msg_id, 0);
    v_count := v_count + 1;
  end loop;
  if p_bucket is not null then
    perform thumbq.refund_tokens(p_bucket, v_count);
  end if;
  return v_count;
end
$$;

-- Reset jobs whose lease expired (their invocation was killed) so that status shows the
-- truth; their messages are visible again by then. The lost attempt still counts.
create or replace function thumbq.reap_stale()
returns integer
language plpgsql
as $$
declare
  v_count integer := 0;
  r record;
begin
  for r in
    update thumbq.jobs j
       set status = 'pending', worker_id = null, lease_expires_at = null,
           last_error = coalesce(j.last_error, 'lease expired: the invocation was killed'),
           updated_at = clock_timestamp()
     where j.status = 'processing' and j.lease_expires_at < clock_timestamp()
    returning j.msg_id
  loop
    perform pgmq.set_vt('thumbq_jobs', r.msg_id, 0);
    v_count := v_count + 1;
  end loop;
  return v_count;
end
$$;

-- Groups -------------------------------------------------------------------------------------

-- Progress of one group from its summary row: one primary-key lookup, no scan of its jobs.
-- The ETA is as of updated_at: remaining jobs over the completion rate of the current wave.
create or replace function thumbq.progress(p_group_id text)
returns table (group_id text, total integer, pending integer, processing integer,
               completed integer, failed integer, unsupported integer, cancelled integer,
               progress_percentage numeric, estimated_time_remaining_seconds integer,
               rate_per_second double precision, version bigint, updated_at timestamptz)
language sql
stable
as $$
  select g.group_id, g.total, g.pending, g.processing, g.completed, g.failed, g.unsupported,
         g.cancelled,
         case when g.total = 0 then 0
              else round(100.0 * (g.total - g.pending - g.processing) / g.total, 1) end,
         case when g.pending + g.processing = 0 then 0
              when r.rate > 0 then ceil((g.pending + g.processing) / r.rate)::integer end,
         r.rate,
         g.version, g.updated_at
    from thumbq.groups g
    cross join lateral (
      select case
        when g.wave_started_at is not null and g.last_done_at > g.wave_started_at
             and g.completed + g.failed + g.unsupported + g.cancelled > g.wave_done_base
        then (g.completed + g.failed + g.unsupported + g.cancelled - g.wave_done_base)
             / extract(epoch from g.last_done_at - g.wave_started_at)::double precision
      end as rate) r
   where g.group_id = p_group_id
$$;

-- Queue a group's failed jobs again with fresh attempts; their dead letters are removed.
create or replace function thumbq.retry_failed(p_group_id text)
returns integer
language plpgsql
as $$
declare
  v_dlq bigint[];
  v_count integer;
begin
  with u as (
    update thumbq.jobs j
       set status = 'pending', attempts = 0, error_code = null, last_error = null,
           completed_at = null, started_at = null, next_attempt_at = null, worker_id = null,
           msg_id = (select pgmq.send('thumbq_jobs', jsonb_build_object('job_id', j.id))),
           dlq_msg_id = null, updated_at = clock_timestamp()
      from (select id, dlq_msg_id from thumbq.jobs
             where group_id = p_group_id and status = 'failed' for update) old
     where j.id = old.id
    returning old.dlq_msg_id
  )
  select array_agg(u.dlq_msg_id) filter (where u.dlq_msg_id is not null), count(*)
    into v_dlq, v_count from u;
  if v_dlq is not null then
    perform pgmq.delete('thumbq_dlq', v_dlq);
  end if;
  return v_count;
end
$$;

-- Cancel a group's pending and processing jobs; their messages are deleted. A worker that is
-- rendering one of them finds it cancelled when it reports, and changes nothing.
create or replace function thumbq.cancel(p_group_id text)
returns integer
language plpgsql
as $$
declare
  v_msgs bigint[];
  v_count integer;
begin
  with u as (
    update thumbq.jobs j
       set status = 'cancelled', error_code = 'cancelled', last_error = 'cancelled by request',
           completed_at = clock_timestamp(), updated_at = clock_timestamp(),
           lease_expires_at = null
     where j.group_id = p_group_id and j.status in ('pending', 'processing')
    returning j.msg_id
  )
  select array_agg(u.msg_id) filter (where u.msg_id is not null), count(*)
    into v_msgs, v_count from u;
  if v_msgs is not null then
    perform pgmq.delete('thumbq_jobs', v_msgs);
  end if;
  return v_count;
end
$$;

-- Batch runs ---------------------------------------------------------------------------------

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
-- return what is left and which alerts are raised (the same names as thumbq.alerts).
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

  select coalesce(sum(g.pending + g.processing), 0) into v_remaining from thumbq.groups g;

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
