-- Supabase's roles, grants, row level security and Realtime publication. The same SQL runs on
-- Supabase and on plain Postgres: missing roles are created (without login), a missing
-- publication is left alone.

do $$
declare
  r text;
begin
  foreach r in array array['anon', 'authenticated', 'service_role'] loop
    if not exists (select 1 from pg_roles where rolname = r) then
      execute format('create role %I nologin', r);
    end if;
  end loop;
end
$$;

-- The user id of the request: Supabase's PostgREST and the thumbq API both put the JWT's
-- claims in request.jwt.claims; auth.uid() reads the same setting where it exists.
create or replace function thumbq.request_user_id()
returns text
language sql
stable
as $$
  select nullif(current_setting('request.jwt.claims', true), '')::jsonb ->> 'sub'
$$;

grant usage on schema thumbq to anon, authenticated, service_role;
grant select on thumbq.jobs, thumbq.groups to authenticated;
grant select on thumbq.group_members to authenticated;
grant execute on function thumbq.progress(text), thumbq.request_user_id() to authenticated;
grant all on all tables in schema thumbq to service_role;
grant all on all sequences in schema thumbq to service_role;
grant execute on all functions in schema thumbq to service_role;

alter table thumbq.jobs enable row level security;
alter table thumbq.groups enable row level security;
alter table thumbq.group_members enable row level security;
alter table thumbq.rate_limits enable row level security;
alter table thumbq.batch_runs enable row level security;
alter table thumbq.render_stats enable row level security;

-- service_role does everything (on Supabase it bypasses RLS anyway; on plain Postgres the
-- created role does not, so say it).
do $$
declare
  t text;
begin
  foreach t in array array['jobs', 'groups', 'group_members', 'rate_limits', 'batch_runs',
                           'render_stats'] loop
    if not exists (select 1 from pg_policies where schemaname = 'thumbq' and tablename = t
                   and policyname = 'service_role_all') then
      execute format('create policy service_role_all on thumbq.%I to service_role '
                     'using (true) with check (true)', t);
    end if;
  end loop;
end
$$;

-- Example policy: a signed-in user sees the groups (and their jobs) they are a member of.
-- Adapt the membership test to the app's own tables.
drop policy if exists members_read_groups on thumbq.groups;
create policy members_read_groups on thumbq.groups for select to authenticated
  using (exists (select 1 from thumbq.group_members m
                  where m.group_id = groups.group_id
                    and m.user_id = thumbq.request_user_id()));

drop policy if exists members_read_jobs on thumbq.jobs;
create policy members_read_jobs on thumbq.jobs for select to authenticated
  using (exists (select 1 from thumbq.group_members m
                  where m.group_id = jobs.group_id
                    and m.user_id = thumbq.request_user_id()));

drop policy if exists members_read_own_membership on thumbq.group_members;
create policy members_read_own_membership on thumbq.group_members for select to authenticated
  using (user_id = thumbq.request_user_id());

-- Realtime: where Supabase's publication exists, stream job and group changes.
do $$
declare
  t text;
begin
  if exists (select 1 from pg_publication where pubname = 'supabase_realtime') then
    foreach t in array array['jobs', 'groups'] loop
      if not exists (select 1 from pg_publication_tables where pubname = 'supabase_realtime'
                     and schemaname = 'thumbq' and tablename = t) then
        execute format('alter publication supabase_realtime add table thumbq.%I', t);
      end if;
    end loop;
  end if;
end
$$;
