-- Supabase, for real: what projects set up before 0.1.0 lack, and (below) new uploads to
-- Supabase Storage that enqueue themselves.

-- Before 0.1.0, this index was added to 001_schema.sql after that file had shipped, so a
-- Supabase project that pushed the earlier 001 never received it (`supabase db push` applies a
-- version once). Released files are frozen since; this is where it reaches those projects.
create index if not exists jobs_group_errors_idx on thumbq.jobs (group_id, updated_at desc)
  where error_code is not null;
