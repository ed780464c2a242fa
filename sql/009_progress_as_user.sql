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
