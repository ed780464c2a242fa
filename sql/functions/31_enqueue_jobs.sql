-- Enqueue: task jobs (payloads, idempotency keys, ordering keys), and both kinds at once.

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

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.assign_sequences(jsonb),
  thumbq.enqueue_jobs_problem(jsonb),
  thumbq.enqueue_jobs_keys(jsonb),
  thumbq.lock_key_rows(text[]),
  thumbq.enqueue_jobs_stage(jsonb, text, integer),
  thumbq.enqueue_jobs_write(jsonb),
  thumbq.enqueue_jobs(jsonb, text, integer),
  thumbq.enqueue_mixed(jsonb, jsonb, text, integer)
  from public, anon, authenticated;
