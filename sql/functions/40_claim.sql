-- Claim: lease waiting jobs to a worker, under priorities, ordering keys and rate limits.

-- Read up to p_qty messages and lease their jobs to p_worker_id for p_vt_seconds (the messages'
-- visibility timeout: longer than an invocation's budget, so a live invocation is never
-- double-served and a killed one's messages come back soon).
-- Priorities: the queues of higher priorities are read first, but a queue whose oldest
-- claimable job has waited p_ageing_s seconds counts one priority higher, and so on (ageing:
-- nothing starves). A claimable job has a message that is due, or a lease that has expired; a
-- job held behind its ordering key or waiting out a backoff does not count. A queue whose only
-- claimable jobs are expired leases (a killed invocation's) is read too.
-- Only a message that is its job's current one, for a job that waits or whose lease has
-- expired, is claimed, and a job of an ordering key only when it is the key's head. A message
-- of a job someone else is changing is handed back after a second; one of a job still leased
-- (or behind a cancelled run that may still be going) waits for that lease; a stale one (job
-- finished, cancelled, superseded, gone, or a second message) is deleted, and so is one of a
-- job that is not its key's head (it gets a message when it is). A job whose lease was lost so
-- often that it has no attempts left goes to the dead-letter queue.
-- Tokens: each claimed job takes one from its own bucket (thumbnails: p_bucket, the caller's
-- THUMBQ_RATE_BUCKET; other tasks: thumbq.tasks), taken last, after every other lock, so that
-- a bucket row is held only while the claim does nothing that waits. Jobs a bucket refuses are
-- handed back for as long as it needs to refill. No message is read beyond what the buckets
-- could grant (thumbq.bucket_levels).
-- Returns {"jobs": [...], "rate_limited": bool, "retry_after_ms": int|null, "read": int,
-- "limited": int}.
create or replace function thumbq.claim(p_worker_id text, p_qty integer, p_vt_seconds integer,
                                        p_bucket text default 'thumbnail_generation',
                                        p_ageing_s integer default 60)
returns jsonb
language plpgsql
set jit = off
as $$
declare
  v_want integer := greatest(p_qty, 0);
  v_read integer;
  v_cap integer;
  v_retry integer;
  v_bands integer[];
  v_band integer;
  v_left integer;
  v_prio integer[];
  v_msg_ids bigint[];
  v_job_ids bigint[];
  v_locked bigint[];
  v_dead bigint[];
  v_held bigint[];
  v_limited bigint[] := '{}';
  v_limited_s integer;
  a_prio integer[];
  a_msg bigint[];
  a_job bigint[];
  a_cls text[];
  a_wait integer[];
  a_bucket text[];
  a_group text[];
  v_dlq bigint[];
  v_jobs jsonb;
  v_granted integer;
  v_cut boolean;
  v_attempt integer := 0;
  r record;
begin
  if v_want = 0 then
    return jsonb_build_object('jobs', '[]'::jsonb, 'rate_limited', false,
                              'retry_after_ms', null, 'read', 0, 'limited', 0);
  end if;
  -- With every bucket that could apply empty, a read would only hand its messages back.
  select b.tokens, b.retry_after_ms into v_cap, v_retry from thumbq.bucket_levels(p_bucket) b;
  v_read := least(v_want, coalesce(v_cap, v_want));
  if v_read = 0 then
    return jsonb_build_object('jobs', '[]'::jsonb, 'rate_limited', true,
                              'retry_after_ms', coalesce(v_retry, 1000), 'read', 0,
                              'limited', 0);
  end if;

  loop
    begin
      -- Which queues, in which order.
      if not exists (select 1 from thumbq.jobs j
                      where j.status = 'pending' and j.msg_id is not null and j.priority > 0)
         and not exists (select 1 from thumbq.jobs j
                          where j.status = 'processing' and j.priority > 0
                            and j.lease_expires_at <= clock_timestamp()) then
        v_bands := '{0}';
      else
        select array_agg(b.p order by b.eff desc, b.p desc) into v_bands
          from (select p.p, p.p + floor(extract(epoch from clock_timestamp() - o.since)
                                        / greatest(p_ageing_s, 1)) as eff
                  from generate_series(0, 9) p(p)
                 cross join lateral (
                   select least(
                     (select w.due from (
                        select coalesce(j.next_attempt_at, j.created_at) as due
                          from thumbq.jobs j
                         where j.status = 'pending' and j.msg_id is not null
                           and j.priority = p.p
                         order by coalesce(j.next_attempt_at, j.created_at)
                         limit 1) w
                       where w.due <= clock_timestamp()),
                     (select min(j.lease_expires_at) from thumbq.jobs j
                       where j.status = 'processing' and j.priority = p.p
                         and j.lease_expires_at <= clock_timestamp())) as since) o
                 where o.since is not null) b;
      end if;

      -- Messages first: pgmq.read skips the ones other readers hold.
      v_prio := '{}';
      v_msg_ids := '{}';
      v_job_ids := '{}';
      v_left := v_read;
      foreach v_band in array coalesce(v_bands, '{0}') loop
        exit when v_left <= 0;
        select v_prio || coalesce(array_agg(v_band), '{}'),
               v_msg_ids || coalesce(array_agg(m.msg_id order by m.msg_id), '{}'),
               v_job_ids || coalesce(array_agg((m.message->>'job_id')::bigint
                                               order by m.msg_id), '{}')
          into v_prio, v_msg_ids, v_job_ids
          from pgmq.read(thumbq.band_queue(v_band), p_vt_seconds, v_left) m;
        v_left := v_read - cardinality(v_msg_ids);
      end loop;

      -- Then their jobs, skipping rows another transition holds.
      select coalesce(array_agg(s.id), '{}') into v_locked
        from (select j.id from thumbq.jobs j where j.id = any(v_job_ids)
               order by j.id for update skip locked) s;

      select array_agg(c.p), array_agg(c.msg_id), array_agg(c.job_id), array_agg(c.cls),
             array_agg(c.wait_s), array_agg(c.bucket), array_agg(c.group_id)
        into a_prio, a_msg, a_job, a_cls, a_wait, a_bucket, a_group
        from (
          select m.p, m.msg_id, m.job_id,
                 case
                   when j.id is null then 'stale'
                   when not (j.id = any(v_locked)) then 'busy'
                   when j.msg_id is distinct from m.msg_id or j.priority <> m.p then 'stale'
                   -- A second message of one job in the same read: the first one counts.
                   when m.msg_id <> min(m.msg_id) over (partition by m.job_id, m.p)
                     then 'stale'
                   when j.status = 'processing' and j.lease_expires_at > clock_timestamp()
                     then 'leased'
                   when j.status not in ('pending', 'processing') then 'stale'
                   -- Queued again while a cancelled run of it may still be going.
                   when j.status = 'pending' and j.lease_expires_at > clock_timestamp()
                     then 'leased'
                   -- Behind a cancelled run of its key that may still be going.
                   when h.status = 'cancelled' then 'leased'
                   when h.job_id is not null then 'held'
                   when j.attempts >= j.max_attempts then 'dead'
                   else 'take'
                 end as cls,
                 greatest(1, ceil(extract(epoch from
                   coalesce(case when h.status = 'cancelled' then h.lease_expires_at end,
                            j.lease_expires_at, clock_timestamp()) - clock_timestamp())))::integer
                   as wait_s,
                 -- Thumbnails take the caller's bucket (THUMBQ_RATE_BUCKET; none: unlimited).
                 case when j.task = 'thumbnail' then p_bucket else t.bucket end as bucket,
                 j.group_id
            from unnest(v_prio, v_msg_ids, v_job_ids) as m(p, msg_id, job_id)
            left join thumbq.jobs j on j.id = m.job_id
            left join thumbq.tasks t on t.name = j.task
            left join lateral thumbq.held_by(j.ordering_key, j.sequence) h
              on j.ordering_key is not null) c;

      -- Every message operation before any group row: these are all messages this
      -- transaction already holds, so none of them waits.
      perform thumbq.delete_messages(array_agg(c.prio), array_agg(c.msg_id))
         from unnest(a_prio, a_msg, a_cls) as c(prio, msg_id, cls)
        where c.cls in ('stale', 'dead', 'held') having count(*) > 0;
      perform thumbq.set_message_vt(array_agg(c.prio), array_agg(c.msg_id),
                                    array_agg(case c.cls when 'busy' then 1 else c.wait_s end))
         from unnest(a_prio, a_msg, a_cls, a_wait) as c(prio, msg_id, cls, wait_s)
        where c.cls in ('busy', 'leased') having count(*) > 0;
      select array_agg(c.job_id order by c.job_id) filter (where c.cls = 'dead'),
             array_agg(c.job_id order by c.job_id) filter (where c.cls = 'held')
        into v_dead, v_held
        from unnest(a_job, a_cls) as c(job_id, cls);
      v_dlq := '{}';
      if v_dead is not null then
        select coalesce(array_agg((select pgmq.send('thumbq_dlq', jsonb_build_object(
                 'job_id', j.id, 'task', j.task, 'source_key', j.source_key,
                 'source_etag', j.source_etag, 'group_id', j.group_id,
                 'error_code', coalesce(j.error_code, 'lease_expired'),
                 'last_error', coalesce(j.last_error, 'the worker lost its lease '
                                        || j.attempts || ' times (killed or timed out)'
                                        || ' without reporting'),
                 'attempts', j.attempts))) order by j.id), '{}')
          into v_dlq
          from thumbq.jobs j where j.id = any(v_dead);
      end if;

      perform thumbq.lock_groups(array(select c.group_id
                                         from unnest(a_cls, a_group) as c(cls, group_id)
                                        where c.cls in ('take', 'dead')));

      -- The buckets last: what each refuses waits for it (those messages are this claim's).
      v_limited := '{}';
      v_limited_s := null;
      for r in select c.bucket, array_agg(c.job_id order by c.msg_id) as ids
                 from unnest(a_msg, a_job, a_cls, a_bucket) as c(msg_id, job_id, cls, bucket)
                where c.cls = 'take' and c.bucket is not null
                group by c.bucket order by c.bucket loop
        select t.taken, t.retry_after_ms into v_granted, v_retry
          from thumbq.take_tokens(r.bucket, cardinality(r.ids), true) t;
        if found and v_granted < cardinality(r.ids) then
          v_limited := v_limited || r.ids[v_granted + 1:];
          v_limited_s := least(coalesce(v_limited_s, 2147483647),
                               greatest(1, ceil(coalesce(v_retry, 1000) / 1000.0))::integer);
        end if;
      end loop;
      if cardinality(v_limited) > 0 then
        perform thumbq.set_message_vt(array_agg(c.prio), array_agg(c.msg_id),
                                      array_fill(v_limited_s, array[count(*)::integer]))
           from unnest(a_prio, a_msg, a_job) as c(prio, msg_id, job_id)
          where c.job_id = any(v_limited);
      end if;

      -- A job that is not its key's head gives its message up (the head's end sends it one).
      if v_held is not null then
        update thumbq.jobs set msg_id = null where id = any(v_held);
      end if;

      -- One status change for everything taken and dead-lettered.
      with d as (
        select * from unnest(coalesce(v_dead, '{}'), v_dlq) as d(job_id, dlq_msg_id)
      ), x as (
        select c.job_id, null::bigint as dlq_msg_id, false as dead
          from unnest(a_job, a_cls) as c(job_id, cls)
         where c.cls = 'take' and not (c.job_id = any(v_limited))
        union all
        select d.job_id, d.dlq_msg_id, true from d
      ), u as (
        update thumbq.jobs j
           set status = case when x.dead then 'failed' else 'processing' end,
               attempts = case when x.dead then j.attempts else j.attempts + 1 end,
               worker_id = case when x.dead then null else p_worker_id end,
               started_at = case when x.dead then j.started_at else clock_timestamp() end,
               next_attempt_at = null,
               lease_expires_at = case when x.dead then null
                 else clock_timestamp() + make_interval(secs => p_vt_seconds) end,
               error_code = case when x.dead then coalesce(j.error_code, 'lease_expired')
                                 else j.error_code end,
               last_error = case when x.dead then coalesce(j.last_error,
                                   'the worker lost its lease ' || j.attempts
                                   || ' times (killed or timed out) without reporting')
                                 else j.last_error end,
               completed_at = case when x.dead then clock_timestamp() end,
               msg_id = case when x.dead then null else j.msg_id end,
               dlq_msg_id = coalesce(x.dlq_msg_id, j.dlq_msg_id),
               updated_at = clock_timestamp()
          from x
         where j.id = x.job_id
        returning j.id, j.msg_id, j.group_id, j.task, j.source_key, j.source_etag,
                  j.source_bytes, j.content_type, j.attempts, j.max_attempts, j.payload, j.state,
                  j.priority, j.ordering_key, j.sequence, j.checkpoints, j.progress_done,
                  j.progress_total, j.status
      )
      -- The claimed jobs as JSON objects of these columns (jsonb_agg of the row itself: no
      -- function call per job, which cost a tenth of a claim).
      select coalesce(jsonb_agg(u order by array_position(v_bands, u.priority::integer), u.msg_id)
                        filter (where u.status = 'processing'), '[]'::jsonb)
        into v_jobs
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

  -- The buckets, not the queue, cut this claim short when it read no more than they could
  -- grant and the queue had a message for each, or when one refused a job it read: say so,
  -- or the caller takes the short claim for a drained queue.
  v_cut := v_read < v_want and cardinality(v_msg_ids) >= v_read;
  return jsonb_build_object('jobs', v_jobs,
                            'rate_limited', v_cut or cardinality(v_limited) > 0,
                            'retry_after_ms', case when v_limited_s is not null
                                                     then v_limited_s * 1000
                                                   when v_cut then coalesce(v_retry, 1000) end,
                            'read', cardinality(v_msg_ids),
                            'limited', cardinality(v_limited));
end
$$;

-- Claim one given job, if it waits: what an interactive call (`POST /api/jobs` with wait_ms)
-- runs at once, under the same lease, rules and rate limit as a batch. Returns {"jobs": [job]}
-- or {"jobs": [], "reason": "busy" | "not_waiting" | "rate_limited", "retry_after_ms"}.
create or replace function thumbq.claim_job(p_worker_id text, p_job_id bigint,
                                            p_vt_seconds integer,
                                            p_bucket text default 'thumbnail_generation')
returns jsonb
language plpgsql
set jit = off
as $$
declare
  j thumbq.jobs;
  h record;
  v_bucket text;
  v_grant record;
  v_out jsonb;
begin
  select * into j from thumbq.jobs where id = p_job_id for update skip locked;
  if not found then
    return jsonb_build_object('jobs', '[]'::jsonb, 'reason',
      case when exists (select 1 from thumbq.jobs where id = p_job_id) then 'busy'
           else 'not_waiting' end);
  end if;
  if j.status <> 'pending' or j.msg_id is null
     or j.next_attempt_at > clock_timestamp() or j.attempts >= j.max_attempts then
    return jsonb_build_object('jobs', '[]'::jsonb, 'reason', 'not_waiting');
  end if;
  -- A cancelled run of this version, or of the one before it in its ordering key, may still
  -- be going: never two runs at once, never out of order.
  if j.lease_expires_at > clock_timestamp() then
    return jsonb_build_object('jobs', '[]'::jsonb, 'reason', 'busy');
  end if;
  if j.ordering_key is not null then
    select * into h from thumbq.held_by(j.ordering_key, j.sequence);
    if found then
      return jsonb_build_object('jobs', '[]'::jsonb, 'reason',
                                case when h.status = 'cancelled' then 'busy'
                                     else 'not_waiting' end);
    end if;
  end if;
  -- The message, leased for the run (a claim reading it meanwhile finds the job locked).
  if not exists (select 1 from pgmq.set_vt(thumbq.band_queue(j.priority), j.msg_id,
                                           p_vt_seconds)) then
    return jsonb_build_object('jobs', '[]'::jsonb, 'reason', 'not_waiting');
  end if;
  perform thumbq.lock_groups(array[j.group_id]);
  select case when j.task = 'thumbnail' then p_bucket else t.bucket end
    into v_bucket
    from (select 1) one left join thumbq.tasks t on t.name = j.task;
  if v_bucket is not null then
    select * into v_grant from thumbq.take_tokens(v_bucket, 1, false);
    if found and not v_grant.granted then
      perform pgmq.set_vt(thumbq.band_queue(j.priority), j.msg_id, 0);
      return jsonb_build_object('jobs', '[]'::jsonb, 'reason', 'rate_limited',
                                'retry_after_ms', v_grant.retry_after_ms);
    end if;
  end if;
  with u as (
    update thumbq.jobs
       set status = 'processing', attempts = attempts + 1, worker_id = p_worker_id,
           started_at = clock_timestamp(), next_attempt_at = null,
           lease_expires_at = clock_timestamp() + make_interval(secs => p_vt_seconds),
           updated_at = clock_timestamp()
     where id = j.id
    -- The columns a claim returns (thumbq.claim).
    returning id, msg_id, group_id, task, source_key, source_etag, source_bytes, content_type,
              attempts, max_attempts, payload, state, priority, ordering_key, sequence,
              checkpoints, progress_done, progress_total, status
  )
  select to_jsonb(u) into v_out from u;
  return jsonb_build_object('jobs', jsonb_build_array(v_out));
end
$$;

-- A running job's lease and its message's visibility, renewed by its holder (a handler that
-- overran its invocation keeps its job until it ends). Jobs cancelled meanwhile keep their
-- run's lease too (their ordering key waits for it); returns the ids still processing.
create or replace function thumbq.extend_leases(p_worker_id text, p_job_ids bigint[],
                                                p_vt_seconds integer)
returns bigint[]
language plpgsql
set jit = off
as $$
declare
  v_ids bigint[];
  v_msgs bigint[];
  v_prio integer[];
  v_held bigint[];
begin
  select array_agg(s.id), array_agg(s.msg_id), array_agg(s.priority),
         array_agg(s.id) filter (where s.status = 'processing')
    into v_ids, v_msgs, v_prio, v_held
    from (select j.id, j.msg_id, j.priority::integer as priority, j.status
            from thumbq.jobs j
           where j.id = any(p_job_ids) and j.worker_id = p_worker_id
             and (j.status = 'processing'
                  or (j.status = 'cancelled' and j.lease_expires_at is not null))
           order by j.id
             for update) s;
  if v_ids is null then
    return '{}';
  end if;
  perform thumbq.set_message_vt(v_prio, v_msgs,
                                array_fill(greatest(p_vt_seconds, 1), array[cardinality(v_ids)]));
  update thumbq.jobs
     set lease_expires_at = clock_timestamp() + make_interval(secs => greatest(p_vt_seconds, 1))
   where id = any(v_ids);
  return coalesce(v_held, '{}');
end
$$;

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.claim(text, integer, integer, text, integer),
  thumbq.claim_job(text, bigint, integer, text),
  thumbq.extend_leases(text, bigint[], integer)
  from public, anon, authenticated;
