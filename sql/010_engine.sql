-- The tables, columns, indexes, queues and types added after 0.1.0 (DDL and data only; the
-- functions, triggers and views that use them live in sql/functions/, docs/migrations.md):
-- tasks (any job on the engine, thumbnails being the built-in one) with priorities, ordered
-- keys, checkpoints and progress; the storage sources that enqueue uploads; the events outbox
-- of webhooks; the schedule switch. 001..009 shipped in 0.1.0 and are never edited.

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

-- One queue per priority above 0, each with what service_role needs of it, as 008 grants it for
-- the first two: the rows of its table, its message id sequence, and its archive (read), so that
-- every transition runs as service_role (Supabase's RPC caller).
do $$
declare
  p integer;
  q text;
begin
  for p in 1..9 loop
    q := 'thumbq_jobs_p' || p;
    if not exists (select 1 from pgmq.list_queues() where queue_name = q) then
      perform pgmq.create(q);
    end if;
    if exists (select 1 from pg_roles where rolname = 'service_role') then
      begin
        grant usage on schema pgmq to service_role;
        if to_regclass(format('pgmq.%I', 'q_' || q)) is not null then
          execute format('grant select, insert, update, delete on pgmq.%I to service_role',
                         'q_' || q);
          execute format('grant usage, select on sequence %s to service_role',
                         pg_get_serial_sequence(format('pgmq.%I', 'q_' || q), 'msg_id'));
        end if;
        if to_regclass(format('pgmq.%I', 'a_' || q)) is not null then
          execute format('grant select on pgmq.%I to service_role', 'a_' || q);
        end if;
      exception when insufficient_privilege then
        raise notice 'thumbq: cannot grant service_role the queue % in schema pgmq (%); grant '
                     'it as the owner of pgmq to call thumbq transitions as service_role',
                     q, sqlerrm;
      end;
    end if;
  end loop;
end
$$;

-- Group summaries with progress: one statement's changes, as apply_group_changes takes them ----

do $$
begin
  if not exists (select 1 from pg_type t join pg_namespace n on n.oid = t.typnamespace
                 where n.nspname = 'thumbq' and t.typname = 'group_change') then
    create type thumbq.group_change as (group_id text, status text, d integer, done bigint,
                                        total bigint);
  end if;
end
$$;

-- Supabase Storage, operations, the operator page, the schedule -------------------------------

-- Before 0.1.0, this index was added to 001_schema.sql after that file had shipped, so a
-- Supabase project that pushed the earlier 001 never received it (`supabase db push` applies a
-- version once). Released files are frozen since; this is where it reaches those projects.
create index if not exists jobs_group_errors_idx on thumbq.jobs (group_id, updated_at desc)
  where error_code is not null;

-- The buckets and prefixes whose new uploads enqueue themselves (thumbq.watch_storage,
-- sql/functions/75_storage_trigger.sql).
create table if not exists thumbq.storage_sources (
  bucket_id text not null,
  prefix text not null default '',
  key_prefix text not null default '',
  group_id text not null default 'uploads',
  max_attempts integer not null default 3 check (max_attempts between 1 and 100),
  created_at timestamptz not null default now(),
  primary key (bucket_id, prefix),
  -- The source_key is the name less key_prefix, so every watched name must start with it.
  check (starts_with(prefix, key_prefix))
);
alter table thumbq.storage_sources enable row level security;
grant all on thumbq.storage_sources to service_role;

-- Jobs that wait or run, by task: an index-only count of the backlog.
create index if not exists jobs_live_task_idx on thumbq.jobs (task, status)
  where status in ('pending', 'processing');

-- Events and their outbox ------------------------------------------------------------------

-- What happened that a webhook tells (group.completed). Rows are written by the trigger
-- groups_completed_event and turned into `webhook` jobs by thumbq.enqueue_events
-- (sql/functions/70_runs_metrics.sql), in a transaction of its own, so that no job is ever
-- enqueued from inside a group row's trigger (that would take job rows and messages after a
-- group row, against the lock order of sql/functions/10_helpers.sql).
create table if not exists thumbq.events (
  id          uuid primary key default gen_random_uuid(),
  type        text not null check (length(type) between 1 and 100),
  group_id    text not null,
  payload     jsonb not null,
  created_at  timestamptz not null default clock_timestamp(),
  -- The webhook job that delivers it; null until enqueue_events has taken it.
  job_id      bigint
);
create index if not exists events_undelivered_idx on thumbq.events (created_at)
  where job_id is null;
create index if not exists events_created_idx on thumbq.events (created_at);

-- Whether anyone delivers events: enqueue_events marks it on each call. Events are recorded only
-- while a deployment called it within the last day, so that a database without webhooks grows no
-- outbox, and one that turns them on later is not sent its whole history.
create table if not exists thumbq.event_sinks (
  name     text primary key,
  seen_at  timestamptz not null default clock_timestamp()
);

do $$
declare
  t text;
begin
  foreach t in array array['events', 'event_sinks'] loop
    execute format('alter table thumbq.%I enable row level security', t);
    execute format('grant all on thumbq.%I to service_role', t);
    if not exists (select 1 from pg_policies where schemaname = 'thumbq' and tablename = t
                   and policyname = 'service_role_all') then
      execute format('create policy service_role_all on thumbq.%I to service_role'
                     ' using (true) with check (true)', t);
    end if;
  end loop;
end
$$;

-- The dead-lettered jobs, newest first: what the page lists and replays, without reading the
-- finished jobs around them (a small index: only jobs that failed for good with a dead letter).
create index if not exists jobs_dead_letters_idx on thumbq.jobs (completed_at desc, id desc)
  where status = 'failed' and dlq_msg_id is not null;

create table if not exists thumbq.schedule (
  singleton  boolean primary key default true check (singleton),
  enabled    boolean not null default true,
  updated_at timestamptz not null default clock_timestamp()
);
alter table thumbq.schedule enable row level security;
revoke all on thumbq.schedule from public;
do $$
begin
  if exists (select 1 from pg_roles where rolname = 'anon') then
    revoke all on thumbq.schedule from anon, authenticated;
  end if;
end
$$;

-- A run's stop reason is one of worker/engine/states.py's StopReason (tests/db/test_states.py).
-- 001 also allowed 'error', which no version wrote: a run whose claim fails raises and leaves
-- stopped_reason null. Added not valid, then validated, so the catalogue change is all the
-- table's exclusive lock covers.
alter table thumbq.batch_runs
  drop constraint if exists batch_runs_stopped_reason_check,
  add constraint batch_runs_stopped_reason_check
    check (stopped_reason in ('drained', 'time_budget', 'rate_limited', 'max_items')) not valid;
alter table thumbq.batch_runs validate constraint batch_runs_stopped_reason_check;
