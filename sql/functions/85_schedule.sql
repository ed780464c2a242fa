-- Supabase with another scheduler: turn thumbq's pg_cron schedule off, and on again.
--
-- 007_cron.sql schedules thumbq-batch and thumbq-cleanup-stale wherever pg_cron exists (always
-- on Supabase). A project that calls the batch from Vercel Cron, Netlify or `thumbq scheduler`
-- then has two schedules, and while the Vault secrets are unset an error in
-- cron.job_run_details every 5 minutes. One call turns thumbq's pg_cron jobs off:
--   select thumbq.set_schedule(false);
-- and one turns them back on (Vault secrets needed, as 007 says):
--   select thumbq.set_schedule(true);
-- The choice is kept in thumbq.schedule, so that schema files applied again later (after an
-- upgrade) leave the schedule as the operator set it. Only pg_cron jobs that thumbq created
-- (named thumbq-batch and thumbq-cleanup-stale) are touched.

-- Schedule or unschedule thumbq's pg_cron jobs as p_enabled says, and remember the choice.
-- Returns {"enabled", "jobs": [the thumbq jobs pg_cron now has]}. Turning the schedule on where
-- pg_cron is missing is an error that says so; turning it off there only records the choice.
create or replace function thumbq.set_schedule(p_enabled boolean)
returns jsonb
language plpgsql
as $$
declare
  v_jobs jsonb;
begin
  if p_enabled is null then
    raise exception 'thumbq.set_schedule: say true (pg_cron schedules the batch) or false';
  end if;
  if p_enabled and to_regnamespace('cron') is null then
    raise exception 'thumbq.set_schedule: pg_cron is not installed in this database'
      using hint = 'call the batch endpoint from another scheduler (thumbq scheduler, Vercel '
                   'Cron, Netlify), or create the pg_cron extension first';
  end if;
  if p_enabled and to_regprocedure('thumbq.call_api(text, integer)') is null then
    raise exception 'thumbq.set_schedule: thumbq.call_api is missing (pg_cron was installed '
                    'after thumbq''s schema)'
      using hint = 'run sql/007_cron.sql (supabase/migrations/*_thumbq_007_cron.sql) again';
  end if;
  insert into thumbq.schedule (singleton, enabled) values (true, p_enabled)
  on conflict (singleton) do update set enabled = excluded.enabled,
                                        updated_at = clock_timestamp();
  if to_regnamespace('cron') is null then
    return jsonb_build_object('enabled', p_enabled, 'jobs', '[]'::jsonb);
  end if;
  -- cron.* is resolved at call time (EXECUTE): this file also loads where pg_cron is absent.
  if p_enabled then
    -- The same jobs as 007; cron.schedule replaces a job of the same name.
    execute $q$select cron.schedule('thumbq-batch', '*/5 * * * *',
                 'select thumbq.call_api(''/api/thumbnails/batch-generate'')')$q$;
    execute $q$select cron.schedule('thumbq-cleanup-stale', '*/15 * * * *',
                 'select thumbq.reap_stale()')$q$;
  else
    execute $q$select cron.unschedule(jobid) from cron.job
                where jobname in ('thumbq-batch', 'thumbq-cleanup-stale')$q$;
  end if;
  execute $q$select coalesce(jsonb_agg(jobname order by jobname), '[]'::jsonb) from cron.job
              where jobname in ('thumbq-batch', 'thumbq-cleanup-stale')$q$
     into v_jobs;
  return jsonb_build_object('enabled', p_enabled, 'jobs', v_jobs);
end
$$;
-- It changes what the database runs on a schedule: not for the API's user roles. service_role
-- (the backend key) keeps EXECUTE, as on every function that reads no secret (008_grants.sql);
-- pg_cron's own grants decide whether it may change cron.job.
revoke all on function thumbq.set_schedule(boolean) from public;
do $$
begin
  if exists (select 1 from pg_roles where rolname = 'anon') then
    revoke all on function thumbq.set_schedule(boolean) from anon, authenticated;
  end if;
end
$$;

-- Schema files run again after an upgrade, 007 among them on a fresh chain: an operator who
-- turned the schedule off keeps it off.
do $$
begin
  if exists (select 1 from thumbq.schedule where not enabled) then
    perform thumbq.set_schedule(false);
  end if;
end
$$;
