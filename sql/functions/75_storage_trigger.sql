-- New uploads to Supabase Storage that enqueue themselves.

-- New uploads enqueue themselves (Supabase Storage) ----------------------------------------
--
-- Opt in per bucket and prefix; nothing watches storage.objects until then:
--   select thumbq.watch_storage('media');                      -- every object of bucket media
--   select thumbq.watch_storage('media', 'uploads/');          -- only names under uploads/
--   select thumbq.watch_storage('media', 'uploads/', p_key_prefix => 'uploads/',
--                               p_group_id => 'avatars');
-- p_key_prefix is the prefix of THUMBQ_STORAGE_URL (s3://media/uploads -> 'uploads/'): it is cut
-- from the object's name to make the source_key thumbq's storage uses for the same object.
-- Each new object version (an insert, or an upsert that changes its eTag) is enqueued in the
-- upload's own transaction, with the eTag, size and mimetype Storage recorded; removing an
-- object, or moving it away, cancels its waiting job. thumbq's own thumbnails (thumbnails/...)
-- and Storage's folder placeholders are never enqueued.

-- Cancel the waiting (pending) jobs of one source key: its object is gone. A job already
-- processing finishes as the batch finds it (source_missing).
create or replace function thumbq.cancel_source(p_source_key text,
                                                p_reason text default 'the object was removed')
returns integer
language sql
as $$
  -- cancel_jobs (60_maintenance.sql) keeps the one lock order: job rows, then messages, then
  -- group rows.
  select thumbq.cancel_jobs(array(select j.id from thumbq.jobs j
                                   where j.source_key = p_source_key and j.status = 'pending'),
                            'source_missing', p_reason)
$$;
revoke all on function thumbq.cancel_source(text, text) from public, anon, authenticated;

-- The enqueue items for a set of storage.objects rows: those under a watched prefix, with the
-- source_key thumbq's storage sees, the eTag without its quotes (as S3 answers it), size and
-- type. A row without an eTag yet (an upload still in progress) is left for its update.
create or replace function thumbq.storage_items(p_rows jsonb)
returns table (source_key text, item jsonb, max_attempts integer)
language sql
stable
set search_path = ''
as $$
  select distinct on (k.source_key) k.source_key,
         jsonb_strip_nulls(jsonb_build_object(
           'source_key', k.source_key,
           'etag', coalesce(nullif(btrim(r.value #>> '{metadata,eTag}', '"'), ''),
                            r.value->>'version'),
           'content_type', r.value #>> '{metadata,mimetype}',
           'bytes', case when (r.value #>> '{metadata,size}') ~ '^[0-9]{1,18}$'
                         then (r.value #>> '{metadata,size}')::bigint end,
           'group_id', s.group_id)),
         s.max_attempts
    from jsonb_array_elements(p_rows) r
    join thumbq.storage_sources s
      on s.bucket_id = r.value->>'bucket_id'
     and starts_with(r.value->>'name', s.prefix)
   cross join lateral (select substr(r.value->>'name', length(s.key_prefix) + 1) as source_key) k
   where k.source_key <> ''
     and not starts_with(k.source_key, 'thumbnails/')
     and k.source_key not like '%.emptyFolderPlaceholder'
   -- The longest (most specific) watched prefix decides a name's group.
   order by k.source_key, length(s.prefix) desc
$$;
revoke all on function thumbq.storage_items(jsonb) from public, anon, authenticated;

-- The trigger: security definer, because Storage writes storage.objects as the uploading user's
-- role, which may touch nothing of thumbq. A failure here is logged, never the upload's: a
-- missed object is found again by `thumbq backfill`, a failed upload is lost to the user.
create or replace function thumbq.storage_objects_changed()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_new jsonb := '[]';
  v_old jsonb := '[]';
  r record;
begin
  if tg_op in ('INSERT', 'UPDATE') then
    select coalesce(jsonb_agg(to_jsonb(n)), '[]') into v_new from new_rows n;
  end if;
  if tg_op in ('UPDATE', 'DELETE') then
    select coalesce(jsonb_agg(to_jsonb(o)), '[]') into v_old from old_rows o;
  end if;
  if tg_op = 'UPDATE' then
    -- Only new versions (the eTag or the name changed), not last_accessed_at and the like.
    select coalesce(jsonb_agg(n.value), '[]') into v_new
      from jsonb_array_elements(v_new) n
     where not exists (select 1 from jsonb_array_elements(v_old) o
                        where o.value->>'id' = n.value->>'id'
                          and o.value->>'name' is not distinct from n.value->>'name'
                          and o.value #>> '{metadata,eTag}'
                              is not distinct from n.value #>> '{metadata,eTag}');
    -- A moved object leaves its old name.
    select coalesce(jsonb_agg(o.value), '[]') into v_old
      from jsonb_array_elements(v_old) o
     where not exists (select 1 from jsonb_array_elements(v_new) n
                        where n.value->>'id' = o.value->>'id'
                          and n.value->>'name' is not distinct from o.value->>'name');
  end if;
  begin
    for r in select distinct i.source_key from thumbq.storage_items(v_old) i
              where not exists (select 1 from thumbq.storage_items(v_new) n
                                 where n.source_key = i.source_key)
    loop
      perform thumbq.cancel_source(r.source_key, 'the object was removed from storage');
    end loop;
    for r in select i.max_attempts, jsonb_agg(i.item) as items
               from thumbq.storage_items(v_new) i group by i.max_attempts
    loop
      perform thumbq.enqueue_batch(r.items, 'uploads', r.max_attempts);
    end loop;
  exception when others then
    raise warning 'thumbq: could not enqueue or cancel thumbnails for storage.objects (%: %)',
                  sqlstate, sqlerrm;
  end;
  return null;
end
$$;
revoke all on function thumbq.storage_objects_changed() from public, anon, authenticated,
  service_role;

-- Opt in: watch a bucket (and prefix), creating the triggers on storage.objects on first use.
create or replace function thumbq.watch_storage(p_bucket_id text, p_prefix text default '',
                                                p_key_prefix text default '',
                                                p_group_id text default 'uploads',
                                                p_max_attempts integer default 3)
returns void
language plpgsql
as $$
begin
  if to_regclass('storage.objects') is null then
    raise exception 'thumbq.watch_storage: storage.objects does not exist (not Supabase Storage)'
      using hint = 'for S3 or R2, send bucket event notifications to POST /api/thumbnails/enqueue';
  end if;
  insert into thumbq.storage_sources (bucket_id, prefix, key_prefix, group_id, max_attempts)
  values (p_bucket_id, p_prefix, p_key_prefix, p_group_id, p_max_attempts)
  on conflict (bucket_id, prefix) do update
     set key_prefix = excluded.key_prefix, group_id = excluded.group_id,
         max_attempts = excluded.max_attempts;
  -- One trigger per event: transition tables allow no more. Statement level, so a statement
  -- that writes many objects enqueues them in one call.
  if not exists (select 1 from pg_trigger where tgrelid = 'storage.objects'::regclass
                   and tgname = 'thumbq_enqueue_inserted') then
    create trigger thumbq_enqueue_inserted after insert on storage.objects
      referencing new table as new_rows
      for each statement execute function thumbq.storage_objects_changed();
    create trigger thumbq_enqueue_updated after update on storage.objects
      referencing old table as old_rows new table as new_rows
      for each statement execute function thumbq.storage_objects_changed();
    create trigger thumbq_cancel_deleted after delete on storage.objects
      referencing old table as old_rows
      for each statement execute function thumbq.storage_objects_changed();
  end if;
end
$$;
revoke all on function thumbq.watch_storage(text, text, text, text, integer)
  from public, anon, authenticated;

-- Opt out of one bucket and prefix; the triggers go with the last one.
create or replace function thumbq.unwatch_storage(p_bucket_id text, p_prefix text default '')
returns void
language plpgsql
as $$
begin
  delete from thumbq.storage_sources where bucket_id = p_bucket_id and prefix = p_prefix;
  if to_regclass('storage.objects') is not null
     and not exists (select 1 from thumbq.storage_sources) then
    drop trigger if exists thumbq_enqueue_inserted on storage.objects;
    drop trigger if exists thumbq_enqueue_updated on storage.objects;
    drop trigger if exists thumbq_cancel_deleted on storage.objects;
  end if;
end
$$;
revoke all on function thumbq.unwatch_storage(text, text) from public, anon, authenticated;
