-- thumbq.groups kept exact by statement-level triggers on thumbq.jobs. Each statement adds its
-- per-group deltas in one upsert, locking group rows in group_id order so that concurrent
-- statements touching several groups cannot deadlock on them.

do $$
begin
  if not exists (select 1 from pg_type t join pg_namespace n on n.oid = t.typnamespace
                 where n.nspname = 'thumbq' and t.typname = 'group_delta') then
    create type thumbq.group_delta as (group_id text, status text, d integer);
  end if;
end
$$;

-- plpgsql rather than sql: its plan is cached per session instead of made on every call.
create or replace function thumbq.apply_group_deltas(p_deltas thumbq.group_delta[])
returns void
language plpgsql
as $$
begin
  insert into thumbq.groups as g
    (group_id, total, pending, processing, completed, failed, unsupported, cancelled,
     version, updated_at, last_done_at, wave_started_at)
  select x.group_id,
         sum(x.d),
         coalesce(sum(x.d) filter (where x.status = 'pending'), 0),
         coalesce(sum(x.d) filter (where x.status = 'processing'), 0),
         coalesce(sum(x.d) filter (where x.status = 'completed'), 0),
         coalesce(sum(x.d) filter (where x.status = 'failed'), 0),
         coalesce(sum(x.d) filter (where x.status = 'unsupported'), 0),
         coalesce(sum(x.d) filter (where x.status = 'cancelled'), 0),
         1,
         clock_timestamp(),
         case when bool_or(x.d > 0 and x.status in ('completed', 'failed', 'unsupported',
                                                      'cancelled'))
              then clock_timestamp() end,
         case when bool_or(x.d > 0 and x.status = 'processing') then clock_timestamp() end
    from unnest(p_deltas) x
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
  v_deltas thumbq.group_delta[];
begin
  select array_agg(row(n.group_id, n.status, 1)::thumbq.group_delta) into v_deltas
    from new_rows n;
  if v_deltas is not null then
    perform thumbq.apply_group_deltas(v_deltas);
  end if;
  return null;
end
$$;

create or replace function thumbq.jobs_after_update() returns trigger
language plpgsql as $$
declare
  v_deltas thumbq.group_delta[];
begin
  select array_agg(v.delta) into v_deltas
    from old_rows o
    join new_rows n on n.id = o.id
   cross join lateral (values (row(o.group_id, o.status, -1)::thumbq.group_delta),
                              (row(n.group_id, n.status, 1)::thumbq.group_delta)) v(delta)
   where o.status is distinct from n.status or o.group_id is distinct from n.group_id;
  -- Most updates that change no status (dlq_msg_id, an UPDATE matching nothing) stop here.
  if v_deltas is not null then
    perform thumbq.apply_group_deltas(v_deltas);
  end if;
  return null;
end
$$;

create or replace function thumbq.jobs_after_delete() returns trigger
language plpgsql as $$
declare
  v_deltas thumbq.group_delta[];
begin
  select array_agg(row(o.group_id, o.status, -1)::thumbq.group_delta) into v_deltas
    from old_rows o;
  if v_deltas is not null then
    perform thumbq.apply_group_deltas(v_deltas);
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
