-- Every query the Python code runs, by name. worker/engine/db.py splits this file on the
-- "-- name: x" headers. Placeholders are psycopg's %(name)s; nothing is ever formatted in.

-- name: enqueue_batch
select job_id, source_key, source_etag, created, status
  from thumbq.enqueue_batch(%(items)s::jsonb, %(group_id)s, %(max_attempts)s)

-- name: claim
select thumbq.claim(%(worker_id)s, %(qty)s, %(vt_seconds)s, %(bucket)s, %(ageing_s)s) as result

-- name: complete
select job_id, outcome from thumbq.complete_jobs(%(worker_id)s, %(results)s::jsonb, %(wait)s)

-- name: fail
select thumbq.fail(%(worker_id)s, %(msg_id)s, %(job_id)s, %(error_code)s, %(message)s,
                   %(permanent)s, %(base_s)s, %(cap_s)s) as result

-- name: release
select thumbq.release(%(worker_id)s, %(job_ids)s::bigint[], %(bucket)s) as released

-- name: reap_stale
select thumbq.reap_stale(%(limit)s) as reset_count

-- name: prune
select thumbq.prune(%(days)s, %(limit)s) as result

-- name: progress
select * from thumbq.progress_v2(%(group_id)s)

-- name: retry_failed
select thumbq.retry_failed(%(group_id)s) as requeued

-- name: cancel
select thumbq.cancel(%(group_id)s) as cancelled

-- name: start_run
select thumbq.start_run(%(worker_id)s, %(budget_ms)s, %(buffer_ms)s, %(concurrency)s) as result

-- name: finish_run
select thumbq.finish_run(%(run_id)s, %(summary)s::jsonb, %(stats)s::jsonb) as result

-- name: take_tokens
select granted, taken, tokens_left, retry_after_ms
  from thumbq.take_tokens(%(name)s, %(n)s, %(partial)s)

-- name: get_job
select * from thumbq.jobs where id = %(job_id)s

-- name: queue_overview
select * from thumbq.queue_overview

-- name: recent_failures_of_group
-- Every file of the group that has no thumbnail and a reason: failed, unsupported, missing from
-- storage (cancelled with source_missing), or waiting to retry after an error.
select id, group_id, source_key, source_etag, content_type, status, error_code, last_error,
       attempts, max_attempts, next_attempt_at, updated_at
  from thumbq.jobs
 where group_id = %(group_id)s and error_code is not null
   and (status in ('failed', 'unsupported', 'pending', 'processing')
        or (status = 'cancelled' and error_code = 'source_missing'))
 order by updated_at desc
 limit %(limit)s

-- name: finished_of_group
-- One page of a group's finished thumbnails, newest job first (keyset on id). The placeholder
-- columns are read through to_jsonb so that this works before and after they exist.
select j.id, j.source_key, j.thumbnail_key, j.thumbnail_content_type, j.width, j.height,
       j.completed_at, to_jsonb(j) ->> 'dominant_color' as dominant_color,
       to_jsonb(j) ->> 'thumbhash' as thumbhash, to_jsonb(j) -> 'thumbnails' -> 'pages' as pages
  from thumbq.jobs j
 where j.group_id = %(group_id)s and j.status = 'completed' and j.thumbnail_key is not null
   and j.id < %(before)s
 order by j.id desc
 limit %(limit)s

-- name: jobs_of_group
-- Each file of a group and how it ended (the CLI's summary after `demo` or `--now`).
select source_key, status, error_code, thumbnail_key, width, height, duration_ms
  from thumbq.jobs
 where group_id = %(group_id)s
 order by source_key
 limit %(limit)s

-- name: alerts
select name, figure, threshold, detail from thumbq.alerts

-- name: groups
select group_id, total, pending, processing, completed, failed, unsupported, cancelled,
       updated_at
  from thumbq.groups
 order by updated_at desc
 limit %(limit)s

-- name: runs_since
select id, processed, succeeded, failed, remaining, stopped_reason, duration_ms
  from thumbq.batch_runs
 where id >= %(run_id)s and finished_at is not null
 order by id

-- name: ping
select 1 as ok

-- name: progress_as_user
-- progress as a user sees it through RLS, in one statement (progress_as_user_v2,
-- sql/functions/20_groups_progress.sql).
select * from thumbq.progress_as_user_v2(%(claims)s, %(group_id)s)

-- name: act_as_user
-- For the rest of the transaction, act as Supabase's `authenticated` role with a user's JWT
-- claims, so that row level security decides what the user may read. Local to the
-- transaction: safe behind a transaction-mode pooler.
select set_config('role', 'authenticated', true) as role,
       set_config('request.jwt.claims', %(claims)s, true) as claims

-- name: sync_tasks
-- The registered tasks' buckets and limits, where claims read them. A bucket a task names that
-- does not exist yet is created with the default bucket's limits, so that it shows (and can be
-- changed) in thumbq.rate_limits.
with t as (
  select * from jsonb_to_recordset(%(tasks)s::jsonb)
    as t(name text, bucket text, max_attempts integer, runs_in text)
), b as (
  insert into thumbq.rate_limits (name, capacity, refill_per_second, tokens)
  select distinct t.bucket, 1000, 100, 1000 from t where t.bucket is not null
  on conflict (name) do nothing
  returning name
)
insert into thumbq.tasks (name, bucket, max_attempts, runs_in)
select t.name, t.bucket, t.max_attempts, t.runs_in from t
on conflict (name) do update set bucket = excluded.bucket,
  max_attempts = excluded.max_attempts, runs_in = excluded.runs_in,
  updated_at = clock_timestamp()
returning name, (select count(*) from b) as buckets_created

-- name: enqueue_jobs
select job_id, task, created, status, ordering_key, sequence
  from thumbq.enqueue_jobs(%(items)s::jsonb, %(group_id)s, %(max_attempts)s)

-- name: claim_job
select thumbq.claim_job(%(worker_id)s, %(job_id)s, %(vt_seconds)s, %(bucket)s) as result

-- name: enqueue_mixed
select thumbq.enqueue_mixed(%(files)s::jsonb, %(jobs)s::jsonb, %(group_id)s,
                            %(max_attempts)s) as result

-- name: extend_leases
select thumbq.extend_leases(%(worker_id)s, %(job_ids)s::bigint[], %(vt_seconds)s) as held

-- name: checkpoint
select thumbq.checkpoint(%(worker_id)s, %(job_id)s, %(msg_id)s, %(state)s::jsonb, %(done)s,
                         %(total)s, %(requeue)s) as result

-- name: cancel_jobs
select thumbq.cancel_jobs(%(job_ids)s::bigint[]) as cancelled

-- name: still_held
-- Of the jobs an invocation runs, those it no longer holds (cancelled, or taken over).
select id from thumbq.jobs
 where id = any(%(job_ids)s::bigint[])
   and (status <> 'processing' or worker_id is distinct from %(worker_id)s)

-- name: render_stats
-- What earlier runs observed of each kind of item: an interactive run predicts from it whether
-- its job fits in the caller's wait (a small table: kinds x size classes).
select kind, size_class, samples, ewma_ms, max_ms from thumbq.render_stats

-- Operator page (api/operator.py, sql/functions/80_operator.sql) --------------------------

-- name: operator_overview
select thumbq.operator_overview(%(limit)s) as overview

-- name: replay_dead_letters
-- job_ids null: every dead-lettered job.
select thumbq.replay_dead_letters(%(job_ids)s::bigint[]) as replayed

-- name: other_schemas
-- Whether thumbq's schema is there, and the schemas that hold something and are neither
-- thumbq's, pgmq's nor Postgres' own: `thumbq up` asks before it writes into such a database.
select to_regnamespace('thumbq') is not null as has_thumbq,
       array(select n.nspname::text from pg_namespace n
              where n.nspname not in ('pg_catalog', 'information_schema', 'pgmq', 'thumbq')
                and n.nspname not like 'pg\_%%'
                and (n.nspname <> 'public'
                     or exists (select 1 from pg_class c where c.relnamespace = n.oid)
                     or exists (select 1 from pg_proc p where p.pronamespace = n.oid))
              order by 1) as schemas

-- Operations: metrics and webhook events (sql/functions/70_runs_metrics.sql) -------------

-- name: metrics
-- Every sample of GET /metrics in one statement; bounded by the backlog and the last hour.
select metric, labels, value from thumbq.metrics

-- name: enqueue_events
select thumbq.enqueue_events(%(limit)s, %(max_attempts)s) as enqueued
