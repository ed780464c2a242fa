-- The engine after 0.1.0: transitions correct under concurrency, tasks (any job on the engine,
-- thumbnails being the built-in one) with priorities, ordered keys and checkpoints, and
-- retention. 001..009 shipped in 0.1.0 and are never edited: this file changes what they made.
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
-- job of a key only when it is the head (thumbq.holder_of).

-- Columns: several sizes, placeholders, degraded renders; tasks ---------------------------

alter table thumbq.jobs add column if not exists thumbnails jsonb;
alter table thumbq.jobs add column if not exists thumbhash text;
alter table thumbq.jobs add column if not exists dominant_color text;
alter table thumbq.jobs add column if not exists degraded boolean not null default false;

-- A task's job has no source object.
alter table thumbq.jobs alter column source_key drop not null;
alter table thumbq.jobs add column if not exists task text not null default 'thumbnail'
  check (length(task) between 1 and 200);
alter table thumbq.jobs add column if not exists payload jsonb;
alter table thumbq.jobs add column if not exists result jsonb;
-- What the handler checkpointed: a later invocation resumes from it.
alter table thumbq.jobs add column if not exists state jsonb;
alter table thumbq.jobs add column if not exists checkpoints integer not null default 0;
alter table thumbq.jobs add column if not exists priority smallint not null default 0
  check (priority between 0 and 9);
alter table thumbq.jobs add column if not exists ordering_key text
  check (length(ordering_key) between 1 and 200);
alter table thumbq.jobs add column if not exists sequence bigint;
alter table thumbq.jobs add column if not exists idempotency_key text
  check (length(idempotency_key) between 1 and 400);
alter table thumbq.jobs add column if not exists progress_done bigint;
alter table thumbq.jobs add column if not exists progress_total bigint;

create unique index if not exists jobs_task_idempotency_key
  on thumbq.jobs (task, idempotency_key) where idempotency_key is not null;
create unique index if not exists jobs_ordering_key_sequence
  on thumbq.jobs (ordering_key, sequence) where ordering_key is not null;
-- The oldest claimable job of each priority: what ageing reads, one index probe per priority.
-- Only a job with a message counts (one behind its ordering key has none yet), from when it
-- became due (a retry waits out its backoff first).
drop index if exists thumbq.jobs_waiting_idx;
create index if not exists jobs_ready_idx
  on thumbq.jobs (priority, (coalesce(next_attempt_at, created_at)))
  where status = 'pending' and msg_id is not null;
-- The active jobs of each ordering key, in sequence order: what finds a key's head. Finished
-- jobs stay out, so a key's history does not slow its next step.
create index if not exists jobs_ordering_active_idx on thumbq.jobs (ordering_key, sequence)
  where ordering_key is not null
    and (status in ('pending', 'processing', 'failed', 'unsupported')
         or (status = 'cancelled' and lease_expires_at is not null));
-- Jobs of an ordering key waiting behind its head (they have no message yet).
create index if not exists jobs_held_idx on thumbq.jobs (ordering_key)
  where status = 'pending' and msg_id is null;

alter table thumbq.groups add column if not exists progress_done bigint not null default 0;
alter table thumbq.groups add column if not exists progress_total bigint not null default 0;

-- What the engine knows of each task: which bucket limits it. Workers write their registered
-- tasks here at start. A task with no row (or no bucket) is not rate limited; thumbnails take
-- the bucket the caller names (THUMBQ_RATE_BUCKET, thumbnail_generation by default).
create table if not exists thumbq.tasks (
  name         text primary key check (length(name) between 1 and 200),
  bucket       text,
  max_attempts integer check (max_attempts between 1 and 100),
  runs_in      text check (runs_in in ('process', 'thread')),
  updated_at   timestamptz not null default clock_timestamp()
);
alter table thumbq.tasks enable row level security;
grant all on thumbq.tasks to service_role;
do $$
begin
  if not exists (select 1 from pg_policies where schemaname = 'thumbq' and tablename = 'tasks'
                 and policyname = 'service_role_all') then
    create policy service_role_all on thumbq.tasks to service_role using (true) with check (true);
  end if;
end
$$;

-- What service_role needs of a queue thumbq creates, as 008 grants it for the first two: the
-- rows of its table, its message id sequence, and its archive (read). Every queue thumbq makes
-- gets the same, so that every transition runs as service_role (Supabase's RPC caller).
create or replace function thumbq.grant_queue(p_queue text)
returns void
language plpgsql
as $$
begin
  if not exists (select 1 from pg_roles where rolname = 'service_role') then
    return;
  end if;
  grant usage on schema pgmq to service_role;
  if to_regclass(format('pgmq.%I', 'q_' || p_queue)) is not null then
    execute format('grant select, insert, update, delete on pgmq.%I to service_role',
                   'q_' || p_queue);
    execute format('grant usage, select on sequence %s to service_role',
                   pg_get_serial_sequence(format('pgmq.%I', 'q_' || p_queue), 'msg_id'));
  end if;
  if to_regclass(format('pgmq.%I', 'a_' || p_queue)) is not null then
    execute format('grant select on pgmq.%I to service_role', 'a_' || p_queue);
  end if;
exception when insufficient_privilege then
  raise notice 'thumbq: cannot grant service_role the queue % in schema pgmq (%); grant it as '
               'the owner of pgmq to call thumbq transitions as service_role', p_queue, sqlerrm;
end
$$;

-- One queue per priority above 0, each with the grants of the first.
do $$
declare
  p integer;
begin
  for p in 1..9 loop
    if not exists (select 1 from pgmq.list_queues() where queue_name = 'thumbq_jobs_p' || p) then
      perform pgmq.create('thumbq_jobs_p' || p);
    end if;
    perform thumbq.grant_queue('thumbq_jobs_p' || p);
  end loop;
end
$$;

create or replace function thumbq.band_queue(p_priority integer)
returns text
language sql
immutable
as $$
  select case when coalesce(p_priority, 0) <= 0 then 'thumbq_jobs'
              else 'thumbq_jobs_p' || least(p_priority, 9) end
$$;

-- Group summaries with progress -------------------------------------------------------------

do $$
begin
  if not exists (select 1 from pg_type t join pg_namespace n on n.oid = t.typnamespace
                 where n.nspname = 'thumbq' and t.typname = 'group_change') then
    create type thumbq.group_change as (group_id text, status text, d integer, done bigint,
                                        total bigint);
  end if;
end
$$;

-- Add one statement's changes to the group rows in one upsert, locking them in group_id order:
-- counts per status and the sums of the jobs' progress.
create or replace function thumbq.apply_group_changes(p_changes thumbq.group_change[])
returns void
language plpgsql
as $$
begin
  insert into thumbq.groups as g
    (group_id, total, pending, processing, completed, failed, unsupported, cancelled,
     progress_done, progress_total, version, updated_at, last_done_at, wave_started_at)
  select x.group_id,
         sum(x.d),
         coalesce(sum(x.d) filter (where x.status = 'pending'), 0),
         coalesce(sum(x.d) filter (where x.status = 'processing'), 0),
         coalesce(sum(x.d) filter (where x.status = 'completed'), 0),
         coalesce(sum(x.d) filter (where x.status = 'failed'), 0),
         coalesce(sum(x.d) filter (where x.status = 'unsupported'), 0),
         coalesce(sum(x.d) filter (where x.status = 'cancelled'), 0),
         coalesce(sum(x.done), 0),
         coalesce(sum(x.total), 0),
         1,
         clock_timestamp(),
         case when bool_or(x.d > 0 and x.status in ('completed', 'failed', 'unsupported',
                                                      'cancelled'))
              then clock_timestamp() end,
         case when bool_or(x.d > 0 and x.status = 'processing') then clock_timestamp() end
    from unnest(p_changes) x
   group by x.group_id
  having bool_or(x.d <> 0)
   order by x.group_id
  on conflict (group_id) do update set
    total       = g.total + excluded.total,
    pending     = g.pending + excluded.pending,
    processing  = g.processing + excluded.processing,
    completed   = g.completed + excluded.completed,
    failed      = g.failed + excluded.failed,
    unsupported = g.unsupported + excluded.unsupported,
    cancelled   = g.cancelled + excluded.cancelled,
    progress_done  = g.progress_done + excluded.progress_done,
    progress_total = g.progress_total + excluded.progress_total,
    version     = g.version + 1,
    updated_at  = excluded.updated_at,
    last_done_at = coalesce(excluded.last_done_at, g.last_done_at),
    -- A wave starts at the first claim while none is running and ends when nothing is left.
    wave_started_at = case
      when g.pending + excluded.pending + g.processing + excluded.processing = 0 then null
      when g.wave_started_at is null then excluded.wave_started_at
      else g.wave_started_at end,
    wave_done_base = case
      when g.wave_started_at is null and excluded.wave_started_at is not null
        then g.completed + g.failed + g.unsupported + g.cancelled
      else g.wave_done_base end;
end
$$;

create or replace function thumbq.jobs_after_insert() returns trigger
language plpgsql as $$
declare
  v thumbq.group_change[];
begin
  select array_agg(row(n.group_id, n.status, 1, coalesce(n.progress_done, 0),
                       coalesce(n.progress_total, 0))::thumbq.group_change) into v
    from new_rows n;
  if v is not null then
    perform thumbq.apply_group_changes(v);
  end if;
  return null;
end
$$;

create or replace function thumbq.jobs_after_update() returns trigger
language plpgsql as $$
declare
  v thumbq.group_change[];
begin
  select array_agg(c.change) into v
    from old_rows o
    join new_rows n on n.id = o.id
   cross join lateral (values
     (row(o.group_id, o.status, -1, -coalesce(o.progress_done, 0),
          -coalesce(o.progress_total, 0))::thumbq.group_change),
     (row(n.group_id, n.status, 1, coalesce(n.progress_done, 0),
          coalesce(n.progress_total, 0))::thumbq.group_change)) c(change)
   where o.status is distinct from n.status or o.group_id is distinct from n.group_id
      or o.progress_done is distinct from n.progress_done
      or o.progress_total is distinct from n.progress_total;
  -- Most updates that change neither status nor progress (msg_id, dlq_msg_id, an UPDATE
  -- matching nothing) stop here.
  if v is not null then
    perform thumbq.apply_group_changes(v);
  end if;
  return null;
end
$$;

-- Deleting old jobs for retention keeps the groups' summaries: a group still says how many
-- files it had and how they ended. The flag is local to the pruning transaction.
create or replace function thumbq.jobs_after_delete() returns trigger
language plpgsql as $$
declare
  v thumbq.group_change[];
begin
  if current_setting('thumbq.retention', true) = 'on' then
    return null;
  end if;
  select array_agg(row(o.group_id, o.status, -1, -coalesce(o.progress_done, 0),
                       -coalesce(o.progress_total, 0))::thumbq.group_change) into v
    from old_rows o;
  if v is not null then
    perform thumbq.apply_group_changes(v);
  end if;
  return null;
end
$$;

-- Progress of one group, with its jobs' summed progress. A new name, since 003's progress(text)
-- keeps its columns: re-applying 003 (db init does, after a change) must not fail, and code of
-- the previous release keeps working during a deploy.
create or replace function thumbq.progress_v2(p_group_id text)
returns table (group_id text, total integer, pending integer, processing integer,
               completed integer, failed integer, unsupported integer, cancelled integer,
               progress_percentage numeric, estimated_time_remaining_seconds integer,
               rate_per_second double precision, version bigint, updated_at timestamptz,
               progress_done bigint, progress_total bigint)
language sql
stable
as $$
  select g.group_id, g.total, g.pending, g.processing, g.completed, g.failed, g.unsupported,
         g.cancelled,
         case when g.total = 0 then 0
              else round(100.0 * (g.total - g.pending - g.processing) / g.total, 1) end,
         case when g.pending + g.processing = 0 then 0
              -- Nothing runs and nothing has finished for a minute (a stopped worker, a
              -- schedule's gap): the last rate says nothing of when the rest will be done.
              when g.processing = 0
                   and g.last_done_at < clock_timestamp() - interval '60 seconds' then null
              when r.rate > 0 then ceil((g.pending + g.processing) / r.rate)::integer end,
         r.rate,
         g.version, g.updated_at, g.progress_done, g.progress_total
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
grant execute on function thumbq.progress_v2(text) to authenticated;

-- A user's progress read in one statement, through RLS (as 009's, with progress_v2).
create or replace function thumbq.progress_as_user_v2(p_claims text, p_group_id text)
returns table (group_id text, total integer, pending integer, processing integer,
               completed integer, failed integer, unsupported integer, cancelled integer,
               progress_percentage numeric, estimated_time_remaining_seconds integer,
               rate_per_second double precision, version bigint, updated_at timestamptz,
               progress_done bigint, progress_total bigint)
language plpgsql
volatile
security invoker
set search_path = pg_catalog, pg_temp
as $$
begin
  perform set_config('role', 'authenticated', true),
          set_config('request.jwt.claims', p_claims, true);
  return query select * from thumbq.progress_v2(p_group_id);
end;
$$;
revoke execute on function thumbq.progress_as_user_v2(text, text)
  from public, anon, authenticated;

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
drop function if exists thumbq.lock_source_keys(text[]);

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

-- Enqueue ------------------------------------------------------------------------------------

-- The items of an enqueue call as rows; the last one wins when a key appears twice. An item
-- may carry a priority (0-9).
create or replace function thumbq.enqueue_items_v2(p_items jsonb, p_group_id text)
returns table (ord bigint, source_key text, source_etag text, content_type text,
               group_id text, source_bytes bigint, priority integer)
language sql
immutable
as $$
  select distinct on (i.value->>'source_key')
         i.ord, i.value->>'source_key', coalesce(i.value->>'etag', ''),
         nullif(i.value->>'content_type', ''),
         coalesce(nullif(i.value->>'group_id', ''), p_group_id),
         (i.value->>'bytes')::bigint,
         coalesce((i.value->>'priority')::integer, 0)
    from jsonb_array_elements(p_items) with ordinality as i(value, ord)
   order by i.value->>'source_key', i.ord desc
$$;

-- The stages of an enqueue (enqueue_batch, enqueue_jobs, or both at once: enqueue_mixed), so
-- that a transition spanning both kinds keeps the one lock order: every key lock, then every
-- job row, then every message, then every group row, then every status change.

-- File versions: lock the rows of older versions still waiting or running and of cancelled
-- versions asked for again (their keys are locked: lock_keys('src:' || key)), and make their
-- message changes: superseded ones' messages go, a version queued again or anew gets one.
-- A version cancelled while it ran is not visible before that run's lease ends (the cancelled
-- run may still be rendering it, and a file is never rendered twice at the same time): its
-- message is delayed, and next_attempt_at says until when. Returns the plan for
-- enqueue_files_write.
create or replace function thumbq.enqueue_files_stage(p_items jsonb, p_group_id text)
returns jsonb
language plpgsql
as $$
declare
  v_sup_ids bigint[];
  v_sup_msgs bigint[];
  v_sup_prio integer[];
  v_sup_groups text[];
  v_req_ids bigint[];
  v_req_groups text[];
  v_req_delays integer[];
  v_req_prio integer[];
  v_req jsonb;
  v_fresh jsonb;
begin
  with l as (
    select j.id, j.msg_id, j.priority::integer as prio, j.group_id,
           i.group_id as new_group, j.source_etag = i.source_etag as requeue,
           coalesce(greatest(0, ceil(extract(epoch from
             j.lease_expires_at - clock_timestamp())))::integer, 0) as delay_s
      from thumbq.jobs j
      join thumbq.enqueue_items_v2(p_items, p_group_id) i on j.source_key = i.source_key
     where (j.source_etag <> i.source_etag and j.status in ('pending', 'processing'))
        or (j.source_etag = i.source_etag and j.status = 'cancelled')
     order by j.id
       for update of j
  )
  select array_agg(l.id) filter (where not l.requeue),
         array_agg(l.msg_id) filter (where not l.requeue),
         array_agg(l.prio) filter (where not l.requeue),
         array_agg(l.group_id) filter (where not l.requeue),
         array_agg(l.id) filter (where l.requeue),
         array_agg(l.group_id) filter (where l.requeue)
           || array_agg(l.new_group) filter (where l.requeue),
         array_agg(l.delay_s) filter (where l.requeue),
         array_agg(l.prio) filter (where l.requeue)
    into v_sup_ids, v_sup_msgs, v_sup_prio, v_sup_groups,
         v_req_ids, v_req_groups, v_req_delays, v_req_prio
    from l;

  -- Versions never seen: ids drawn now, so that each message names its job. No concurrent
  -- enqueue can insert the same version meanwhile: its key is locked.
  select coalesce(jsonb_agg(jsonb_build_object(
           'id', nextval(pg_get_serial_sequence('thumbq.jobs', 'id')),
           'ord', i.ord, 'source_key', i.source_key, 'source_etag', i.source_etag,
           'content_type', i.content_type, 'group_id', i.group_id,
           'source_bytes', i.source_bytes, 'priority', i.priority)), '[]'::jsonb)
    into v_fresh
    from thumbq.enqueue_items_v2(p_items, p_group_id) i
   where not exists (select 1 from thumbq.jobs j
                      where j.source_key = i.source_key and j.source_etag = i.source_etag);

  if v_sup_ids is not null then
    perform thumbq.delete_messages(v_sup_prio, v_sup_msgs);
  end if;
  if v_req_ids is not null then
    select jsonb_agg(jsonb_build_object(
             'id', r.id, 'delay_s', r.delay_s,
             'msg_id', (select pgmq.send(thumbq.band_queue(r.p),
                                         jsonb_build_object('job_id', r.id), r.delay_s)))
                     order by r.ord)
      into v_req
      from unnest(v_req_ids, v_req_delays, v_req_prio) with ordinality as r(id, delay_s, p, ord);
  end if;
  select coalesce(jsonb_agg(f || jsonb_build_object('msg_id',
                    (select pgmq.send(thumbq.band_queue((f->>'priority')::integer),
                                      jsonb_build_object('job_id', f->'id'))))),
                  '[]'::jsonb)
    into v_fresh
    from jsonb_array_elements(v_fresh) f;

  return jsonb_build_object(
    'sup_ids', coalesce(to_jsonb(v_sup_ids), '[]'), 'requeue', coalesce(v_req, '[]'),
    'fresh', v_fresh,
    'groups', to_jsonb(coalesce(v_sup_groups, '{}') || coalesce(v_req_groups, '{}')
                       || array(select f->>'group_id' from jsonb_array_elements(v_fresh) f)));
end
$$;

-- File versions: the status changes and new rows of a staged enqueue (its group rows locked).
-- Returns one row per distinct source key as JSON.
create or replace function thumbq.enqueue_files_write(p_stage jsonb, p_items jsonb,
                                                      p_group_id text, p_max_attempts integer)
returns jsonb
language plpgsql
as $$
declare
  v_sup_ids bigint[] := array(select jsonb_array_elements_text(p_stage->'sup_ids')::bigint);
  v_out jsonb;
begin
  if cardinality(v_sup_ids) > 0 then
    update thumbq.jobs j
       set status = 'cancelled', error_code = 'superseded',
           last_error = 'a newer version of the object (etag ' || i.source_etag
                        || ') was enqueued',
           completed_at = clock_timestamp(), updated_at = clock_timestamp(),
           msg_id = null
      from thumbq.enqueue_items_v2(p_items, p_group_id) i
     where j.id = any(v_sup_ids) and j.source_key = i.source_key;
  end if;

  update thumbq.jobs j
     set status = 'pending', attempts = 0, error_code = null, last_error = null,
         completed_at = null, started_at = null,
         next_attempt_at = case when m.delay_s > 0
                                then clock_timestamp() + make_interval(secs => m.delay_s) end,
         -- lease_expires_at stays: a cancelled run may render until then, and a second
         -- cancel and enqueue must wait for it too.
         worker_id = null, group_id = i.group_id,
         max_attempts = p_max_attempts, msg_id = m.msg_id,
         updated_at = clock_timestamp()
    from jsonb_to_recordset(p_stage->'requeue') as m(id bigint, msg_id bigint, delay_s integer),
         thumbq.enqueue_items_v2(p_items, p_group_id) i
   where j.id = m.id and j.source_key = i.source_key
     and j.source_etag = i.source_etag;

  with ins as (
    insert into thumbq.jobs as j (id, group_id, source_key, source_etag, source_bytes,
                                  content_type, max_attempts, msg_id, priority)
    select (f->>'id')::bigint, f->>'group_id', f->>'source_key', f->>'source_etag',
           (f->>'source_bytes')::bigint, f->>'content_type', p_max_attempts,
           (f->>'msg_id')::bigint, (f->>'priority')::smallint
      from jsonb_array_elements(p_stage->'fresh') f
     order by (f->>'ord')::bigint
    -- Only a writer that skips the key locks (an older thumbq during a deploy) can win
    -- this race; its message then names no job and claim deletes it.
    on conflict on constraint jobs_source_version_key do nothing
    returning j.id, j.source_key, j.source_etag, j.status
  ), rows as (
    select ins.id, ins.source_key, ins.source_etag, true as created, ins.status from ins
    union all
    select j.id, j.source_key, j.source_etag, false, j.status
      from thumbq.enqueue_items_v2(p_items, p_group_id) i
      join thumbq.jobs j on j.source_key = i.source_key and j.source_etag = i.source_etag
     where not exists (select 1 from ins where ins.source_key = i.source_key)
  )
  select coalesce(jsonb_agg(to_jsonb(rows)), '[]'::jsonb) into v_out from rows;
  return v_out;
end
$$;

-- Why a file items array is refused, or null.
create or replace function thumbq.enqueue_files_problem(p_items jsonb)
returns text
language sql
immutable
as $$
  select case
    when jsonb_typeof(p_items) is distinct from 'array' then 'p_items must be a JSON array'
    when exists (select 1 from jsonb_array_elements(p_items) e
                  where jsonb_typeof(e) <> 'object' or coalesce(e->>'source_key', '') = ''
                     or coalesce(e->>'priority', '0') !~ '^[0-9]$')
      then 'every item needs a source_key (and a priority 0-9)'
  end
$$;

-- Enqueue many objects for thumbnails: p_items is a JSON array of
-- {"source_key", "etag"?, "content_type"?, "group_id"?, "bytes"?, "priority"?}. One row per
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
set jit = off
as $$
#variable_conflict use_column
declare
  v_problem text := thumbq.enqueue_files_problem(p_items);
  v_stage jsonb;
  v_out jsonb;
  v_attempt integer := 0;
begin
  if v_problem is not null then
    raise exception 'thumbq.enqueue_batch: %', v_problem using errcode = '22023';
  end if;
  loop
    begin
      perform thumbq.lock_keys(array(select 'src:' || i.source_key
                                       from thumbq.enqueue_items_v2(p_items, p_group_id) i));
      v_stage := thumbq.enqueue_files_stage(p_items, p_group_id);
      perform thumbq.lock_groups(array(select jsonb_array_elements_text(v_stage->'groups')));
      v_out := thumbq.enqueue_files_write(v_stage, p_items, p_group_id, p_max_attempts);
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

-- The sequence of each item of an enqueue_jobs call that has an ordering key but no sequence:
-- after the key's last job, and after every earlier item of the call (given or assigned).
create or replace function thumbq.assign_sequences(p_items jsonb)
returns table (ord bigint, sequence bigint)
language plpgsql
stable
as $$
declare
  v_last jsonb := '{}';
  v_key text;
  v_seq bigint;
  r record;
begin
  for r in select x.ord, x.value->>'ordering_key' as okey, (x.value->>'sequence')::bigint as seq
             from jsonb_array_elements(p_items) with ordinality as x(value, ord)
            where coalesce(x.value->>'ordering_key', '') <> ''
            order by x.ord loop
    v_key := r.okey;
    if not v_last ? v_key then
      v_last := v_last || jsonb_build_object(v_key, coalesce(
        (select max(j.sequence) from thumbq.jobs j where j.ordering_key = v_key), 0));
    end if;
    v_seq := coalesce(r.seq, (v_last->>v_key)::bigint + 1);
    v_last := v_last || jsonb_build_object(v_key, greatest(v_seq, (v_last->>v_key)::bigint));
    if r.seq is null then
      ord := r.ord;
      sequence := v_seq;
      return next;
    end if;
  end loop;
end
$$;

-- Why a task items array is refused (each item's problem), or null.
create or replace function thumbq.enqueue_jobs_problem(p_items jsonb)
returns text
language sql
immutable
as $$
  select case when jsonb_typeof(p_items) is distinct from 'array' then 'p_items must be a JSON array'
  else (
  select string_agg(format('item %s %s', e.ord - 1, e.problem), '; ')
    from (select i.ord, case
                 when jsonb_typeof(i.value) <> 'object' then 'is not an object'
                 when coalesce(i.value->>'task', '') = '' then 'needs a task'
                 when coalesce(i.value->>'priority', '0') !~ '^[0-9]$'
                   then 'has a priority that is not 0-9'
                 when coalesce(i.value->>'sequence', '0') !~ '^-?[0-9]{1,18}$'
                   then 'has a sequence that is not an integer'
                 when i.value ? 'sequence' and coalesce(i.value->>'ordering_key', '') = ''
                   then 'has a sequence without an ordering_key'
                 when coalesce(i.value->>'max_attempts', '1') !~ '^[0-9]{1,3}$'
                      or coalesce((i.value->>'max_attempts')::integer, 1) not between 1 and 100
                   then 'has max_attempts outside 1-100'
                 end as problem
            from jsonb_array_elements(p_items) with ordinality as i(value, ord)) e
   where e.problem is not null) end
$$;

-- The advisory keys of a task items array: idempotency keys per task, ordering keys.
create or replace function thumbq.enqueue_jobs_keys(p_items jsonb)
returns text[]
language sql
immutable
as $$
  select array(
    select k from jsonb_array_elements(p_items) i,
           lateral (values ('idem:' || (i->>'task') || ':' || (i->>'idempotency_key')),
                           ('ord:' || (i->>'ordering_key'))) v(k)
     where k is not null)
$$;

-- The active job rows of the ordering keys of a task items array, locked in id order: a claim
-- of a key's head either committed before (the checks then see it started) or finds the row
-- locked and leaves it (claim skips locked rows), so no lower sequence slips in beside a head
-- that is starting. The keys are locked (lock_keys('ord:' || key)).
create or replace function thumbq.lock_key_rows(p_keys text[])
returns void
language sql
as $$
  select count(*)::integer * 0
    from (select j.id from thumbq.jobs j
           where j.ordering_key = any(p_keys)
             and (j.status in ('pending', 'processing', 'failed', 'unsupported')
                  or (j.status = 'cancelled' and j.lease_expires_at is not null))
           order by j.id
             for update) s
$$;

-- Tasks: work out every item (its sequence, the earlier item it repeats, the existing job it
-- names), refuse a sequence behind one that has started, withdraw the message of a waiting head
-- that a new lower sequence replaces, and send the messages of the new jobs that are heads (or
-- have no ordering key). The keys and the keys' active rows are locked. Returns the plan for
-- enqueue_jobs_write.
create or replace function thumbq.enqueue_jobs_stage(p_items jsonb, p_group_id text,
                                                     p_max_attempts integer)
returns jsonb
language plpgsql
as $$
declare
  v_items jsonb;
  v_fresh jsonb;
  v_problem text;
  v_demote_ids bigint[];
  v_demote_msgs bigint[];
  v_demote_prio integer[];
begin
  with i as (
    select x.ord, x.value as item, x.value->>'task' as task,
           coalesce(nullif(x.value->>'group_id', ''), p_group_id) as group_id,
           coalesce((x.value->>'priority')::integer, 0) as priority,
           nullif(x.value->>'ordering_key', '') as okey,
           (x.value->>'sequence')::bigint as seq,
           nullif(x.value->>'idempotency_key', '') as idem,
           coalesce((x.value->>'max_attempts')::integer,
                    (select t.max_attempts from thumbq.tasks t
                      where t.name = x.value->>'task'),
                    p_max_attempts) as max_attempts
      from jsonb_array_elements(p_items) with ordinality as x(value, ord)
  ), s as (
    select i.*, coalesce(i.seq, a.sequence) as sequence
      from i left join thumbq.assign_sequences(p_items) a on a.ord = i.ord
  ), f as (
    select s.*,
           case when s.idem is not null
                then min(s.ord) over (partition by s.task, s.idem) else s.ord end
             as first_idem
      from s
  ), d as (
    select f.*,
           case when f.okey is not null
                then min(f.first_idem) over (partition by f.okey, f.sequence)
                else f.first_idem end as first
      from f
  )
  select jsonb_agg(jsonb_build_object(
           'ord', d.ord, 'first', d.first, 'task', d.task, 'group_id', d.group_id,
           'priority', d.priority, 'ordering_key', d.okey, 'sequence', d.sequence,
           'idempotency_key', d.idem, 'max_attempts', d.max_attempts,
           'payload', d.item->'payload',
           'existing', coalesce(
             (select j.id from thumbq.jobs j
               where d.idem is not null and j.task = d.task and j.idempotency_key = d.idem),
             (select j.id from thumbq.jobs j
               where d.okey is not null and j.ordering_key = d.okey
                 and j.sequence = d.sequence))) order by d.ord)
    into v_items
    from d;

  -- New jobs: the first item of each, not naming an existing job.
  select coalesce(jsonb_agg(x || jsonb_build_object(
           'id', nextval(pg_get_serial_sequence('thumbq.jobs', 'id')))), '[]'::jsonb)
    into v_fresh
    from jsonb_array_elements(coalesce(v_items, '[]')) x
   where x->'existing' = 'null'::jsonb and (x->>'first')::bigint = (x->>'ord')::bigint;

  -- A new job behind one of its key that has already started would run out of order.
  select string_agg(format('ordering key %L: sequence %s is behind sequence %s, which has '
                           'already started', f->>'ordering_key', f->>'sequence',
                           j.sequence), '; ')
    into v_problem
    from jsonb_array_elements(v_fresh) f
    cross join lateral (select j.sequence from thumbq.jobs j
                         where j.ordering_key = f->>'ordering_key'
                           and j.sequence > (f->>'sequence')::bigint
                           and j.started_at is not null
                         order by j.sequence desc
                         limit 1) j
   where f->>'ordering_key' is not null;
  if v_problem is not null then
    raise exception 'sequence_conflict: %', v_problem using errcode = '23P01';
  end if;

  -- A new job that goes before a waiting head takes its place: the old head's message is
  -- withdrawn (it has not started, or that would be a conflict; its row is locked).
  select array_agg(j.id order by j.id), array_agg(j.msg_id order by j.id),
         array_agg(j.priority::integer order by j.id)
    into v_demote_ids, v_demote_msgs, v_demote_prio
    from thumbq.jobs j
   where j.status = 'pending' and j.msg_id is not null
     and j.ordering_key in (select f->>'ordering_key' from jsonb_array_elements(v_fresh) f)
     and exists (select 1 from jsonb_array_elements(v_fresh) f
                  where f->>'ordering_key' = j.ordering_key
                    and (f->>'sequence')::bigint < j.sequence);
  if v_demote_ids is not null then
    perform thumbq.delete_messages(v_demote_prio, v_demote_msgs);
  end if;

  -- Messages for the new jobs that are heads (or have no ordering key); one behind a cancelled
  -- run that still holds its key is hidden until that run's lease ends.
  select coalesce(jsonb_agg(h.f || jsonb_build_object('msg_id', case when h.delay_s is not null
                    then (select pgmq.send(thumbq.band_queue((h.f->>'priority')::integer),
                                           jsonb_build_object('job_id', h.f->'id'), h.delay_s))
                    end)),
                  '[]'::jsonb)
    into v_fresh
    from (select f as f,
                 case when f->>'ordering_key' is null then 0
                      when exists (
                        select 1 from jsonb_array_elements(v_fresh) o
                         where o->>'ordering_key' = f->>'ordering_key'
                           and (o->>'sequence')::bigint < (f->>'sequence')::bigint) then null
                      else thumbq.head_delay(f->>'ordering_key', (f->>'sequence')::bigint)
                 end as delay_s
            from jsonb_array_elements(v_fresh) f) h;

  return jsonb_build_object('items', coalesce(v_items, '[]'), 'fresh', v_fresh,
                            'demoted', coalesce(to_jsonb(v_demote_ids), '[]'),
                            'groups', coalesce((select jsonb_agg(f->'group_id')
                                                  from jsonb_array_elements(v_fresh) f), '[]'));
end
$$;

-- Tasks: the new rows of a staged enqueue (its group rows locked). Returns one row per item,
-- in order, as JSON.
create or replace function thumbq.enqueue_jobs_write(p_stage jsonb)
returns jsonb
language plpgsql
as $$
declare
  v_out jsonb;
begin
  update thumbq.jobs set msg_id = null
   where id = any(array(select jsonb_array_elements_text(p_stage->'demoted')::bigint));
  with ins as (
    insert into thumbq.jobs as j (id, group_id, task, payload, priority, ordering_key,
                                  sequence, idempotency_key, max_attempts, msg_id)
    select (f->>'id')::bigint, f->>'group_id', f->>'task', f->'payload',
           (f->>'priority')::smallint, f->>'ordering_key', (f->>'sequence')::bigint,
           f->>'idempotency_key', (f->>'max_attempts')::integer, (f->>'msg_id')::bigint
      from jsonb_array_elements(p_stage->'fresh') f
     order by (f->>'ord')::bigint
    returning j.id, j.task, j.status, j.ordering_key, j.sequence
  ), made as (
    select (f->>'ord')::bigint as ord, ins.*
      from ins join jsonb_array_elements(p_stage->'fresh') f on (f->>'id')::bigint = ins.id
  )
  select coalesce(jsonb_agg(r order by r.ord), '[]'::jsonb) into v_out
    from (
      -- New jobs, and items repeating an earlier item of the call.
      select (x->>'ord')::bigint as ord, m.id as job_id, m.task,
             (x->>'ord') = (x->>'first') as created, m.status, m.ordering_key, m.sequence
        from jsonb_array_elements(p_stage->'items') x
        join made m on m.ord = (x->>'first')::bigint
       where x->'existing' = 'null'::jsonb
      union all
      select (x->>'ord')::bigint, j.id, j.task, false, j.status, j.ordering_key,
             j.sequence
        from jsonb_array_elements(p_stage->'items') x
        join thumbq.jobs j on j.id = (x->>'existing')::bigint
    ) r;
  return v_out;
end
$$;

-- Enqueue jobs of any task: p_items is a JSON array of {"task", "payload"?, "group_id"?,
-- "priority"? (0-9), "ordering_key"?, "sequence"?, "idempotency_key"?, "max_attempts"?}.
-- An item whose idempotency key (per task), or ordering key and sequence, names an existing
-- job (or an earlier item of the same call) returns that job instead (created false). Within
-- an ordering key, a job without a sequence goes after the last one; jobs run strictly in
-- sequence order, one at a time: only the head (see the header) has a message. A sequence
-- below one that has already started is refused (SQLSTATE 23P01, the message starting with
-- "sequence_conflict:").
create or replace function thumbq.enqueue_jobs(p_items jsonb,
                                               p_group_id text default 'default',
                                               p_max_attempts integer default 3)
returns table (job_id bigint, task text, created boolean, status text, ordering_key text,
               sequence bigint)
language plpgsql
set jit = off
as $$
#variable_conflict use_column
declare
  v_problem text := thumbq.enqueue_jobs_problem(p_items);
  v_stage jsonb;
  v_out jsonb;
  v_attempt integer := 0;
begin
  if v_problem is not null then
    raise exception 'thumbq.enqueue_jobs: %', v_problem using errcode = '22023';
  end if;
  loop
    begin
      perform thumbq.lock_keys(thumbq.enqueue_jobs_keys(p_items));
      perform thumbq.lock_key_rows(array(
        select distinct i->>'ordering_key' from jsonb_array_elements(p_items) i
         where coalesce(i->>'ordering_key', '') <> ''));
      v_stage := thumbq.enqueue_jobs_stage(p_items, p_group_id, p_max_attempts);
      perform thumbq.lock_groups(array(select jsonb_array_elements_text(v_stage->'groups')));
      v_out := thumbq.enqueue_jobs_write(v_stage);
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
  select r.job_id, r.task, r.created, r.status, r.ordering_key, r.sequence
    from jsonb_to_recordset(v_out)
      as r(job_id bigint, task text, created boolean, status text, ordering_key text,
           sequence bigint);
end
$$;

-- Both kinds in one transition (`POST /api/jobs` with thumbnail and task items): files as
-- enqueue_batch does, tasks as enqueue_jobs does, with every lock of both taken in the one
-- order (keys, rows, messages, groups), so that two such calls with crossed groups cannot
-- deadlock. Returns {"files": [enqueue_batch's rows], "jobs": [enqueue_jobs' rows]}.
create or replace function thumbq.enqueue_mixed(p_files jsonb, p_jobs jsonb,
                                                p_group_id text default 'default',
                                                p_max_attempts integer default 3)
returns jsonb
language plpgsql
set jit = off
as $$
declare
  v_problem text;
  v_okeys text[];
  v_files jsonb;
  v_jobs jsonb;
  v_out jsonb;
  v_attempt integer := 0;
begin
  v_problem := thumbq.enqueue_files_problem(p_files);
  if v_problem is not null then
    raise exception 'thumbq.enqueue_mixed: files: %', v_problem using errcode = '22023';
  end if;
  v_problem := thumbq.enqueue_jobs_problem(p_jobs);
  if v_problem is not null then
    raise exception 'thumbq.enqueue_mixed: jobs: %', v_problem using errcode = '22023';
  end if;
  v_okeys := array(select distinct i->>'ordering_key' from jsonb_array_elements(p_jobs) i
                    where coalesce(i->>'ordering_key', '') <> '');
  loop
    begin
      perform thumbq.lock_keys(array(select 'src:' || i.source_key
                                       from thumbq.enqueue_items_v2(p_files, p_group_id) i)
                               || thumbq.enqueue_jobs_keys(p_jobs));
      -- Every job row either stage changes, in one pass.
      perform 1 from thumbq.jobs j
       where j.id in (select o.id from thumbq.jobs o
                        join thumbq.enqueue_items_v2(p_files, p_group_id) i
                          on o.source_key = i.source_key
                       where (o.source_etag <> i.source_etag
                              and o.status in ('pending', 'processing'))
                          or (o.source_etag = i.source_etag and o.status = 'cancelled')
                      union all
                      select o.id from thumbq.jobs o
                       where o.ordering_key = any(v_okeys)
                         and (o.status in ('pending', 'processing', 'failed', 'unsupported')
                              or (o.status = 'cancelled' and o.lease_expires_at is not null)))
       order by j.id
         for update;
      v_files := thumbq.enqueue_files_stage(p_files, p_group_id);
      v_jobs := thumbq.enqueue_jobs_stage(p_jobs, p_group_id, p_max_attempts);
      perform thumbq.lock_groups(array(select jsonb_array_elements_text(v_files->'groups'))
                                 || array(select jsonb_array_elements_text(v_jobs->'groups')));
      v_out := jsonb_build_object(
        'files', thumbq.enqueue_files_write(v_files, p_files, p_group_id, p_max_attempts),
        'jobs', thumbq.enqueue_jobs_write(v_jobs));
      exit;
    exception when deadlock_detected or serialization_failure then
      v_attempt := v_attempt + 1;
      if v_attempt >= 5 then
        raise;
      end if;
      perform pg_sleep(0.005 * v_attempt * (1 + random()));
    end;
  end loop;
  return v_out;
end
$$;

-- Claim --------------------------------------------------------------------------------------

drop function if exists thumbq.claim(text, integer, integer, text);
drop function if exists thumbq.claim(text, integer, integer, text, boolean);

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
drop function if exists thumbq.claim(text, integer, integer, text, boolean, integer);
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
drop function if exists thumbq.claim_job(text, bigint, integer, text, boolean);
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

-- Complete, checkpoint, fail, release --------------------------------------------------------

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
-- (completed, cancelled, or their cancelled run stopped). With p_wait_running, a job of p_ended
-- still running (being cancelled) keeps holding its key until its lease ends: the new head's
-- message is hidden until then (a handler stops only at its next check or at its deadline;
-- its report ends the wait sooner, wake_heads). Called with the keys locked, before the
-- caller's status change.
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
  select array_agg(h.job_id order by h.job_id),
         array_agg(coalesce((
           select greatest(0, ceil(extract(epoch from max(e.lease_expires_at)
                                                     - clock_timestamp())))::integer
             from thumbq.jobs e
            where p_wait_running and e.id = any(p_ended) and e.ordering_key = h.ordering_key
              and e.status = 'processing' and e.lease_expires_at > clock_timestamp()), 0)
           order by h.job_id)
    into v_heads, v_delays
    from thumbq.heads_of(p_keys, p_ended) h
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

-- Reset jobs whose lease expired (their invocation was killed) so that status shows the
-- truth, at most p_limit per call; their messages become visible at once. The lost attempt
-- still counts. Rows another transition holds are left for the next call.
drop function if exists thumbq.reap_stale();
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
-- Group rows stay, and so does a failed or unsupported job that holds its ordering key. Returns what it deleted; call again until everything is 0.
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

-- Alerts and the end of a run, at a cost that does not grow with history ------------------

-- pgmq's metrics through a plpgsql function, whose body is resolved at call time: a view that
-- called pgmq.metrics directly would stop `alter extension pgmq update` (1.4.4 -> 1.5) from
-- re-creating it (011's queue_overview reads it the same way).
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

-- One row per condition that needs a person, with its figure and threshold. Every figure comes
-- from the queues (their length is the backlog, not the history) or from the last hour of
-- runs: reading this view costs the same with a million finished jobs as with none.
create or replace view thumbq.alerts as
with q as (
  select m.queue_length, m.oldest_msg_age_sec from thumbq.work_metrics() m
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

-- Privileges (see 008): PUBLIC gets EXECUTE on every new function; take it back.
revoke execute on all functions in schema thumbq from public;
revoke execute on all functions in schema thumbq from anon, authenticated;
grant execute on function thumbq.progress(text), thumbq.progress_v2(text),
  thumbq.request_user_id() to authenticated;
