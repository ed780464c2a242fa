-- Enqueue: source files (thumbnails), and the stages that enqueue_mixed shares with tasks.

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

-- Enqueue one object version; see enqueue_batch.
create or replace function thumbq.enqueue(p_source_key text, p_source_etag text default '',
                                          p_group_id text default 'default',
                                          p_content_type text default null,
                                          p_source_bytes bigint default null,
                                          p_max_attempts integer default 3)
returns table (job_id bigint, source_key text, source_etag text, created boolean,
               status text)
language sql
as $$
  select * from thumbq.enqueue_batch(
    jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
      'source_key', p_source_key, 'etag', p_source_etag, 'group_id', p_group_id,
      'content_type', p_content_type, 'bytes', p_source_bytes))),
    p_group_id, p_max_attempts)
$$;

-- Privileges (008_grants.sql): Postgres grants EXECUTE on a new function to PUBLIC; take it back
-- from the API roles. service_role keeps it (008's default privileges).
revoke execute on function
  thumbq.enqueue_items_v2(jsonb, text),
  thumbq.enqueue_files_stage(jsonb, text),
  thumbq.enqueue_files_write(jsonb, jsonb, text, integer),
  thumbq.enqueue_files_problem(jsonb),
  thumbq.enqueue_batch(jsonb, text, integer),
  thumbq.enqueue(text, text, text, text, bigint, integer)
  from public, anon, authenticated;
