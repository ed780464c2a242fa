-- Schedule on Supabase: pg_cron calls the batch endpoint every 5 minutes through pg_net, with
-- the API's URL and the cron secret read from Vault at call time, and resets expired leases
-- every 15 minutes in the database itself (no HTTP needed for that).
--
-- Vault secrets (set once, e.g. in the SQL editor; never in a migration):
--   select vault.create_secret('https://thumbq-api.example.com', 'thumbq_api_url');
--   select vault.create_secret('<THUMBQ_CRON_SECRET>', 'thumbq_cron_secret');
--
-- Guarded: without pg_cron (plain Postgres) this file does nothing and says so. cron.schedule
-- replaces a job of the same name, so running this again never duplicates a job.

do $cron$
declare
  v_has_cron boolean := exists (select 1 from pg_extension where extname = 'pg_cron');
  v_can_cron boolean := exists (select 1 from pg_available_extensions where name = 'pg_cron')
                        and current_setting('shared_preload_libraries', true) like '%pg_cron%';
begin
  if not v_has_cron and not v_can_cron then
    raise notice 'thumbq: pg_cron is not available here: no schedule was created '
                 '(use `thumbq scheduler`, Netlify or Vercel cron instead)';
    return;
  end if;
  create extension if not exists pg_cron;
  if to_regprocedure('net.http_post(text, jsonb, jsonb, jsonb, integer)') is null
     and exists (select 1 from pg_available_extensions where name = 'pg_net') then
    create extension if not exists pg_net;
  end if;

  -- The one place that speaks HTTP. plpgsql resolves net.* and vault.* at call time, so a
  -- missing secret is a clear error in cron.job_run_details, never a half-applied schema.
  execute $fn$
    create or replace function thumbq.call_api(p_path text, p_timeout_ms integer default 30000)
    returns bigint
    language plpgsql
    as $body$
    declare
      v_url text;
      v_secret text;
    begin
      if to_regclass('vault.decrypted_secrets') is null then
        raise exception 'thumbq.call_api: Supabase Vault (vault.decrypted_secrets) is not installed';
      end if;
      select decrypted_secret into v_url from vault.decrypted_secrets
       where name = 'thumbq_api_url';
      select decrypted_secret into v_secret from vault.decrypted_secrets
       where name = 'thumbq_cron_secret';
      if coalesce(v_url, '') = '' then
        raise exception 'thumbq.call_api: Vault secret thumbq_api_url is missing'
          using hint = 'select vault.create_secret(''https://your-api.example.com'', ''thumbq_api_url'');';
      end if;
      if coalesce(v_secret, '') = '' then
        raise exception 'thumbq.call_api: Vault secret thumbq_cron_secret is missing'
          using hint = 'select vault.create_secret(''<THUMBQ_CRON_SECRET>'', ''thumbq_cron_secret'');';
      end if;
      -- pg_net queues the request and returns its id; the response lands in net._http_response.
      return net.http_post(
        url := rtrim(v_url, '/') || p_path,
        body := '{}'::jsonb,
        params := '{}'::jsonb,
        headers := jsonb_build_object('Content-Type', 'application/json',
                                      'Authorization', 'Bearer ' || v_secret),
        timeout_milliseconds := p_timeout_ms);
    end
    $body$
  $fn$;
  -- It reads the cron secret: only the scheduler's owner may call it.
  revoke all on function thumbq.call_api(text, integer) from public;
  revoke all on function thumbq.call_api(text, integer) from anon, authenticated, service_role;

  perform cron.schedule('thumbq-batch', '*/5 * * * *',
                        $cmd$select thumbq.call_api('/api/thumbnails/batch-generate')$cmd$);
  perform cron.schedule('thumbq-cleanup-stale', '*/15 * * * *',
                        $cmd$select thumbq.reap_stale()$cmd$);
  if to_regprocedure('net.http_post(text, jsonb, jsonb, jsonb, integer)') is null then
    raise notice 'thumbq: pg_net is not installed: thumbq-batch will fail until it is';
  end if;
end
$cron$;
