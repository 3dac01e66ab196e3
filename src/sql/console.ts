// The statements of the reads behind the console's pages (src/console/queries.ts).
import type { SqlContext } from './context.ts';
import { DEPTH_CAP } from './outbox.ts';

export const consoleStatements = ({ CURSOR, UNSETTLED, boss, listedColumns, operationsPage, reviewPage, s, statement }: SqlContext) => ({
  // The overview's charts: one row a minute since $1. Each reads only the window (the settled index,
  // the unsettled index, the timeline's BRIN index), so they cost what the window holds, not the table.

  /** Settlements by outcome, and confirm → settled latency, a minute at a time. */
  settlementsByMinute: statement<[from: Date]>(
    'outboxd_settlements_by_minute',
    `select date_trunc('minute', settled_at) as minute,
       count(*) filter (where status = 'succeeded')::int as succeeded,
       count(*) filter (where status = 'failed')::int as failed,
       percentile_cont(0.5) within group (order by extract(epoch from settled_at - created_at)) * 1000 as p50_ms,
       percentile_cont(0.95) within group (order by extract(epoch from settled_at - created_at)) * 1000 as p95_ms
     from ${s}.payment_operations where settled_at >= $1
     group by 1`,
  ),

  /**
   * The age of the oldest unsettled operation at each minute's start. Of all that were unsettled in
   * the window (settled since $1, or unsettled now: of those only the oldest can be the oldest), an
   * operation is the oldest from its creation, or from when every older one had settled, until it
   * settles: an empty range for one that settled before some older one. Minutes are generated per
   * range, so this costs a sort of the window, not a scan of it per minute.
   */
  oldestUnsettledByMinute: statement<[from: Date]>(
    'outboxd_oldest_unsettled_by_minute',
    `with spans as (
       select created_at, settled_at as ended_at from ${s}.payment_operations where settled_at >= $1
       union all
       (select created_at, 'infinity'::timestamptz from ${s}.payment_operations where ${UNSETTLED} order by created_at limit 1)
     ), ordered as (
       select created_at, ended_at,
         coalesce(max(ended_at) over (order by created_at, ended_at rows between unbounded preceding and 1 preceding), '-infinity') as before
       from spans
     )
     select minute, extract(epoch from minute - created_at)::float8 as age_seconds
     from ordered cross join lateral generate_series(
       date_trunc('minute', greatest(created_at, before, $1) + interval '59.999999 seconds'),
       least(ended_at - interval '1 microsecond', now()),
       interval '1 minute') as minute`,
  ),

  /**
   * Gateway calls with an outcome (any kind, any call) but those the budget never sent (their recorded
   * error matches $2), and the ones among them that were answered rate-limited (a 429), from the timeline.
   * A repeated outcome is one row (repeats, last_at): it counts once in the minute it began and the rest
   * in the minute it last happened; one begun before the window is not drawn.
   */
  gatewayCallsByMinute: statement<[from: Date, notSent: string]>(
    'outboxd_gateway_calls_by_minute',
    `select date_trunc('minute', v.at) as minute, sum(v.n)::int as calls,
       sum(v.n) filter (where e.details->>'outcome' = 'rate_limited')::int as rate_limited
     from ${s}.operation_events e
     cross join lateral (values (e.at, 1), (e.last_at, e.repeats - 1)) as v(at, n)
     where e.at >= $1 and e.type = 'outcome' and coalesce(e.details->>'error', '') not like $2 and v.n > 0 and v.at >= $1
     group by 1`,
  ),

  /** The kinds that exist: one probe of the list index per kind (a loose index scan), not a scan. */
  operationKinds: statement<[]>(
    'outboxd_operation_kinds',
    `with recursive kinds(kind) as (
       (select kind from ${s}.payment_operations order by kind limit 1)
       union all
       select (select p.kind from ${s}.payment_operations p where p.kind > kinds.kind order by p.kind limit 1)
       from kinds where kinds.kind is not null
     )
     select kind from kinds where kind is not null`,
  ),

  /** A page of operations, newest first, strictly older than the cursor (created_at, id): one range
   * of the list index per (kind, status), each cut at the page size, merged. */
  operationsOlder: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
    'outboxd_operations_older',
    operationsPage('<', 'desc'),
  ),

  /** The page just newer than the cursor, oldest first (the caller reverses it). */
  operationsNewer: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
    'outboxd_operations_newer',
    operationsPage('>', 'asc'),
  ),

  /** The same pages among operations held for review: few, read through the review index and sorted. */
  reviewOlder: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
    'outboxd_review_older',
    reviewPage('<', 'desc'),
  ),

  reviewNewer: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
    'outboxd_review_newer',
    reviewPage('>', 'asc'),
  ),

  /** The review queue, longest waiting first, with when each was last flagged or found to need review. */
  reviewQueue: statement<[limit: number]>(
    'outboxd_review_queue',
    `select ${listedColumns('o')}, ${CURSOR} as cursor_at,
       (select max(coalesce(e.last_at, e.at)) from ${s}.operation_events e
        where e.operation_id = o.id and (e.type = 'flagged' or (e.type = 'outcome' and e.details->>'outcome' = 'needs_review'))) as flagged_at
     from ${s}.payment_operations o
     where o.review_reason is not null
     order by o.created_at, o.id
     limit $1`,
  ),

  /** The overview's figures, each read through an index, never a scan of every operation: unsettled
   * counts by kind and status (the unsettled index), settled counts of the last 24 hours (the settled
   * index), the review count, the oldest unsettled, and the number of operations: counted while the
   * planner believes there are fewer than 100,000 (-1 when never analyzed), estimated beyond. */
  consoleOverview: statement<[]>(
    'outboxd_console_overview',
    `select
       (select coalesce(jsonb_agg(c order by c.kind, c.status), '[]'::jsonb) from (
          select kind, status, count(*)::int as n from ${s}.payment_operations where ${UNSETTLED} group by kind, status
          union all
          select kind, status, count(*)::int from ${s}.payment_operations
          where settled_at >= now() - interval '24 hours' group by kind, status) c) as counts,
       (select case when reltuples < 100000 then (select count(*) from ${s}.payment_operations) else reltuples::bigint end
        from pg_class where oid = '${s}.payment_operations'::regclass) as total,
       (select reltuples < 100000 from pg_class where oid = '${s}.payment_operations'::regclass) as total_exact,
       (select count(*)::int from ${s}.payment_operations where review_reason is not null) as needs_review,
       (select extract(epoch from now() - min(created_at))::float8 from ${s}.payment_operations where ${UNSETTLED}) as oldest_unsettled_seconds,
       (select count(*)::int from (select from ${s}.charge_outbox limit ${DEPTH_CAP}) capped) as outbox_rows`,
  ),

  /** Operations held for review (their partial index): the console's navigation shows it on every page. */
  reviewCount: statement<[]>(
    'outboxd_review_count',
    `select count(*)::int as n from ${s}.payment_operations where review_reason is not null`,
  ),

  recentSettlements: statement<[limit: number]>(
    'outboxd_recent_settlements',
    `select ${listedColumns()} from ${s}.payment_operations where settled_at is not null order by settled_at desc limit $1`,
  ),

  /** Every operation of an order, of any kind: a charge's refunds, a refund's charge, earlier attempts. */
  operationsOfOrder: statement<[orderId: string, limit: number]>(
    'outboxd_operations_of_order',
    `select ${listedColumns()} from ${s}.payment_operations where order_id = $1 order by created_at, id limit $2`,
  ),

  operationsByExternalId: statement<[externalId: string, limit: number]>(
    'outboxd_operations_by_external_id',
    `select ${listedColumns()} from ${s}.payment_operations where external_id = $1 order by created_at, id limit $2`,
  ),

  /** An operation's timeline rows, oldest first. */
  operationEvents: statement<[operationId: string, limit: number]>(
    'outboxd_operation_events',
    `select id, at, type, fence, actor, details, repeats, last_at from ${s}.operation_events where operation_id = $1 order by id limit $2`,
  ),

  webhookEventsOf: statement<[operationId: string, limit: number]>(
    'outboxd_webhook_events_of',
    `select id, type, received_at, result, payload from ${s}.webhook_events
     where operation_id = $1 order by received_at, id limit $2`,
  ),

  /** The operation's settlement events as pg-boss carries them to the application's onSettled
   * handlers: queued, delivered (completed), retrying, or dead-lettered. */
  settlementEventsOf: statement<[operationId: string, queues: string[], limit: number]>(
    'outboxd_settlement_events_of',
    `select id, name, state, retry_count, created_on, completed_on, data->>'source' as source, output
     from ${boss}.job where name = any($2::text[]) and data->>'operationId' = $1
     order by created_on, id limit $3`,
  ),
});
