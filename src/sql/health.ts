// The statements of the gauges every metrics scrape reads (src/telemetry/metrics.ts).
import { bossSchemaFor, type SqlContext } from './context.ts';

export const healthStatements = ({ schema, UNSETTLED, s, statement }: SqlContext) => ({
  /** The gauges every scrape reads, each from its partial index (review, unsettled): the few live rows,
   * never the whole table (which every replica's scrape used to read: ~300 ms at 1M operations). */
  operationHealth: statement<[]>(
    'outboxd_operation_health',
    `select
       (select count(*)::int from ${s}.payment_operations where review_reason is not null) as needs_review,
       coalesce((select extract(epoch from now() - min(created_at)) from ${s}.payment_operations where ${UNSETTLED}), 0)::float8
         as oldest_unsettled_seconds`,
  ),

  /**
   * The host database's health as it bears on outboxd (issue 22): the oldest transaction that holds the
   * xmin horizon back (no dead row younger than its snapshot can be vacuumed in this database's tables),
   * as its age in seconds and in transactions; and the dead rows of outboxd's tables and pg-boss's (its
   * job partitions together). A role without pg_read_all_stats sees other roles' sessions without
   * their xmin: grant it to outboxd's role for the whole picture.
   */
  hostHealth: statement<[]>(
    'outboxd_host_health',
    `select
       (select coalesce(max(extract(epoch from now() - xact_start)), 0)::float8 from pg_stat_activity
         where backend_xmin is not null and datname = current_database() and pid <> pg_backend_pid()) as oldest_xmin_seconds,
       (select coalesce(max(age(backend_xmin)), 0)::int from pg_stat_activity
         where backend_xmin is not null and datname = current_database() and pid <> pg_backend_pid()) as oldest_xmin_age,
       coalesce((select json_agg(t order by t.table) from (
         select case when schemaname = '${schema}' then relname::text else 'pg-boss' end as table,
           sum(n_dead_tup)::float8 as dead, sum(n_live_tup)::float8 as live
         from pg_stat_user_tables where schemaname in ('${schema}', '${bossSchemaFor(schema)}')
         group by 1) t), '[]') as tables`,
  ),
});
