-- Maintenance: expired leases, retries and cancellation of groups, retention.

-- Reset jobs whose lease expired (their invocation was killed) so that status shows the
-- truth, at most p_limit per call; their messages become visible at once. The lost attempt
-- still counts. Rows another transition holds are left for the next call.
create or replace function thumbq.reap_stale(p_limit integer default 5000)
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
               where j.status = 'processing' and j.lease_expires_at < clock_timestamp()
               order by j.id
               limit greatest(p_limit, 0)
                 for update skip locked) s;
      if v_ids is null then
        return 0;
      end if;
      perform thumbq.set_message_vt(v_prio, v_msgs, array_fill(0, array[cardinality(v_ids)]));
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

-- Queue jobs again with fresh attempts, each with one new message (a job of an ordering key
-- only when it is the key's head); their dead letters are removed. Of p_job_ids, only failed
-- jobs change, and unsupported ones that hold an ordering key (their task may be deployed
-- since). Returns the ids queued again.
create or replace function thumbq.requeue_jobs(p_job_ids bigint[])
returns bigint[]
language plpgsql
set jit = off
as $$
declare
  v_ids bigint[];
  v_dlq bigint[];
  v_attempt integer := 0;
begin
  loop
    begin
      perform thumbq.lock_ordering_keys_of(p_job_ids);
      select array_agg(s.id), array_agg(s.dlq_msg_id) filter (where s.dlq_msg_id is not null)
        into v_ids, v_dlq
        from (select j.id, j.dlq_msg_id from thumbq.jobs j
               where j.id = any(p_job_ids)
                 and (j.status = 'failed'
                      or (j.status = 'unsupported' and j.ordering_key is not null))
               order by j.id
                 for update) s;
      if v_ids is null then
        return '{}';
      end if;
      if v_dlq is not null then
        perform pgmq.delete('thumbq_dlq', v_dlq);
      end if;
      with d as (
        select j.id, j.priority,
               case when j.ordering_key is null then 0
                    else thumbq.head_delay(j.ordering_key, j.sequence) end as delay_s
          from thumbq.jobs j where j.id = any(v_ids)
      ), m as (
        select d.id,
               case when d.delay_s is not null
                    then (select pgmq.send(thumbq.band_queue(d.priority),
                                           jsonb_build_object('job_id', d.id), d.delay_s))
               end as msg_id
          from d
      )
      update thumbq.jobs j
         set status = 'pending', attempts = 0, error_code = null, last_error = null,
             completed_at = null, started_at = null, next_attempt_at = null, worker_id = null,
             lease_expires_at = null, msg_id = m.msg_id, dlq_msg_id = null,
             updated_at = clock_timestamp()
        from m
       where j.id = m.id;
      return v_ids;
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

-- Queue a group's failed jobs again (requeue_jobs); returns how many.
create or replace function thumbq.retry_failed(p_group_id text)
returns integer
language sql
as $$
  select cardinality(thumbq.requeue_jobs(array(
    select j.id from thumbq.jobs j
     where j.group_id = p_group_id
       and (j.status = 'failed' or (j.status = 'unsupported' and j.ordering_key is not null)))))
$$;

-- Cancel jobs that still wait or run, and failed or unsupported jobs that hold their ordering
-- key: their messages are deleted, their status says why, and the next job of each ordering key
-- goes. A worker running one of them finds it cancelled (ctx.cancelled(), or when it reports)
-- and changes nothing; the lease it held is kept on the row, so that enqueueing the version
-- again waits for it, and so does the next job of its ordering key (until the run reports or
-- the lease ends). Returns how many were cancelled.
create or replace function thumbq.cancel_jobs(p_job_ids bigint[],
                                              p_error_code text default 'cancelled',
                                              p_message text default 'cancelled by request')
returns integer
language plpgsql
set jit = off
as $$
declare
  v_keys text[];
  v_ids bigint[];
  v_msgs bigint[];
  v_prio integer[];
  v_attempt integer := 0;
begin
  loop
    begin
      v_keys := thumbq.lock_ordering_keys_of(p_job_ids);
      select array_agg(s.id), array_agg(s.msg_id), array_agg(s.priority)
        into v_ids, v_msgs, v_prio
        from (select j.id, j.msg_id, j.priority::integer as priority from thumbq.jobs j
               where j.id = any(p_job_ids)
                 and (j.status in ('pending', 'processing')
                      or (j.status in ('failed', 'unsupported') and j.ordering_key is not null))
               order by j.id
                 for update) s;
      if v_ids is null then
        return 0;
      end if;
      perform thumbq.delete_messages(v_prio, v_msgs);
      perform thumbq.release_heads(v_keys, v_ids, true);
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

-- Prune history older than p_days in one bounded chunk of at most p_limit rows per kind:
-- terminal jobs (with their dead letters), batch runs, and pgmq's archive of thumbq's queues.
-- Group rows stay, and so does a failed or unsupported job that holds its ordering key.
-- Returns what it deleted; call again until everything is 0.
create or replace function thumbq.prune(p_days integer, p_limit integer default 5000)
returns jsonb
language plpgsql
set jit = off
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
                       -- A failed or unsupported job holds the rest of its ordering key.
                       and not (x.ordering_key is not null
                                and x.status in ('failed', 'unsupported')
                                and exists (select 1 from thumbq.jobs y
                                             where y.ordering_key = x.ordering_key
                                               and y.sequence > x.sequence
                                               and y.status = 'pending'))
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
  foreach t in array array['a_thumbq_jobs', 'a_thumbq_dlq']
      || array(select 'a_thumbq_jobs_p' || p from generate_series(1, 9) p) loop
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

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.reap_stale(integer),
  thumbq.requeue_jobs(bigint[]),
  thumbq.retry_failed(text),
  thumbq.cancel_jobs(bigint[], text, text),
  thumbq.cancel(text),
  thumbq.prune(integer, integer)
  from public, anon, authenticated;
