-- Inspection views: what an operator reads in plain SQL. Thresholds of thumbq.alerts are the
-- documented defaults; the batch log line carries the same alert names.

-- `alter extension pgmq update` (1.4.4 -> 1.5, as Supabase offers) drops and re-creates
-- pgmq.metrics, and Postgres refused while thumbq.queue_overview called it directly ("cannot
-- drop function metrics(text) because other objects depend on it"). The view reads the metrics
-- through plpgsql functions instead (queue_metrics and work_metrics, 70_runs_metrics.sql),
-- whose bodies are resolved at call time, so pgmq can be upgraded under thumbq. The work queues
-- are summed over every priority.
create or replace view thumbq.queue_overview as
select q.queue_length,
       greatest(g.pending - coalesce(d.delayed, 0), 0)::bigint as visible,
       g.processing as in_flight,
       coalesce(d.delayed, 0) as delayed,
       q.oldest_msg_age_sec,
       q.newest_msg_age_sec,
       dlq.queue_length as dlq_length,
       g.pending as jobs_pending,
       g.processing as jobs_processing,
       g.completed as jobs_completed,
       g.failed as jobs_failed,
       g.unsupported as jobs_unsupported,
       g.cancelled as jobs_cancelled,
       b.name as bucket,
       b.tokens as bucket_tokens,
       b.capacity as bucket_capacity,
       b.refill_per_second as bucket_refill_per_second
  from thumbq.work_metrics() q
 cross join thumbq.queue_metrics('thumbq_dlq') dlq
 cross join (select coalesce(sum(pending), 0)::bigint as pending,
                    coalesce(sum(processing), 0)::bigint as processing,
                    coalesce(sum(completed), 0)::bigint as completed,
                    coalesce(sum(failed), 0)::bigint as failed,
                    coalesce(sum(unsupported), 0)::bigint as unsupported,
                    coalesce(sum(cancelled), 0)::bigint as cancelled
               from thumbq.groups) g
  left join (select count(*) as delayed from thumbq.jobs
              where status = 'pending' and next_attempt_at > now()) d on true
  left join (select name, capacity, refill_per_second,
                    least(capacity, tokens + refill_per_second
                          * greatest(0, extract(epoch from now() - refilled_at))) as tokens
               from thumbq.rate_limits where name = 'thumbnail_generation') b on true;

create or replace view thumbq.recent_failures as
select j.id, j.group_id, j.source_key, j.status, j.error_code, j.last_error, j.attempts,
       j.max_attempts, j.next_attempt_at, j.updated_at
  from thumbq.jobs j
 where j.error_code is not null
   and j.status in ('failed', 'unsupported', 'pending', 'processing')
 order by j.updated_at desc
 limit 100;

-- One row per condition that needs a person, with its figure and threshold. Every figure comes
-- from the queues (their length is the backlog, not the history) or from the last hour of
-- runs: reading this view costs the same with a million finished jobs as with none.
create or replace view thumbq.alerts as
with q as (
  select m.queue_length, m.oldest_msg_age_sec from thumbq.work_metrics() m
), dlq as (
  select m.queue_length from thumbq.queue_metrics('thumbq_dlq') m
), hour as (
  select coalesce(sum(r.failed), 0) as failed,
         coalesce(sum(r.succeeded + r.failed), 0) as done
    from thumbq.batch_runs r
   where r.started_at > now() - interval '1 hour' and r.finished_at is not null
), runs as (
  select r.duration_ms, r.budget_ms, r.stopped_reason
    from thumbq.batch_runs r
   where r.finished_at is not null
   order by r.started_at desc
   limit 5
)
select 'failure_rate_high'::text as name,
       round(h.failed::numeric / h.done, 3) as figure, 0.2 as threshold,
       h.failed || ' of ' || h.done || ' jobs finished by runs of the last hour failed'
         as detail
  from hour h where h.done > 0 and h.failed::numeric / h.done > 0.2
union all
select 'backlog_large', q.queue_length, 500,
       q.queue_length || ' jobs are waiting'
  from q where q.queue_length > 500
union all
select 'backlog_old', q.oldest_msg_age_sec, 1800,
       'the oldest message has waited ' || q.oldest_msg_age_sec || ' s'
  from q where q.oldest_msg_age_sec > 1800
union all
select 'budget_nearly_used', max(r.duration_ms::numeric / r.budget_ms), 0.9,
       'a recent run used over 90% of its time budget'
  from runs r having max(r.duration_ms::numeric / r.budget_ms) > 0.9
union all
select 'dlq_not_empty', dlq.queue_length, 0,
       dlq.queue_length || ' jobs failed every attempt and wait in thumbq_dlq'
  from dlq where dlq.queue_length > 0
union all
select 'rate_limited', count(*) filter (where r.stopped_reason = 'rate_limited'), 3,
       'most recent runs stopped on the rate limit'
  from runs r having count(*) filter (where r.stopped_reason = 'rate_limited') >= 3;

-- The same samples for Supabase users who scrape nothing: `select * from thumbq.metrics`.
create or replace view thumbq.metrics as
select m.metric, m.labels, m.value from thumbq.metrics_rows() m;

revoke all on thumbq.metrics from public, anon, authenticated;
grant select on thumbq.metrics to service_role;
