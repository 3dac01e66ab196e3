// The statements of the history around the ledger, pruned past its retention (src/outbox/retention.ts).
import type { SqlContext } from './context.ts';

/** Deletes the $2 rows of `table` (in schema `s`) whose `at` is oldest and over $1 days ago, read through
 * an index on `at` (so a batch reads $2 rows however large the table), by `key`; fewer than $2 deleted:
 * none is left. */
const deleteOldest = (s: string, table: string, key: string, at: string) =>
  `with gone as (
     delete from ${s}.${table} where ${key} = any(array(
       select ${key} from ${s}.${table} where ${at} < now() - make_interval(days => $1) order by ${at} limit $2))
     returning 1
   )
   select count(*)::int as deleted from gone`;

export const retentionStatements = ({ s, statement, byIds, UNSETTLED }: SqlContext) => ({
  /**
   * One batch of the timeline's retention (src/outbox/retention.ts): the $3 oldest rows after id $2, of which
   * those last seen over $1 days ago, of an operation settled over $1 days ago, are deleted. An
   * unsettled operation's history (held for review, or still being driven), or a settled one's still held
   * for review (a discrepancy with Stripe), is kept whatever its age.
   * Rows are scanned in id order (the primary key), so a batch reads $3 rows, however large the table;
   * reached_window: the batch's last row was written inside the window, and so was every later one (ids
   * and insert times grow together; a repeat's last_at does not, and a row repeated lately among rows
   * long due would end every run at it). Each row's operation is read by its primary key (a scalar subquery, run per row) and
   * the rows are deleted by theirs (byIds): joined, a generic plan hashed the batch against every
   * operation settled before the window, the whole ledger's worth at each batch
   * (test/database/batchPlans.test.ts).
   */
  pruneOperationEvents: statement<[retentionDays: number, afterId: number, scan: number]>(
    'outboxd_prune_operation_events',
    `with scanned as (
       select id, operation_id, at, coalesce(last_at, at) as seen from ${s}.operation_events where id > $2 order by id limit $3
     ), gone as (
       delete from ${s}.operation_events e
       where ${byIds('e', `array(select sc.id from scanned sc where sc.seen < now() - make_interval(days => $1)
         and (select o.settled_at from ${s}.payment_operations o where o.id = sc.operation_id and o.review_reason is null) < now() - make_interval(days => $1))`)}
       returning e.id
     )
     select (select max(id) from scanned) as last_id, (select count(*)::int from gone) as deleted,
       coalesce((select at >= now() - make_interval(days => $1) from scanned order by id desc limit 1), true) as reached_window`,
  ),

  /** The audit trail's retention, as pruneOperationEvents: an action about an unsettled operation, or one
   * held for review, is kept; so is a sweep a person asked for (no operation of its own) while an
   * operation it decided on is (its decisions name them). */
  pruneAdminAudit: statement<[retentionDays: number, afterId: number, scan: number]>(
    'outboxd_prune_admin_audit',
    `with scanned as (
       select id, operation_id, at, case when operation_id is null and jsonb_typeof(details->'decisions') = 'array' then details->'decisions' end as decisions
       from ${s}.admin_audit where id > $2 order by id limit $3
     ), gone as (
       delete from ${s}.admin_audit a
       where ${byIds('a', `array(select sc.id from scanned sc where sc.at < now() - make_interval(days => $1)
         and case when sc.operation_id is null
           then not exists (select 1 from jsonb_array_elements(coalesce(sc.decisions, '[]')) d
                            join ${s}.payment_operations o on o.id = (d->>'operationId')::uuid
                            where o.review_reason is not null or o.settled_at is null or o.settled_at >= now() - make_interval(days => $1))
           else (select o.settled_at from ${s}.payment_operations o where o.id = sc.operation_id and o.review_reason is null) < now() - make_interval(days => $1) end)`)}
       returning a.id
     )
     select (select max(id) from scanned) as last_id, (select count(*)::int from gone) as deleted,
       coalesce((select at >= now() - make_interval(days => $1) from scanned order by id desc limit 1), true) as reached_window`,
  ),

  /** Settlement events no unnamed handler took within $1 days (pg-boss's retention of a job never taken,
   * as when they were jobs), as pruneAdminAudit: ids and insert times grow together. One taken before is
   * counted from when it was last due (not_before, after a failure) or its last delivery's lease ends (so
   * one a delivery holds is left to it, and one that died with its process comes back alone): it is
   * retried until delivered or dead-lettered, where it can be redriven, unless no handler takes it for as
   * long. */
  pruneSettlementOutbox: statement<[retentionDays: number, afterId: number, scan: number]>(
    'outboxd_prune_settlement_outbox',
    `with scanned as (
       select id, created_at from ${s}.settlement_outbox where id > $2 order by id limit $3
     ), gone as (
       delete from ${s}.settlement_outbox o
       where ${byIds('o', `array(select sc.id from scanned sc where sc.created_at < now() - make_interval(days => $1))`)}
         and greatest(o.not_before, o.leased_until) < now() - make_interval(days => $1)
       returning o.id
     )
     select (select max(id) from scanned) as last_id, (select count(*)::int from gone) as deleted,
       coalesce((select created_at >= now() - make_interval(days => $1) from scanned order by id desc limit 1), true) as reached_window`,
  ),

  /** Stored webhook events are kept for deduplication and evidence, not forever: the $2 oldest received
   * over $1 days ago, read through their index by arrival (drizzle/0025), but those of an operation
   * unsettled or held for review, the evidence a person decides by (as its timeline is kept); those few
   * are read past at each batch. Their ids are Stripe's, in no order. */
  pruneWebhookEvents: statement<[retentionDays: number, scan: number]>(
    'outboxd_prune_webhook_events',
    `with gone as (
       delete from ${s}.webhook_events where id = any(array(
         select w.id from ${s}.webhook_events w
         where w.received_at < now() - make_interval(days => $1)
           and not exists (select 1 from ${s}.payment_operations o
                           where o.id = w.operation_id and (o.${UNSETTLED} or o.review_reason is not null))
         order by w.received_at limit $2))
       returning 1
     )
     select count(*)::int as deleted from gone`,
  ),

  /** A transactional subscriber's consumption of an event is kept while another copy of the event may
   * still reach it: the $2 oldest made over $1 days ago, read through their index (drizzle/0027), deleted
   * where they lie (a row is never updated, so it does not move). */
  pruneSettlementConsumption: statement<[retentionDays: number, scan: number]>(
    'outboxd_prune_settlement_consumption',
    deleteOldest(s, 'settlement_consumption', 'ctid', 'consumed_at'),
  ),

  /** Up to $2 connected accounts' buckets (`<budget>@acct_…`) untouched for $1 hours, one per account
   * ever charged through: one idle that long is full, and comes back empty when next used
   * (ensureRateBudget), which costs its first call a token's wait. The platform's are kept. No index on
   * refilled_at, which every take updates: the table is read whole, one row per account. */
  pruneRateBudgets: statement<[idleHours: number, scan: number]>(
    'outboxd_prune_rate_budgets',
    `with gone as (
       delete from ${s}.rate_budgets where name = any(array(
         select name from ${s}.rate_budgets
         where strpos(name, '@') > 0 and refilled_at < now() - make_interval(hours => $1) limit $2))
       and refilled_at < now() - make_interval(hours => $1)
       returning 1
     )
     select count(*)::int as deleted from gone`,
  ),
});
