-- Group summaries kept exact by triggers on thumbq.jobs, and the progress reads built on them.

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

drop trigger if exists jobs_groups_insert on thumbq.jobs;
create trigger jobs_groups_insert after insert on thumbq.jobs
  referencing new table as new_rows
  for each statement execute function thumbq.jobs_after_insert();

drop trigger if exists jobs_groups_update on thumbq.jobs;
create trigger jobs_groups_update after update on thumbq.jobs
  referencing old table as old_rows new table as new_rows
  for each statement execute function thumbq.jobs_after_update();

drop trigger if exists jobs_groups_delete on thumbq.jobs;
create trigger jobs_groups_delete after delete on thumbq.jobs
  referencing old table as old_rows
  for each statement execute function thumbq.jobs_after_delete();

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

-- A user's progress read in one statement. The API used to open a transaction, switch to the
-- `authenticated` role with the user's claims (queries.sql, act_as_user), read progress and
-- commit: four round trips, about 250 us of the API's CPU and 0.8 ms a read. This function
-- does the same in one call (78 us, 0.22 ms; bench/load.py's users generator reads it 400
-- times a second).
--
-- SECURITY INVOKER on purpose: the caller must itself be allowed to become `authenticated`, and
-- after the switch row level security decides what the read returns, exactly as before.
-- Postgres re-plans a cached plan whose RLS decision depended on another role, so plans never
-- carry one user's view to the next. The settings are local to the transaction: called in
-- autocommit (as the API does) they end with the statement, so a pooled connection (Supavisor,
-- pgbouncer in transaction mode) is clean for its next client.
create or replace function thumbq.progress_as_user(p_claims text, p_group_id text)
returns table (group_id text, total integer, pending integer, processing integer,
               completed integer, failed integer, unsupported integer, cancelled integer,
               progress_percentage numeric, estimated_time_remaining_seconds integer,
               rate_per_second double precision, version bigint, updated_at timestamptz)
language plpgsql
volatile
security invoker
set search_path = pg_catalog, pg_temp
as $$
begin
  perform set_config('role', 'authenticated', true),
          set_config('request.jwt.claims', p_claims, true);
  return query select * from thumbq.progress(p_group_id);
end;
$$;

-- The API's role calls it; nobody reaches it through PostgREST RPC (005 made these roles).
revoke execute on function thumbq.progress_as_user(text, text) from public, anon, authenticated;

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

-- The user id of the request: Supabase's PostgREST and the thumbq API both put the JWT's
-- claims in request.jwt.claims; auth.uid() reads the same setting where it exists.
create or replace function thumbq.request_user_id()
returns text
language sql
stable
as $$
  select nullif(current_setting('request.jwt.claims', true), '')::jsonb ->> 'sub'
$$;

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.apply_group_changes(thumbq.group_change[]),
  thumbq.jobs_after_insert(),
  thumbq.jobs_after_update(),
  thumbq.jobs_after_delete()
  from public, anon, authenticated;
-- What a signed-in user may call (RLS decides what it returns).
revoke execute on function thumbq.progress(text), thumbq.progress_v2(text),
  thumbq.request_user_id() from public, anon;
grant execute on function thumbq.progress(text), thumbq.progress_v2(text),
  thumbq.request_user_id() to authenticated;
