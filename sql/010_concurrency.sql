-- Correct under concurrency, bounded in history. Replaces the transitions of 003 with versions
-- that hold under any number of concurrent invocations, enqueues and admin calls, and adds
-- retention. 001..009 shipped in 0.1.0 and are never edited: this file changes what they made.
--
-- One lock order in every transition:
--   source-key advisory locks (enqueue only, sorted)
--   -> job rows (SELECT ... ORDER BY id FOR UPDATE)
--   -> queue messages (pgmq.delete / set_vt / send)
--   -> token buckets (takes and refunds)
--   -> group rows (thumbq.lock_groups, sorted, or the single status UPDATE whose trigger sorts).
-- claim is the one transition that meets messages before job rows (pgmq.read locks what it
-- reads); it takes both with SKIP LOCKED, so it never waits for either and cannot close a cycle.
-- Each transition changes statuses (and so group rows, through the triggers of 002) only at its
-- end, after every message operation. A deadlock that still happens (an operator's own
-- statements, a foreign trigger) is retried inside the transition, a bounded number of times.

-- Columns of the formats work (several sizes, placeholders, degraded renders) ---------------

alter table thumbq.jobs add column if not exists thumbnails jsonb;
alter table thumbq.jobs add column if not exists thumbhash text;
alter table thumbq.jobs add column if not exists dominant_color text;
alter table thumbq.jobs add column if not exists degraded boolean not null default false;

-- Locks -------------------------------------------------------------------------------------

-- Lock the existing group rows a transition is about to change, in group_id order. Called
-- after every message operation and before the status changes, so that a transition with
-- several status statements takes its group rows at one point, in one order. Missing rows are
-- created by the status statement's trigger (inserted in order; two transactions only meet on
-- a new row when both create it, and the retry below covers that corner).
create or replace function thumbq.lock_groups(p_groups text[])
returns void
language plpgsql
as $$
begin
  perform 1 from thumbq.groups g
   where g.group_id = any(p_groups)
   order by g.group_id
     for update;
end
$$;

-- Serialise enqueues of the same source keys (so that two enqueues of one version never both
-- send a message), in a fixed order so that overlapping enqueues cannot deadlock. Transaction
-- scoped: safe behind a transaction-mode pooler.
create or replace function thumbq.lock_source_keys(p_keys text[])
returns void
language sql
as $$
  select count(pg_advisory_xact_lock(1953002865, h))::integer * 0
    from (select distinct hashtext(k) as h from unnest(p_keys) k order by 1) s
$$;

-- Enqueue ------------------------------------------------------------------------------------

-- Enqueue many objects: p_items is a JSON array of
-- {"source_key", "etag"?, "content_type"?, "group_id"?, "bytes"?}. One row per
-- (source_key, etag): enqueueing the same version again returns the existing job; a cancelled
-- one is queued again (into the new group); a new etag supersedes (cancels) the pending or
-- processing jobs of older versions of the same key. Every job that waits has exactly one
-- message: the source keys are locked first, so concurrent enqueues of one version queue it
-- once.
create or replace function thumbq.enqueue_batch(p_items jsonb,
                                                p_group_id text default 'default',
                                                p_max_attempts integer default 3)
returns table (job_id bigint, source_key text, source_etag text, created boolean,
               status text)
language plpgsql
as $$
#variable_conflict use_column
declare
  v_keys text[];
  v_sup_ids bigint[];
  v_sup_msgs bigint[];
  v_sup_groups text[];
  v_req_ids bigint[];
  v_req_groups text[];
  v_req_msgs bigint[] := '{}';
  v_req_delays integer[];
  v_fresh jsonb;
  v_out jsonb;
  v_attempt integer := 0;
begin
  if jsonb_typeof(p_items) is distinct from 'array' then
    raise exception 'thumbq.enqueue_batch: p_items must be a JSON array' using errcode = '22023';
  end if;
  if exists (select 1 from jsonb_array_elements(p_items) e
              where jsonb_typeof(e) <> 'object' or coalesce(e->>'source_key', '') = '') then
    raise exception 'thumbq.enqueue_batch: every item needs a source_key' using errcode = '22023';
  end if;

  loop
    begin
      select array_agg(i.source_key) into v_keys
        from thumbq.enqueue_items(p_items, p_group_id) i;
      perform thumbq.lock_source_keys(v_keys);

      -- Older versions still waiting or running: locked, their messages deleted, then
      -- cancelled as superseded.
      select array_agg(s.id), array_agg(s.msg_id) filter (where s.msg_id is not null),
             array_agg(s.group_id)
        into v_sup_ids, v_sup_msgs, v_sup_groups
        from (select j.id, j.msg_id, j.group_id
                from thumbq.jobs j
                join thumbq.enqueue_items(p_items, p_group_id) i
                  on j.source_key = i.source_key and j.source_etag <> i.source_etag
               where j.status in ('pending', 'processing')
               order by j.id
                 for update of j) s;

      -- Cancelled versions asked for again: locked, then queued again with one new message.
      -- One cancelled while it ran is not visible before that run's lease ends: the cancelled
      -- run may still be rendering it, and a file is never rendered twice at the same time.
      select array_agg(s.id), array_agg(s.group_id) || array_agg(s.new_group),
             array_agg(s.delay_s)
        into v_req_ids, v_req_groups, v_req_delays
        from (select j.id, j.group_id, i.group_id as new_group,
                     coalesce(greatest(0, ceil(extract(epoch from
                       j.lease_expires_at - clock_timestamp())))::integer, 0) as delay_s
                from thumbq.jobs j
                join thumbq.enqueue_items(p_items, p_group_id) i
                  on j.source_key = i.source_key and j.source_etag = i.source_etag
               where j.status = 'cancelled'
               order by j.id
                 for update of j) s;

      -- Versions never seen: ids drawn now, so that each message names its job. No concurrent
      -- enqueue can insert the same version meanwhile: its key is locked.
      select coalesce(jsonb_agg(jsonb_build_object(
               'id', nextval(pg_get_serial_sequence('thumbq.jobs', 'id')),
               'ord', i.ord, 'source_key', i.source_key, 'source_etag', i.source_etag,
               'content_type', i.content_type, 'group_id', i.group_id,
               'source_bytes', i.source_bytes)), '[]'::jsonb)
        into v_fresh
        from thumbq.enqueue_items(p_items, p_group_id) i
       where not exists (select 1 from thumbq.jobs j
                          where j.source_key = i.source_key and j.source_etag = i.source_etag);

      -- Messages: delete the superseded, send one per job that waits again or anew.
      if v_sup_msgs is not null then
        perform pgmq.delete('thumbq_jobs', v_sup_msgs);
      end if;
      v_req_msgs := '{}';
      if v_req_ids is not null then
        select array_agg((select pgmq.send('thumbq_jobs', jsonb_build_object('job_id', r.id),
                                           r.delay_s)) order by r.ord)
          into v_req_msgs
          from unnest(v_req_ids, v_req_delays) with ordinality as r(id, delay_s, ord);
      end if;
      select coalesce(jsonb_agg(f || jsonb_build_object('msg_id',
                        (select pgmq.send('thumbq_jobs', jsonb_build_object('job_id', f->'id'))))),
                      '[]'::jsonb)
        into v_fresh
        from jsonb_array_elements(v_fresh) f;

      -- Group rows last, in order; then the status changes.
      perform thumbq.lock_groups(
        coalesce(v_sup_groups, '{}') || coalesce(v_req_groups, '{}')
        || array(select f->>'group_id' from jsonb_array_elements(v_fresh) f));

      if v_sup_ids is not null then
        update thumbq.jobs j
           set status = 'cancelled', error_code = 'superseded',
               last_error = 'a newer version of the object (etag ' || i.source_etag
                            || ') was enqueued',
               completed_at = clock_timestamp(), updated_at = clock_timestamp(),
               msg_id = null
          from thumbq.enqueue_items(p_items, p_group_id) i
         where j.id = any(v_sup_ids) and j.source_key = i.source_key;
      end if;

      if v_req_ids is not null then
        update thumbq.jobs j
           set status = 'pending', attempts = 0, error_code = null, last_error = null,
               completed_at = null, started_at = null, next_attempt_at = null,
               -- lease_expires_at stays: a cancelled run may render until then, and a second
               -- cancel and enqueue must wait for it too.
               worker_id = null, group_id = i.group_id,
               max_attempts = p_max_attempts, msg_id = m.msg_id,
               updated_at = clock_timestamp()
          from unnest(v_req_ids, v_req_msgs) as m(job_id, msg_id),
               thumbq.enqueue_items(p_items, p_group_id) i
         where j.id = m.job_id and j.source_key = i.source_key
           and j.source_etag = i.source_etag;
      end if;

      with ins as (
        insert into thumbq.jobs as j (id, group_id, source_key, source_etag, source_bytes,
                                      content_type, max_attempts, msg_id)
        select (f->>'id')::bigint, f->>'group_id', f->>'source_key', f->>'source_etag',
               (f->>'source_bytes')::bigint, f->>'content_type', p_max_attempts,
               (f->>'msg_id')::bigint
          from jsonb_array_elements(v_fresh) f
         order by (f->>'ord')::bigint
        -- Only a writer that skips the key locks (an older thumbq during a deploy) can win
        -- this race; its message then names no job and claim deletes it.
        on conflict on constraint jobs_source_version_key do nothing
        returning j.id, j.source_key, j.source_etag, j.status
      ), rows as (
        select ins.id, ins.source_key, ins.source_etag, true as created, ins.status from ins
        union all
        select j.id, j.source_key, j.source_etag, false, j.status
          from thumbq.enqueue_items(p_items, p_group_id) i
          join thumbq.jobs j on j.source_key = i.source_key and j.source_etag = i.source_etag
         where not exists (select 1 from ins where ins.source_key = i.source_key)
      )
      select coalesce(jsonb_agg(to_jsonb(rows)), '[]'::jsonb) into v_out from rows;
      exit;
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
  return query
  select r.id, r.source_key, r.source_etag, r.created, r.status
    from jsonb_to_recordset(v_out)
      as r(id bigint, source_key text, source_etag text, created boolean, status text);
end
$$;

-- Claim --------------------------------------------------------------------------------------

drop function if exists thumbq.claim(text, integer, integer, text);

-- Read up to p_qty messages and lease their jobs to p_worker_id for p_vt_seconds (the messages'
-- visibility timeout: longer than an invocation's budget, so a live invocation is never
-- double-served and a killed one's messages come back soon).
-- Only a message that is its job's current one, for a job that waits or whose lease has
-- expired, is claimed. A message of a job someone else is changing is handed back after a
-- second; one of a job still leased waits for the lease; a stale one (job finished, cancelled,
-- superseded, gone, or a second message) is deleted. A job whose lease was lost so often that
-- it has no attempts left goes to the dead-letter queue.
-- Tokens: with p_prepaid the caller took them from p_bucket in its own transaction (the
-- engine does, so concurrent claims never wait on the bucket row) and unused ones are given
-- back here, at the very end; without, they are taken here first (one call for RPC users).
-- Returns {"jobs": [...], "rate_limited": bool, "retry_after_ms": int|null}.
create or replace function thumbq.claim(p_worker_id text, p_qty integer, p_vt_seconds integer,
                                        p_bucket text default 'thumbnail_generation',
                                        p_prepaid boolean default false)
returns jsonb
language plpgsql
as $$
declare
  v_allowed integer := greatest(p_qty, 0);
  v_retry integer;
  v_msg_ids bigint[];
  v_job_ids bigint[];
  v_locked bigint[];
  v_take_msgs bigint[];
  v_take_jobs bigint[];
  v_dead_msgs bigint[];
  v_dead_jobs bigint[];
  v_stale bigint[];
  v_busy bigint[];
  v_leased bigint[];
  v_leased_s integer[];
  v_groups text[];
  v_dlq bigint[] := '{}';
  v_jobs jsonb;
  v_claimed integer;
  v_limited boolean;
  v_attempt integer := 0;
  i integer;
begin
  if p_bucket is not null and not p_prepaid and v_allowed > 0 then
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

  loop
    begin
      -- Messages first: pgmq.read skips the ones other readers hold.
      select coalesce(array_agg(m.msg_id order by m.msg_id), '{}'),
             coalesce(array_agg((m.message->>'job_id')::bigint order by m.msg_id), '{}')
        into v_msg_ids, v_job_ids
        from pgmq.read('thumbq_jobs', p_vt_seconds, v_allowed) m;

      -- Then their jobs, skipping rows another transition holds.
      select coalesce(array_agg(s.id), '{}') into v_locked
        from (select j.id from thumbq.jobs j where j.id = any(v_job_ids)
               order by j.id for update skip locked) s;

      select array_agg(c.msg_id) filter (where c.cls = 'take'),
             array_agg(c.job_id) filter (where c.cls = 'take'),
             array_agg(c.msg_id) filter (where c.cls = 'dead'),
             array_agg(c.job_id) filter (where c.cls = 'dead'),
             array_agg(c.msg_id) filter (where c.cls = 'stale'),
             array_agg(c.msg_id) filter (where c.cls = 'busy'),
             array_agg(c.msg_id) filter (where c.cls = 'leased'),
             array_agg(c.lease_s) filter (where c.cls = 'leased'),
             array_agg(c.group_id) filter (where c.cls in ('take', 'dead'))
        into v_take_msgs, v_take_jobs, v_dead_msgs, v_dead_jobs, v_stale, v_busy,
             v_leased, v_leased_s, v_groups
        from (
          select m.msg_id, m.job_id, j.group_id,
                 coalesce(greatest(1, ceil(extract(epoch from
                   j.lease_expires_at - clock_timestamp())))::integer, 1) as lease_s,
                 case
                   when j.id is null then 'stale'
                   when not (j.id = any(v_locked)) then 'busy'
                   when j.msg_id is distinct from m.msg_id then 'stale'
                   -- A second message of one job in the same read: the first one counts.
                   when m.msg_id <> min(m.msg_id) over (partition by m.job_id) then 'stale'
                   when j.status = 'pending'
                        or (j.status = 'processing'
                            and j.lease_expires_at <= clock_timestamp()) then
                     case when j.attempts >= j.max_attempts then 'dead' else 'take' end
                   when j.status = 'processing' then 'leased'
                   else 'stale'
                 end as cls
            from unnest(v_msg_ids, v_job_ids) as m(msg_id, job_id)
            left join thumbq.jobs j on j.id = m.job_id
        ) c;

      -- Every message operation before any group row: these are all messages this
      -- transaction already holds, so none of them waits.
      if v_stale is not null or v_dead_msgs is not null then
        perform pgmq.delete('thumbq_jobs',
                            coalesce(v_stale, '{}') || coalesce(v_dead_msgs, '{}'));
      end if;
      if v_busy is not null then
        perform pgmq.set_vt('thumbq_jobs', b, 1) from unnest(v_busy) b;
      end if;
      if v_leased is not null then
        perform pgmq.set_vt('thumbq_jobs', l.msg_id, l.s)
           from unnest(v_leased, v_leased_s) as l(msg_id, s);
      end if;
      v_dlq := '{}';
      if v_dead_jobs is not null then
        select coalesce(array_agg((select pgmq.send('thumbq_dlq', jsonb_build_object(
                 'job_id', j.id, 'source_key', j.source_key, 'source_etag', j.source_etag,
                 'group_id', j.group_id, 'error_code', coalesce(j.error_code, 'lease_expired'),
                 'last_error', coalesce(j.last_error, 'the worker lost its lease '
                                        || j.attempts || ' times (killed or timed out)'
                                        || ' without reporting'),
                 'attempts', j.attempts))) order by j.id), '{}')
          into v_dlq
          from thumbq.jobs j where j.id = any(v_dead_jobs);
        select array_agg(j.id order by j.id) into v_dead_jobs
          from thumbq.jobs j where j.id = any(v_dead_jobs);
      end if;

      -- The bucket before the group rows: give back what was taken for nothing.
      v_claimed := coalesce(cardinality(v_take_jobs), 0);
      if p_bucket is not null and v_allowed > v_claimed then
        perform thumbq.refund_tokens(p_bucket, v_allowed - v_claimed);
      end if;

      perform thumbq.lock_groups(v_groups);

      -- One status change for everything taken and dead-lettered.
      with d as (
        select * from unnest(coalesce(v_dead_jobs, '{}'), v_dlq) as d(job_id, dlq_msg_id)
      ), t as (
        select * from unnest(coalesce(v_take_jobs, '{}'), coalesce(v_take_msgs, '{}'))
          as t(job_id, msg_id)
      ), u as (
        update thumbq.jobs j
           set status = case when d.job_id is null then 'processing' else 'failed' end,
               attempts = case when d.job_id is null then j.attempts + 1 else j.attempts end,
               worker_id = case when d.job_id is null then p_worker_id end,
               started_at = case when d.job_id is null then clock_timestamp()
                                 else j.started_at end,
               next_attempt_at = null,
               lease_expires_at = case when d.job_id is null
                 then clock_timestamp() + make_interval(secs => p_vt_seconds) end,
               error_code = case when d.job_id is null then j.error_code
                                 else coalesce(j.error_code, 'lease_expired') end,
               last_error = case when d.job_id is null then j.last_error
                                 else coalesce(j.last_error, 'the worker lost its lease '
                                   || j.attempts || ' times (killed or timed out) without'
                                   || ' reporting') end,
               completed_at = case when d.job_id is null then null else clock_timestamp() end,
               msg_id = case when d.job_id is null then j.msg_id end,
               dlq_msg_id = coalesce(d.dlq_msg_id, j.dlq_msg_id),
               updated_at = clock_timestamp()
          from (select t.job_id, null::bigint as dlq_msg_id from t
                union all select d.job_id, d.dlq_msg_id from d) x
          left join d on d.job_id = x.job_id
         where j.id = x.job_id
        returning j.id, j.msg_id, j.group_id, j.source_key, j.source_etag, j.source_bytes,
                  j.content_type, j.attempts, j.max_attempts, j.status
      )
      select coalesce(jsonb_agg(jsonb_build_object(
               'id', u.id, 'msg_id', u.msg_id, 'group_id', u.group_id,
               'source_key', u.source_key, 'source_etag', u.source_etag,
               'source_bytes', u.source_bytes, 'content_type', u.content_type,
               'attempts', u.attempts, 'max_attempts', u.max_attempts) order by u.msg_id)
               filter (where u.status = 'processing'), '[]'::jsonb),
             count(*) filter (where u.status = 'processing')
        into v_jobs, v_claimed
        from u;
      exit;
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;

  -- The bucket, not the queue, cut this claim short when it granted fewer tokens than asked
  -- and the queue had a message for every one: say so, or the caller takes it for drained.
  v_limited := v_allowed < p_qty and cardinality(v_msg_ids) >= v_allowed;
  return jsonb_build_object('jobs', v_jobs, 'rate_limited', v_limited,
                            'retry_after_ms', case when v_limited then v_retry end,
                            'read', cardinality(v_msg_ids));
end
$$;

-- Complete, fail, release --------------------------------------------------------------------

-- Record finished jobs: p_results is a JSON array of {"job_id", "msg_id", "thumbnail_key",
-- "thumbnail_content_type", "width", "height", "bytes", "duration_ms", "source_type",
-- "thumbnails"?, "thumbhash"?, "dominant_color"?, "degraded"?}. Only jobs still leased by
-- p_worker_id under that message change; their messages are deleted. Returns how many
-- completed.
create or replace function thumbq.complete(p_worker_id text, p_results jsonb)
returns integer
language plpgsql
as $$
declare
  v_ids bigint[];
  v_msgs bigint[];
  v_attempt integer := 0;
begin
  loop
    begin
      select array_agg(s.id), array_agg(s.msg_id) into v_ids, v_msgs
        from (select j.id, j.msg_id
                from thumbq.jobs j
                join jsonb_array_elements(p_results) e
                  on j.id = (e->>'job_id')::bigint and j.msg_id = (e->>'msg_id')::bigint
               where j.status = 'processing' and j.worker_id = p_worker_id
               order by j.id
                 for update of j) s;
      if v_ids is null then
        return 0;
      end if;
      perform pgmq.delete('thumbq_jobs', v_msgs);
      update thumbq.jobs j
         set status = 'completed', error_code = null, last_error = null,
             thumbnail_key = e->>'thumbnail_key',
             thumbnail_content_type = e->>'thumbnail_content_type',
             width = (e->>'width')::integer, height = (e->>'height')::integer,
             bytes = (e->>'bytes')::bigint, duration_ms = (e->>'duration_ms')::integer,
             content_type = coalesce(j.content_type, e->>'source_type'),
             thumbnails = e->'thumbnails', thumbhash = e->>'thumbhash',
             dominant_color = e->>'dominant_color',
             degraded = coalesce((e->>'degraded')::boolean, false),
             completed_at = clock_timestamp(), updated_at = clock_timestamp(),
             lease_expires_at = null, msg_id = null
        from jsonb_array_elements(p_results) e
       where j.id = any(v_ids) and j.id = (e->>'job_id')::bigint;
      return cardinality(v_ids);
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
end
$$;

-- Record a failed attempt. Permanent errors end the job at once (unsupported_type as
-- 'unsupported', source_missing as 'cancelled', others 'failed'); transient ones retry after
-- an exponential backoff with jitter, made by moving the message's visibility timeout (nobody
-- sleeps), until max_attempts, then the job is 'failed' and a dead letter goes to the DLQ.
-- Only the lease holder's report counts. Returns {"status", "owned", "retry_in_s"}.
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
  v_dlq bigint;
  v_attempt integer := 0;
begin
  loop
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
        perform pgmq.delete('thumbq_jobs', p_msg_id);
        v_dlq := null;
        if not p_permanent then
          v_dlq := (select pgmq.send('thumbq_dlq', jsonb_build_object(
                      'job_id', j.id, 'source_key', j.source_key, 'source_etag', j.source_etag,
                      'group_id', j.group_id, 'error_code', p_error_code,
                      'last_error', left(p_message, 2000), 'attempts', j.attempts)));
        end if;
        update thumbq.jobs
           set status = v_status, error_code = p_error_code, last_error = left(p_message, 2000),
               completed_at = clock_timestamp(), updated_at = clock_timestamp(),
               lease_expires_at = null, msg_id = null, dlq_msg_id = coalesce(v_dlq, dlq_msg_id)
         where id = j.id;
        return jsonb_build_object('status', v_status, 'owned', true, 'retry_in_s', null);
      end if;

      -- Equal jitter: half the exponential delay fixed, half random, so retries of many jobs
      -- that failed together (an outage) spread out instead of coming back at once.
      v_delay := least(p_backoff_cap_s,
                       p_backoff_base_s * power(2, greatest(j.attempts - 1, 0)));
      v_delay := ceil(v_delay * (0.5 + random() * 0.5))::integer;
      perform pgmq.set_vt('thumbq_jobs', p_msg_id, v_delay);
      update thumbq.jobs
         set status = 'pending', error_code = p_error_code, last_error = left(p_message, 2000),
             next_attempt_at = clock_timestamp() + make_interval(secs => v_delay),
             lease_expires_at = null, worker_id = null, updated_at = clock_timestamp()
       where id = j.id;
      return jsonb_build_object('status', 'pending', 'owned', true, 'retry_in_s', v_delay);
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
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
  v_ids bigint[];
  v_msgs bigint[];
  v_attempt integer := 0;
begin
  loop
    begin
      select array_agg(s.id), array_agg(s.msg_id) into v_ids, v_msgs
        from (select j.id, j.msg_id from thumbq.jobs j
               where j.id = any(p_job_ids) and j.status = 'processing'
                 and j.worker_id = p_worker_id
               order by j.id
                 for update) s;
      if v_ids is null then
        return 0;
      end if;
      perform pgmq.set_vt('thumbq_jobs', m, 0) from unnest(v_msgs) m;
      -- The bucket before the group rows.
      if p_bucket is not null then
        perform thumbq.refund_tokens(p_bucket, cardinality(v_ids));
      end if;
      update thumbq.jobs j
         set status = 'pending', attempts = greatest(j.attempts - 1, 0), worker_id = null,
             lease_expires_at = null, started_at = null, updated_at = clock_timestamp()
       where j.id = any(v_ids);
      return cardinality(v_ids);
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
end
$$;

-- Reset jobs whose lease expired (their invocation was killed) so that status shows the
-- truth, at most p_limit per call; their messages become visible at once. The lost attempt
-- still counts. Rows another transition holds are left for the next call.
drop function if exists thumbq.reap_stale();
create or replace function thumbq.reap_stale(p_limit integer default 5000)
returns integer
language plpgsql
as $$
declare
  v_ids bigint[];
  v_msgs bigint[];
  v_attempt integer := 0;
begin
  loop
    begin
      select array_agg(s.id), array_agg(s.msg_id) filter (where s.msg_id is not null)
        into v_ids, v_msgs
        from (select j.id, j.msg_id from thumbq.jobs j
               where j.status = 'processing' and j.lease_expires_at < clock_timestamp()
               order by j.id
               limit greatest(p_limit, 0)
                 for update skip locked) s;
      if v_ids is null then
        return 0;
      end if;
      if v_msgs is not null then
        perform pgmq.set_vt('thumbq_jobs', m, 0) from unnest(v_msgs) m;
      end if;
      update thumbq.jobs j
         set status = 'pending', worker_id = null, lease_expires_at = null,
             last_error = coalesce(j.last_error, 'lease expired: the invocation was killed'),
             updated_at = clock_timestamp()
       where j.id = any(v_ids);
      return cardinality(v_ids);
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
end
$$;

-- Groups -------------------------------------------------------------------------------------

-- Queue a group's failed jobs again with fresh attempts and one new message each; their dead
-- letters are removed.
create or replace function thumbq.retry_failed(p_group_id text)
returns integer
language plpgsql
as $$
declare
  v_ids bigint[];
  v_dlq bigint[];
  v_msgs bigint[];
  v_id bigint;
  v_attempt integer := 0;
begin
  loop
    begin
      select array_agg(s.id), array_agg(s.dlq_msg_id) filter (where s.dlq_msg_id is not null)
        into v_ids, v_dlq
        from (select j.id, j.dlq_msg_id from thumbq.jobs j
               where j.group_id = p_group_id and j.status = 'failed'
               order by j.id
                 for update) s;
      if v_ids is null then
        return 0;
      end if;
      if v_dlq is not null then
        perform pgmq.delete('thumbq_dlq', v_dlq);
      end if;
      v_msgs := '{}';
      foreach v_id in array v_ids loop
        v_msgs := v_msgs
                  || (select pgmq.send('thumbq_jobs', jsonb_build_object('job_id', v_id)));
      end loop;
      update thumbq.jobs j
         set status = 'pending', attempts = 0, error_code = null, last_error = null,
             completed_at = null, started_at = null, next_attempt_at = null, worker_id = null,
             lease_expires_at = null, msg_id = m.msg_id, dlq_msg_id = null,
             updated_at = clock_timestamp()
        from unnest(v_ids, v_msgs) as m(job_id, msg_id)
       where j.id = m.job_id;
      return cardinality(v_ids);
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
end
$$;

-- Cancel jobs that still wait or run: their messages are deleted, their status says why. A
-- worker rendering one of them finds it cancelled when it reports, and changes nothing; the
-- lease it held is kept on the row, so that enqueueing the version again waits for it.
-- Returns how many were cancelled.
create or replace function thumbq.cancel_jobs(p_job_ids bigint[],
                                              p_error_code text default 'cancelled',
                                              p_message text default 'cancelled by request')
returns integer
language plpgsql
as $$
declare
  v_ids bigint[];
  v_msgs bigint[];
  v_attempt integer := 0;
begin
  loop
    begin
      select array_agg(s.id), array_agg(s.msg_id) filter (where s.msg_id is not null)
        into v_ids, v_msgs
        from (select j.id, j.msg_id from thumbq.jobs j
               where j.id = any(p_job_ids) and j.status in ('pending', 'processing')
               order by j.id
                 for update) s;
      if v_ids is null then
        return 0;
      end if;
      if v_msgs is not null then
        perform pgmq.delete('thumbq_jobs', v_msgs);
      end if;
      update thumbq.jobs j
         set status = 'cancelled', error_code = p_error_code, last_error = p_message,
             completed_at = clock_timestamp(), updated_at = clock_timestamp(), msg_id = null
       where j.id = any(v_ids);
      return cardinality(v_ids);
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
end
$$;

-- Cancel a group's pending and processing jobs.
create or replace function thumbq.cancel(p_group_id text)
returns integer
language sql
as $$
  select thumbq.cancel_jobs(array(
    select j.id from thumbq.jobs j
     where j.group_id = p_group_id and j.status in ('pending', 'processing')))
$$;

-- Retention ----------------------------------------------------------------------------------

-- Deleting old jobs for retention keeps the groups' summaries: a group still says how many
-- files it had and how they ended. The flag is local to the pruning transaction.
create or replace function thumbq.jobs_after_delete() returns trigger
language plpgsql as $$
declare
  v_deltas thumbq.group_delta[];
begin
  if current_setting('thumbq.retention', true) = 'on' then
    return null;
  end if;
  select array_agg(row(o.group_id, o.status, -1)::thumbq.group_delta) into v_deltas
    from old_rows o;
  if v_deltas is not null then
    perform thumbq.apply_group_deltas(v_deltas);
  end if;
  return null;
end
$$;

-- Prune history older than p_days in one bounded chunk of at most p_limit rows per kind:
-- terminal jobs (with their dead letters), batch runs, and pgmq's archive of thumbq's queues.
-- Group rows stay. Returns what it deleted; call again until everything is 0.
create or replace function thumbq.prune(p_days integer, p_limit integer default 5000)
returns jsonb
language plpgsql
as $$
declare
  v_cutoff timestamptz := clock_timestamp() - make_interval(days => greatest(p_days, 0));
  v_jobs integer := 0;
  v_runs integer := 0;
  v_archived integer := 0;
  v_dlq bigint[];
  n integer;
  t text;
begin
  if p_days is null or p_days <= 0 then
    return jsonb_build_object('jobs', 0, 'batch_runs', 0, 'archived', 0);
  end if;
  perform set_config('thumbq.retention', 'on', true);
  with d as (
    delete from thumbq.jobs j
     where j.id in (select x.id from thumbq.jobs x
                     where x.completed_at < v_cutoff
                       and x.status in ('completed', 'failed', 'unsupported', 'cancelled')
                     order by x.completed_at
                     limit greatest(p_limit, 0)
                       for update skip locked)
    returning j.dlq_msg_id
  )
  select count(*), array_agg(d.dlq_msg_id) filter (where d.dlq_msg_id is not null)
    into v_jobs, v_dlq from d;
  perform set_config('thumbq.retention', 'off', true);
  if v_dlq is not null then
    perform pgmq.delete('thumbq_dlq', v_dlq);
  end if;

  delete from thumbq.batch_runs r
   where r.id in (select x.id from thumbq.batch_runs x
                   where x.started_at < v_cutoff
                   order by x.started_at
                   limit greatest(p_limit, 0));
  get diagnostics v_runs = row_count;

  -- pgmq keeps archived messages forever and its 1.4.4 API has no way to prune them.
  foreach t in array array['a_thumbq_jobs', 'a_thumbq_dlq'] loop
    if to_regclass('pgmq.' || t) is not null then
      execute format('delete from pgmq.%I where msg_id in (select msg_id from pgmq.%I'
                     ' where archived_at < $1 order by msg_id limit $2)', t, t)
        using v_cutoff, greatest(p_limit, 0);
      get diagnostics n = row_count;
      v_archived := v_archived + n;
    end if;
  end loop;
  return jsonb_build_object('jobs', v_jobs, 'batch_runs', v_runs, 'archived', v_archived);
end
$$;

-- Alerts and the end of a run, at a cost that does not grow with history ------------------

-- pgmq's metrics through a plpgsql function, whose body is resolved at call time: a view that
-- called pgmq.metrics directly would stop `alter extension pgmq update` (1.4.4 -> 1.5) from
-- re-creating it. 012 defines the same function for queue_overview.
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

-- One row per condition that needs a person, with its figure and threshold. Every figure comes
-- from the queues (their length is the backlog, not the history) or from the last hour of
-- runs: reading this view costs the same with a million finished jobs as with none.
create or replace view thumbq.alerts as
with q as (
  select m.queue_length, m.oldest_msg_age_sec from thumbq.queue_metrics('thumbq_jobs') m
), dlq as (
  select m.queue_length from thumbq.queue_metrics('thumbq_dlq') m
), hour as (
  select coalesce(sum(r.failed), 0) as failed,
         coalesce(sum(r.succeeded + r.failed), 0) as done
    from thumbq.batch_runs r
   where r.started_at > now() - interval '1 hour' and r.finished_at is not null
), runs as (
  select r.duration_ms, r.budget_ms, r.stopped_reason
    from thumbq.batch_runs r
   where r.finished_at is not null
   order by r.started_at desc
   limit 5
)
select 'failure_rate_high'::text as name,
       round(h.failed::numeric / h.done, 3) as figure, 0.2 as threshold,
       h.failed || ' of ' || h.done || ' jobs finished by runs of the last hour failed'
         as detail
  from hour h where h.done > 0 and h.failed::numeric / h.done > 0.2
union all
select 'backlog_large', q.queue_length, 500,
       q.queue_length || ' jobs are waiting'
  from q where q.queue_length > 500
union all
select 'backlog_old', q.oldest_msg_age_sec, 1800,
       'the oldest message has waited ' || q.oldest_msg_age_sec || ' s'
  from q where q.oldest_msg_age_sec > 1800
union all
select 'budget_nearly_used', max(r.duration_ms::numeric / r.budget_ms), 0.9,
       'a recent run used over 90% of its time budget'
  from runs r having max(r.duration_ms::numeric / r.budget_ms) > 0.9
union all
select 'dlq_not_empty', dlq.queue_length, 0,
       dlq.queue_length || ' jobs failed every attempt and wait in thumbq_dlq'
  from dlq where dlq.queue_length > 0
union all
select 'rate_limited', count(*) filter (where r.stopped_reason = 'rate_limited'), 3,
       'most recent runs stopped on the rate limit'
  from runs r having count(*) filter (where r.stopped_reason = 'rate_limited') >= 3;

-- Close a run: write its counts, merge the durations it observed into render_stats, and
-- return what is left (the work queue's length: every job that waits or runs has exactly one
-- message) and which alerts are raised (the same names as thumbq.alerts).
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

  select m.queue_length into v_remaining from thumbq.queue_metrics('thumbq_jobs') m;

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

-- Privileges (see 008): PUBLIC gets EXECUTE on every new function; take it back.
revoke execute on all functions in schema thumbq from public;
revoke execute on all functions in schema thumbq from anon, authenticated;
grant execute on function thumbq.progress(text), thumbq.request_user_id() to authenticated;
