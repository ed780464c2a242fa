-- Realtime on Supabase: broadcast each change of a group's summary row to the private topic
-- `thumbq:group:<group_id>` with realtime.send (Supabase's recommended path at scale: one
-- message per change, authorised per topic, instead of every client decoding the WAL through
-- postgres_changes). Guarded: where realtime.send does not exist (plain Postgres) nothing is
-- created. Tables in the supabase_realtime publication are handled in 005_security.sql.

-- groups rows are small and change at most once per jobs statement per group, so logging the
-- whole old row is cheap; with it, postgres_changes UPDATE/DELETE events carry the previous
-- counts (and group_id) instead of only the primary key. jobs keeps the default identity: its
-- rows are wider and churn far more. Without wal_level = logical this costs nothing.
alter table thumbq.groups replica identity full;

do $realtime$
begin
  if to_regprocedure('realtime.send(jsonb, text, text, boolean)') is null then
    raise notice 'thumbq: realtime.send does not exist here (not Supabase): group broadcasts are off';
    return;
  end if;

  -- security definer: whichever role changes jobs (service_role, postgres, a worker role) may
  -- broadcast, without being granted realtime.send itself. Empty search_path: no shadowing.
  execute $fn$
    create or replace function thumbq.groups_broadcast() returns trigger
    language plpgsql
    security definer
    set search_path = ''
    as $body$
    declare
      v_row jsonb := to_jsonb(case when tg_op = 'DELETE' then old else new end);
    begin
      perform realtime.send(
        jsonb_build_object('operation', tg_op, 'record', v_row),
        'progress',
        'thumbq:group:' || (v_row ->> 'group_id'),
        true);
      return null;
    end
    $body$
  $fn$;
  revoke all on function thumbq.groups_broadcast() from public;

  drop trigger if exists groups_broadcast on thumbq.groups;
  create trigger groups_broadcast after insert or update or delete on thumbq.groups
    for each row execute function thumbq.groups_broadcast();

  -- Private topics are authorised by RLS on realtime.messages: a signed-in user may receive a
  -- group's broadcasts when the example membership table says they belong to the group.
  if to_regclass('realtime.messages') is not null
     and to_regprocedure('realtime.topic()') is not null then
    drop policy if exists thumbq_members_receive_group_progress on realtime.messages;
    create policy thumbq_members_receive_group_progress on realtime.messages
      for select to authenticated
      using (realtime.messages.extension = 'broadcast'
             and realtime.topic() like 'thumbq:group:%'
             and exists (select 1 from thumbq.group_members m
                          where m.group_id = substr(realtime.topic(), 14)
                            and m.user_id = thumbq.request_user_id()));
  end if;
end
$realtime$;
