-- The end of a run: complete, checkpoint, fail, release.

-- A cancelled job's run has stopped (its worker reported, whatever it reported): its lease
-- ends, and the head of its ordering key, hidden until that lease's end, becomes visible now.
-- Called with the keys locked and the rows of p_job_ids locked, after the caller's message
-- operations on its own jobs.
create or replace function thumbq.end_cancelled_runs(p_worker_id text, p_job_ids bigint[])
returns integer
language plpgsql
as $$
declare
  v_ended bigint[];
  v_keys text[];
  v_heads bigint[];
  v_msgs bigint[];
  v_prio integer[];
begin
  select array_agg(j.id order by j.id),
         array_agg(distinct j.ordering_key) filter (where j.ordering_key is not null)
    into v_ended, v_keys
    from thumbq.jobs j
   where j.id = any(p_job_ids) and j.status = 'cancelled' and j.worker_id = p_worker_id
     and j.lease_expires_at is not null;
  if v_ended is null then
    return 0;
  end if;
  if v_keys is not null then
    -- A head queued while the run held the key has no message yet: it gets one now.
    perform thumbq.release_heads(v_keys, v_ended);
    -- Only a head that waits for nothing else: a retry keeps its backoff. The heads' rows are
    -- not touched (their message only): claim and claim_job check the key's holder themselves.
    select array_agg(j.id order by j.id), array_agg(j.msg_id order by j.id),
           array_agg(j.priority::integer order by j.id)
      into v_heads, v_msgs, v_prio
      from thumbq.heads_of(v_keys, v_ended) h
      join thumbq.jobs j on j.id = h.job_id
     where j.status = 'pending' and j.msg_id is not null and j.attempts = 0
       and j.next_attempt_at is null;
    if v_heads is not null then
      perform thumbq.set_message_vt(v_prio, v_msgs, array_fill(0, array[cardinality(v_heads)]));
    end if;
  end if;
  update thumbq.jobs set lease_expires_at = null where id = any(v_ended);
  return cardinality(v_ended);
end
$$;

-- Record finished jobs: p_results is a JSON array of {"job_id", "msg_id", "thumbnail_key"?,
-- "thumbnail_content_type"?, "width"?, "height"?, "bytes"?, "duration_ms"?, "source_type"?,
-- "thumbnails"?, "thumbhash"?, "dominant_color"?, "degraded"?, "result"?, "progress_done"?}.
-- Only jobs still
-- leased by p_worker_id under that message change; their messages are deleted, and the next
-- job of each ordering key gets its message. A report on a job cancelled while it ran ends
-- that run's lease (its key's next job may go now). One row per job: `completed`,
-- `not_held` (cancelled, or taken over after its lease), or `busy`: with p_wait false, a job
-- whose row another transaction holds is left for a later call rather than waited for, so
-- that one locked row does not hold up the rest (the engine then waits for it alone).
create or replace function thumbq.complete_jobs(p_worker_id text, p_results jsonb,
                                                p_wait boolean default true)
returns table (job_id bigint, outcome text)
language plpgsql
set jit = off
as $$
#variable_conflict use_column
declare
  v_keys text[];
  v_all bigint[];
  v_locked bigint[];
  v_ids bigint[];
  v_msgs bigint[];
  v_prio integer[];
  v_attempt integer := 0;
begin
  v_all := array(select r.job_id from jsonb_to_recordset(p_results) as r(job_id bigint));
  loop
    begin
      v_keys := thumbq.lock_ordering_keys_of(v_all);
      if p_wait then
        v_locked := array(select j.id from thumbq.jobs j where j.id = any(v_all)
                           order by j.id for update);
      else
        v_locked := array(select j.id from thumbq.jobs j where j.id = any(v_all)
                           order by j.id for update skip locked);
      end if;
      select array_agg(j.id order by j.id), array_agg(j.msg_id order by j.id),
             array_agg(j.priority::integer order by j.id)
        into v_ids, v_msgs, v_prio
        from thumbq.jobs j
        join jsonb_to_recordset(p_results) as r(job_id bigint, msg_id bigint)
          on j.id = r.job_id and j.msg_id = r.msg_id
       where j.id = any(v_locked) and j.status = 'processing' and j.worker_id = p_worker_id;
      if v_ids is not null then
        perform thumbq.delete_messages(v_prio, v_msgs);
        perform thumbq.release_heads(v_keys, v_ids);
      end if;
      perform thumbq.end_cancelled_runs(p_worker_id, v_locked);
      if v_ids is not null then
        -- The results parsed once into typed columns (a join on JSON text would extract them
        -- for every pair of rows).
        update thumbq.jobs j
           set status = 'completed', error_code = null, last_error = null,
               thumbnail_key = r.thumbnail_key,
               thumbnail_content_type = r.thumbnail_content_type,
               width = r.width, height = r.height, bytes = r.bytes, duration_ms = r.duration_ms,
               content_type = coalesce(j.content_type, r.source_type),
               thumbnails = r.thumbnails, thumbhash = r.thumbhash,
               dominant_color = r.dominant_color, degraded = coalesce(r.degraded, false),
               result = r.result,
               -- Done means all of it where the total is known, else as far as it reported.
               progress_done = coalesce(j.progress_total, r.progress_done, j.progress_done),
               completed_at = clock_timestamp(), updated_at = clock_timestamp(),
               lease_expires_at = null, msg_id = null
          from jsonb_to_recordset(p_results)
            as r(job_id bigint, thumbnail_key text, thumbnail_content_type text, width integer,
                 height integer, bytes bigint, duration_ms integer, source_type text,
                 thumbnails jsonb, thumbhash text, dominant_color text, degraded boolean,
                 result jsonb, progress_done bigint)
         where j.id = any(v_ids) and j.id = r.job_id;
      end if;
      return query
      select a.id, case when a.id = any(coalesce(v_ids, '{}')) then 'completed'
                        when a.id = any(v_locked) then 'not_held'
                        when exists (select 1 from thumbq.jobs j where j.id = a.id) then 'busy'
                        else 'not_held' end
        from unnest(v_all) as a(id);
      return;
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

-- Record finished jobs (complete_jobs, waiting for rows others hold); returns how many
-- completed. The one call an RPC user needs.
create or replace function thumbq.complete(p_worker_id text, p_results jsonb)
returns integer
language sql
as $$
  select count(*)::integer from thumbq.complete_jobs(p_worker_id, p_results, true) c
   where c.outcome = 'completed'
$$;

-- A running job's checkpoint, from its lease holder: its state (null keeps the last) and
-- progress are saved. With p_requeue the handler stopped to be resumed later: the job waits
-- again, visible at once, and the attempt it used is given back (a checkpoint is not a
-- failure). Returns {"owned": bool, "status": text}: a job cancelled meanwhile is not owned
-- (and a requeue from its run ends that run's lease).
create or replace function thumbq.checkpoint(p_worker_id text, p_job_id bigint, p_msg_id bigint,
                                             p_state jsonb, p_done bigint, p_total bigint,
                                             p_requeue boolean)
returns jsonb
language plpgsql
set jit = off
as $$
declare
  j thumbq.jobs;
  v_keys text[];
begin
  if p_requeue then
    v_keys := thumbq.lock_ordering_keys_of(array[p_job_id]);
  end if;
  select * into j from thumbq.jobs where id = p_job_id for update;
  if not found or j.status <> 'processing' or j.worker_id is distinct from p_worker_id
     or j.msg_id is distinct from p_msg_id then
    if found and p_requeue then
      perform thumbq.end_cancelled_runs(p_worker_id, array[j.id]);
    end if;
    return jsonb_build_object('owned', false, 'status', j.status);
  end if;
  if p_requeue then
    perform pgmq.set_vt(thumbq.band_queue(j.priority), j.msg_id, 0);
    update thumbq.jobs
       set status = 'pending', attempts = greatest(attempts - 1, 0), worker_id = null,
           lease_expires_at = null, state = coalesce(p_state, state),
           checkpoints = checkpoints + 1,
           progress_done = coalesce(p_done, progress_done),
           progress_total = coalesce(p_total, progress_total), updated_at = clock_timestamp()
     where id = j.id;
    return jsonb_build_object('owned', true, 'status', 'pending');
  end if;
  update thumbq.jobs
     set state = coalesce(p_state, state),
         checkpoints = checkpoints + case when p_state is null then 0 else 1 end,
         progress_done = coalesce(p_done, progress_done),
         progress_total = coalesce(p_total, progress_total), updated_at = clock_timestamp()
   where id = j.id;
  return jsonb_build_object('owned', true, 'status', 'processing');
end
$$;

-- Record a failed attempt. Permanent errors end the job at once (unsupported_type and
-- unsupported_task as 'unsupported', source_missing as 'cancelled', others 'failed'); transient
-- ones retry after an exponential backoff with jitter, made by moving the message's visibility
-- timeout (nobody sleeps), until max_attempts, then the job is 'failed' and a dead letter goes
-- to the DLQ. A failed or unsupported job holds the rest of its ordering key; a cancelled one
-- lets the next go. Only the lease holder's report counts. Returns {"status", "owned",
-- "retry_in_s"}.
create or replace function thumbq.fail(p_worker_id text, p_msg_id bigint, p_job_id bigint,
                                       p_error_code text, p_message text,
                                       p_permanent boolean,
                                       p_backoff_base_s integer default 30,
                                       p_backoff_cap_s integer default 900)
returns jsonb
language plpgsql
set jit = off
as $$
declare
  j thumbq.jobs;
  v_keys text[];
  v_status text;
  v_delay integer;
  v_dlq bigint;
  v_attempt integer := 0;
begin
  loop
    begin
      v_keys := thumbq.lock_ordering_keys_of(array[p_job_id]);
      select * into j from thumbq.jobs where id = p_job_id for update;
      if not found or j.status <> 'processing' or j.worker_id is distinct from p_worker_id
         or j.msg_id is distinct from p_msg_id then
        if found then
          perform thumbq.end_cancelled_runs(p_worker_id, array[j.id]);
        end if;
        return jsonb_build_object('status', j.status, 'owned', false, 'retry_in_s', null);
      end if;

      if p_permanent or j.attempts >= j.max_attempts then
        v_status := case when not p_permanent then 'failed'
                         when p_error_code in ('unsupported_type', 'unsupported_task')
                           then 'unsupported'
                         when p_error_code = 'source_missing' then 'cancelled'
                         else 'failed' end;
        perform pgmq.delete(thumbq.band_queue(j.priority), p_msg_id);
        v_dlq := null;
        if not p_permanent then
          v_dlq := (select pgmq.send('thumbq_dlq', jsonb_build_object(
                      'job_id', j.id, 'task', j.task, 'source_key', j.source_key,
                      'source_etag', j.source_etag, 'group_id', j.group_id,
                      'error_code', p_error_code, 'last_error', left(p_message, 2000),
                      'attempts', j.attempts)));
        end if;
        if v_status = 'cancelled' then
          perform thumbq.release_heads(v_keys, array[j.id]);
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
      perform pgmq.set_vt(thumbq.band_queue(j.priority), p_msg_id, v_delay);
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
-- their tokens back to the buckets they came from. Returns how many were released.
create or replace function thumbq.release(p_worker_id text, p_job_ids bigint[],
                                          p_bucket text default 'thumbnail_generation')
returns integer
language plpgsql
set jit = off
as $$
declare
  v_ids bigint[];
  v_msgs bigint[];
  v_prio integer[];
  v_attempt integer := 0;
begin
  loop
    begin
      select array_agg(s.id), array_agg(s.msg_id), array_agg(s.priority)
        into v_ids, v_msgs, v_prio
        from (select j.id, j.msg_id, j.priority::integer as priority from thumbq.jobs j
               where j.id = any(p_job_ids) and j.status = 'processing'
                 and j.worker_id = p_worker_id
               order by j.id
                 for update) s;
      if v_ids is null then
        return 0;
      end if;
      perform thumbq.set_message_vt(v_prio, v_msgs, array_fill(0, array[cardinality(v_ids)]));
      update thumbq.jobs j
         set status = 'pending', attempts = greatest(j.attempts - 1, 0), worker_id = null,
             lease_expires_at = null, started_at = null, updated_at = clock_timestamp()
       where j.id = any(v_ids);
      -- The buckets last (the header's order): each job's token goes back where it came from
      -- (p_bucket for thumbnails, the task's own bucket for the others).
      perform thumbq.refund_tokens(b.bucket, b.n)
         from (select case when j.task = 'thumbnail' then p_bucket else t.bucket end as bucket,
                      count(*)::integer as n
                 from thumbq.jobs j left join thumbq.tasks t on t.name = j.task
                where j.id = any(v_ids)
                group by 1 order by 1) b
        where b.bucket is not null;
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

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.end_cancelled_runs(text, bigint[]),
  thumbq.complete_jobs(text, jsonb, boolean),
  thumbq.complete(text, jsonb),
  thumbq.checkpoint(text, bigint, bigint, jsonb, bigint, bigint, boolean),
  thumbq.fail(text, bigint, bigint, text, text, boolean, integer, integer),
  thumbq.release(text, bigint[], text)
  from public, anon, authenticated;
