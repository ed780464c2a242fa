-- Inspection views: what an operator reads in plain SQL. Thresholds of thumbq.alerts are the
-- documented defaults; the batch log line carries the same alert names.

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
  from pgmq.metrics('thumbq_jobs') q
 cross join pgmq.metrics('thumbq_dlq') dlq
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

-- One row per condition that needs a person, with its figure and threshold.
create or replace view thumbq.alerts as
with finished as (
  select count(*) filter (where status = 'failed') as failed,
         count(*) filter (where status in ('completed', 'failed')) as done
    from thumbq.jobs
   where completed_at > now() - interval '1 hour'
), q as (
  select o.jobs_pending, o.oldest_msg_age_sec, o.dlq_length from thumbq.queue_overview o
), runs as (
  select r.duration_ms, r.budget_ms, r.stopped_reason
    from thumbq.batch_runs r
   where r.finished_at is not null
   order by r.started_at desc
   limit 5
)
select 'failure_rate_high'::text as name,
       round(f.failed::numeric / f.done, 3) as figure, 0.2 as threshold,
       f.failed || ' of ' || f.done || ' jobs finished in the last hour failed' as detail
  from finished f where f.done > 0 and f.failed::numeric / f.done > 0.2
union all
select 'backlog_large', q.jobs_pending, 500,
       q.jobs_pending || ' jobs are waiting'
  from q where q.jobs_pending > 500
union all
select 'backlog_old', q.oldest_msg_age_sec, 1800,
       'the oldest message has waited ' || q.oldest_msg_age_sec || ' s'
  from q where q.oldest_msg_age_sec > 1800
union all
select 'budget_nearly_used', max(r.duration_ms::numeric / r.budget_ms), 0.9,
       'a recent run used over 90% of its time budget'
  from runs r having max(r.duration_ms::numeric / r.budget_ms) > 0.9
union all
select 'dlq_not_empty', q.dlq_length, 0,
       q.dlq_length || ' jobs failed every attempt and wait in thumbq_dlq'
  from q where q.dlq_length > 0
union all
select 'rate_limited', count(*) filter (where r.stopped_reason = 'rate_limited'), 3,
       'most recent runs stopped on the rate limit'
  from runs r having count(*) filter (where r.stopped_reason = 'rate_limited') >= 3;
