-- Supabase's platform pieces, each defined only where its platform is (the same guards as
-- 006_realtime.sql and 007_cron.sql, which set the platform up: the Realtime policy, the
-- pg_cron extension and its jobs).

-- Realtime: each change of a group's summary row is broadcast to the private topic
-- `thumbq:group:<group_id>` with realtime.send (006_realtime.sql).
do $realtime$
begin
  if to_regprocedure('realtime.send(jsonb, text, text, boolean)') is null then
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
  -- A trigger function: nobody's to call (008_grants.sql).
  revoke all on function thumbq.groups_broadcast() from public, anon, authenticated, service_role;

  drop trigger if exists groups_broadcast on thumbq.groups;
  create trigger groups_broadcast after insert or update or delete on thumbq.groups
    for each row execute function thumbq.groups_broadcast();
end
$realtime$;

-- pg_cron calls the batch endpoint through pg_net, with the URL and the secret read from Vault
-- at call time (007_cron.sql schedules it).
do $cron$
begin
  if not exists (select 1 from pg_extension where extname = 'pg_cron') then
    return;
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
end
$cron$;
