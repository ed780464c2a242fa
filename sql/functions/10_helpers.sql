-- What every transition shares: the lock order, locks, messages, ordering-key heads, buckets.
--
-- One lock order in every transition:
--   1. advisory locks on source keys, idempotency keys and ordering keys (thumbq.lock_keys:
--      sorted, all of a transition's keys in one call)
--   2. job rows (SELECT ... ORDER BY id FOR UPDATE: all of a transition's rows in one pass)
--   3. queue messages (pgmq.read / delete / set_vt / send)
--   4. group rows (thumbq.lock_groups, sorted, or the status UPDATE whose trigger sorts them)
--   5. token buckets (take_tokens, refund_tokens): last, so that a bucket row is held only
--      while its transaction does nothing that waits.
-- claim is the one transition that meets messages before job rows (pgmq.read locks what it
-- reads); it takes both with SKIP LOCKED, so it never waits for either and cannot close a cycle.
-- Each transition changes statuses (and so group rows, through the triggers) only after every
-- message operation. A deadlock that still happens (an operator's own statements, a foreign
-- trigger) is retried inside the transition, a bounded number of times; a transition that
-- spans both kinds of enqueue (enqueue_mixed) is one function, so its retry covers all of it.
--
-- The transitions run with `set jit = off`: each statement touches a handful of rows, and an
-- ordering key's long history once pushed one estimate past jit_above_cost (2 s of compiling for
-- a statement of 0.1 ms; bench/ordered_history.py).
--
-- Queues: a job's message lives in the queue of its priority (thumbq_jobs for 0, thumbq_jobs_p1
-- .. thumbq_jobs_p9); every job that waits or runs has exactly one message, except the jobs of
-- an ordering key behind its head, which get theirs when the head is done.
--
-- Ordering keys: the jobs of a key run strictly one at a time, in sequence order. The head is
-- the lowest sequence that is active: pending, processing, failed or unsupported (the last two
-- hold the key until retried or cancelled), or cancelled while its run may still be going (its
-- lease is live: a handler stops only when it next checks, or at its deadline). claim takes a
-- job of a key only when it is the head (thumbq.held_by).

create or replace function thumbq.band_queue(p_priority integer)
returns text
language sql
immutable
as $$
  select case when coalesce(p_priority, 0) <= 0 then 'thumbq_jobs'
              else 'thumbq_jobs_p' || least(p_priority, 9) end
$$;

-- Locks and message helpers ------------------------------------------------------------------

-- Lock the existing group rows a transition is about to change, in group_id order. Called
-- after every message operation and before the status changes, so that a transition with
-- several status statements takes its group rows at one point, in one order. Missing rows are
-- created by the status statement's trigger (inserted in order; two transactions only meet on
-- a new row when both create it, and the retry of each transition covers that corner).
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

-- Serialise transitions that share a key (so that two enqueues of one version never both send
-- a message, and an ordering key's head changes one transition at a time), in a fixed order so
-- that overlapping callers cannot deadlock. Transaction scoped: safe behind a transaction-mode
-- pooler. Keys are namespaced by the caller ('src:', 'idem:', 'ord:').
create or replace function thumbq.lock_keys(p_keys text[])
returns void
language sql
as $$
  select count(pg_advisory_xact_lock(1953002865, h))::integer * 0
    from (select distinct hashtext(k) as h from unnest(p_keys) k where k is not null
           order by 1) s
$$;

-- Delete messages, each from the queue of its job's priority.
create or replace function thumbq.delete_messages(p_priorities integer[], p_msgs bigint[])
returns void
language plpgsql
as $$
declare
  r record;
begin
  -- Most calls are all of one priority: one delete, no grouping.
  if p_priorities[1] is not null and p_priorities <@ array[p_priorities[1]] then
    perform pgmq.delete(thumbq.band_queue(p_priorities[1]),
                        array(select m from unnest(p_msgs) m where m is not null));
    return;
  end if;
  for r in select x.p, array_agg(x.m) as msgs
             from unnest(p_priorities, p_msgs) as x(p, m)
            where x.m is not null
            group by x.p order by x.p loop
    perform pgmq.delete(thumbq.band_queue(r.p), r.msgs);
  end loop;
end
$$;

-- Set messages' visibility timeouts, each in the queue of its job's priority.
create or replace function thumbq.set_message_vt(p_priorities integer[], p_msgs bigint[],
                                                 p_vt_seconds integer[])
returns void
language sql
as $$
  select count(*)::integer * 0
    from unnest(p_priorities, p_msgs, p_vt_seconds) as x(p, m, vt),
         lateral pgmq.set_vt(thumbq.band_queue(x.p), x.m, x.vt)
   where x.m is not null
$$;

-- The job that holds an ordering key ahead of sequence p_sequence: the earliest active job before
-- it (pending, processing, failed, unsupported, or cancelled while its run may still be going),
-- or no row. One probe of jobs_ordering_active_idx, whatever the key's history.
create or replace function thumbq.held_by(p_key text, p_sequence bigint)
returns table (job_id bigint, status text, lease_expires_at timestamptz)
language sql
stable
as $$
  select j.id, j.status, j.lease_expires_at
    from thumbq.jobs j
   where j.ordering_key = p_key and j.sequence < p_sequence
     and (j.status in ('pending', 'processing', 'failed', 'unsupported')
          or (j.status = 'cancelled' and j.lease_expires_at is not null))
     and (j.status <> 'cancelled' or j.lease_expires_at > clock_timestamp())
   order by j.sequence
   limit 1
$$;

-- The head of each ordering key once the jobs in p_ended no longer hold it: the lowest active
-- job (see held_by) not in p_ended. Call with the keys locked (lock_keys('ord:' || key)).
create or replace function thumbq.heads_of(p_keys text[], p_ended bigint[])
returns table (ordering_key text, job_id bigint, priority integer, status text, msg_id bigint)
language sql
stable
as $$
  select k.key, h.id, h.priority, h.status, h.msg_id
    from unnest(p_keys) k(key)
    cross join lateral (
      select j.id, j.priority::integer as priority, j.status, j.msg_id
        from thumbq.jobs j
       where j.ordering_key = k.key
         and (j.status in ('pending', 'processing', 'failed', 'unsupported')
              or (j.status = 'cancelled' and j.lease_expires_at is not null))
         and (j.status <> 'cancelled' or j.lease_expires_at > clock_timestamp())
         and not (j.id = any(coalesce(p_ended, '{}')))
       order by j.sequence
       limit 1) h
$$;

-- Lock the ordering keys of some jobs: what every transition that may move a key's head takes
-- first. A job's ordering key never changes, so reading it unlocked is safe.
create or replace function thumbq.lock_ordering_keys_of(p_job_ids bigint[])
returns text[]
language plpgsql
as $$
declare
  v_keys text[];
begin
  select array_agg(distinct j.ordering_key) into v_keys
    from thumbq.jobs j where j.id = any(p_job_ids) and j.ordering_key is not null;
  if v_keys is not null then
    perform thumbq.lock_keys(array(select 'ord:' || k from unnest(v_keys) k));
  end if;
  return v_keys;
end
$$;

-- When a job of an ordering key may run, as the delay of its message in seconds: 0 when no
-- earlier job holds the key, the rest of the lease of a cancelled run that still holds it
-- (its message is hidden until then), null while an earlier job holds it for longer (it gets
-- its message when that one is done).
create or replace function thumbq.head_delay(p_key text, p_sequence bigint)
returns integer
language sql
stable
as $$
  select case when h.job_id is null then 0
              when h.status = 'cancelled'
                then greatest(1, ceil(extract(epoch from h.lease_expires_at
                                                         - clock_timestamp())))::integer end
    from (select 1) one
    left join thumbq.held_by(p_key, p_sequence) h on true
$$;

-- Send the message of each ordering key's new head, once the jobs in p_ended no longer hold it
-- (completed, cancelled, or their cancelled run stopped). The new head is the lowest job that
-- waits, runs, failed or is unsupported, not in p_ended. A cancelled job whose run may still go
-- on (its lease kept) holds the key only until that lease ends: the head's message is hidden
-- until then, so that the key goes on by claims alone even if that run never reports (it was
-- killed). With p_wait_running, a job of p_ended still running (being cancelled) holds its key
-- in the same way (a handler stops only at its next check or at its deadline; its report ends
-- the wait sooner, end_cancelled_runs). Called with the keys locked, before the caller's
-- status change.
create or replace function thumbq.release_heads(p_keys text[], p_ended bigint[],
                                                p_wait_running boolean default false)
returns void
language plpgsql
as $$
declare
  v_heads bigint[];
  v_delays integer[];
begin
  if p_keys is null then
    return;
  end if;
  select array_agg(h.id order by h.id),
         array_agg(greatest(
           coalesce((
             select ceil(extract(epoch from max(e.lease_expires_at) - clock_timestamp()))::integer
               from thumbq.jobs e
              where p_wait_running and e.id = any(p_ended) and e.ordering_key = k.key
                and e.status = 'processing' and e.lease_expires_at > clock_timestamp()), 0),
           coalesce((
             select ceil(extract(epoch from max(c.lease_expires_at) - clock_timestamp()))::integer
               from thumbq.jobs c
              where c.ordering_key = k.key and c.sequence < h.sequence
                and c.status = 'cancelled' and c.lease_expires_at > clock_timestamp()
                and not (c.id = any(coalesce(p_ended, '{}')))), 0)) order by h.id)
    into v_heads, v_delays
    from unnest(p_keys) k(key)
    cross join lateral (
      select j.id, j.sequence, j.status, j.msg_id
        from thumbq.jobs j
       where j.ordering_key = k.key
         and j.status in ('pending', 'processing', 'failed', 'unsupported')
         and not (j.id = any(coalesce(p_ended, '{}')))
       order by j.sequence
       limit 1) h
   where h.status = 'pending' and h.msg_id is null;
  if v_heads is null then
    return;
  end if;
  perform 1 from thumbq.jobs j where j.id = any(v_heads) order by j.id for update;
  update thumbq.jobs j
     set msg_id = (select pgmq.send(thumbq.band_queue(j.priority),
                                    jsonb_build_object('job_id', j.id), d.delay_s))
    from unnest(v_heads, v_delays) as d(job_id, delay_s)
   where j.id = d.job_id and j.msg_id is null and j.status = 'pending';
end
$$;

-- Tokens the buckets that a claim may take from hold now, read without locking them: null when
-- some job could be unlimited (thumbnails without a bucket, a task without one), so that a
-- claim reads no more messages than it could be granted. retry_after_ms: when the first empty
-- bucket has a token again.
create or replace function thumbq.bucket_levels(p_bucket text)
returns table (tokens integer, retry_after_ms integer)
language sql
stable
as $$
  with b as (
    select r.name, r.refill_per_second,
           least(r.capacity, r.tokens + r.refill_per_second
                 * greatest(0, extract(epoch from clock_timestamp() - r.refilled_at))) as avail
      from thumbq.rate_limits r
     where r.name = p_bucket
        or r.name in (select t.bucket from thumbq.tasks t where t.bucket is not null)
  )
  select case when p_bucket is null
                or not exists (select 1 from b where b.name = p_bucket)
                or exists (select 1 from thumbq.tasks t
                            where t.bucket is null
                               or not exists (select 1 from b where b.name = t.bucket))
              then null
              else (select coalesce(sum(floor(b.avail)), 0)::integer from b) end,
         (select min(ceil((1 - b.avail) * 1000.0 / b.refill_per_second))::integer
            from b where b.avail < 1 and b.refill_per_second > 0)
$$;

-- Token buckets ----------------------------------------------------------------------------------

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

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.band_queue(integer),
  thumbq.lock_groups(text[]),
  thumbq.lock_keys(text[]),
  thumbq.delete_messages(integer[], bigint[]),
  thumbq.set_message_vt(integer[], bigint[], integer[]),
  thumbq.held_by(text, bigint),
  thumbq.heads_of(text[], bigint[]),
  thumbq.lock_ordering_keys_of(bigint[]),
  thumbq.head_delay(text, bigint),
  thumbq.release_heads(text[], bigint[], boolean),
  thumbq.bucket_levels(text),
  thumbq.take_tokens(text, integer, boolean),
  thumbq.refund_tokens(text, integer)
  from public, anon, authenticated;
