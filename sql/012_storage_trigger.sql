-- Supabase, for real: what projects set up before 0.1.0 lack, and (below) new uploads to
-- Supabase Storage that enqueue themselves.

-- Before 0.1.0, this index was added to 001_schema.sql after that file had shipped, so a
-- Supabase project that pushed the earlier 001 never received it (`supabase db push` applies a
-- version once). Released files are frozen since; this is where it reaches those projects.
create index if not exists jobs_group_errors_idx on thumbq.jobs (group_id, updated_at desc)
  where error_code is not null;

-- `alter extension pgmq update` (1.4.4 -> 1.5, as Supabase offers) drops and re-creates
-- pgmq.metrics, and Postgres refused while thumbq.queue_overview called it directly ("cannot
-- drop function metrics(text) because other objects depend on it"). The view reads the metrics
-- through this plpgsql function instead, whose body is resolved at call time, so pgmq can be
-- upgraded under thumbq. Security invoker, as the view always was: the caller needs pgmq.metrics.
create or replace function thumbq.queue_metrics(p_queue text)
returns table (queue_length bigint, newest_msg_age_sec integer, oldest_msg_age_sec integer)
language plpgsql
stable
as $$
begin
  return query
    select m.queue_length, m.newest_msg_age_sec, m.oldest_msg_age_sec from pgmq.metrics(p_queue) m;
end
$$;
revoke all on function thumbq.queue_metrics(text) from public, anon, authenticated;

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
  from thumbq.queue_metrics('thumbq_jobs') q
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
