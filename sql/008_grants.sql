-- Function privileges. Postgres grants EXECUTE on every new function to PUBLIC, so until this
-- file anon and authenticated could call every thumbq transition (claim, enqueue_batch, cancel,
-- retry_failed, take_tokens...) through PostgREST RPC; only the tables' grants stopped the
-- writes, one grant away from a hole, and the RPC surface was listed to anyone. Here each role
-- gets what it needs and nothing else:
--   anon           nothing
--   authenticated  progress(text) and request_user_id() (the RLS policies call it as the user)
--   service_role   every function except the ones that read secrets or only run as triggers

revoke execute on all functions in schema thumbq from public;
revoke execute on all functions in schema thumbq from anon, authenticated;
grant execute on all functions in schema thumbq to service_role;
grant execute on function thumbq.progress(text), thumbq.request_user_id() to authenticated;

-- service_role keeps doing everything with functions created later in this schema. PUBLIC's
-- EXECUTE on them cannot be taken away per schema (Postgres only adds to the global defaults,
-- and changing those would touch every function of the app's own schemas): a file that creates
-- a function revokes it from public itself. `create or replace` keeps the grants made here.
alter default privileges in schema thumbq grant execute on functions to service_role;

do $$
begin
  -- call_api reads the cron secret from Vault (007_cron.sql): the scheduler's owner only.
  if to_regprocedure('thumbq.call_api(text, integer)') is not null then
    revoke all on function thumbq.call_api(text, integer) from service_role;
  end if;
  -- A security definer trigger function (006_realtime.sql): never called directly.
  if to_regprocedure('thumbq.groups_broadcast()') is not null then
    revoke all on function thumbq.groups_broadcast() from service_role;
  end if;
end
$$;

-- service_role's transitions call pgmq as service_role (they are security invoker), so it needs
-- thumbq's two queues too: usage on schema pgmq and the rows of their tables, nothing of other
-- queues. Where this role may not grant on pgmq's objects, say so instead of failing the file.
do $$
declare
  t text;
begin
  grant usage on schema pgmq to service_role;
  foreach t in array array['thumbq_jobs', 'thumbq_dlq'] loop
    if to_regclass('pgmq.q_' || t) is not null then
      execute format('grant select, insert, update, delete on pgmq.%I to service_role',
                     'q_' || t);
      execute format('grant usage, select on sequence %s to service_role',
                     pg_get_serial_sequence(format('pgmq.%I', 'q_' || t), 'msg_id'));
    end if;
    if to_regclass('pgmq.a_' || t) is not null then
      execute format('grant select on pgmq.%I to service_role', 'a_' || t);
    end if;
  end loop;
exception when insufficient_privilege then
  raise notice 'thumbq: cannot grant service_role the thumbq queues in schema pgmq (%); grant '
               'it as the owner of pgmq to call thumbq transitions as service_role', sqlerrm;
end
$$;
