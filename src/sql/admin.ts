// The statements of the admin API and the CLI (src/admin/): listings, the audit trail, requeue and resolve.
import { OPERATION_STATUSES } from '../types/status.ts';
import type { SqlContext } from './context.ts';

export const adminStatements = ({ UNSETTLED, briefColumns, operationColumns, s, statement, undriven }: SqlContext) => {
  /**
   * A page of the ledger (the admin API's and `ops list`'s listings), read in pages of indexes however
   * large the ledger, never the whole table sorted: a range of payment_operations_list_idx per kind and
   * status, merged, the kinds found by descending that index once each (a loose index scan); the review
   * queue by its own index. $1 a status, or null for every one; $2 the page's size.
   */
  const listPage = (dir: 'asc' | 'desc', review: boolean) =>
    review
      ? `select ${briefColumns()} from ${s}.payment_operations
         where review_reason is not null and ($1::text is null or status = $1)
         order by created_at ${dir}, id ${dir}
         limit $2`
      : `with recursive kinds(kind) as (
           (select kind from ${s}.payment_operations order by kind limit 1)
           union all
           select (select p.kind from ${s}.payment_operations p where p.kind > k.kind order by p.kind limit 1)
           from kinds k where k.kind is not null
         )
         select o.* from kinds k
         cross join unnest(case when $1::text is null then array[${OPERATION_STATUSES.map((st) => `'${st}'`).join(', ')}] else array[$1::text] end) st(status)
         cross join lateral (
           select ${briefColumns('p')} from ${s}.payment_operations p
           where p.kind = k.kind and p.status = st.status
           order by p.created_at ${dir}, p.id ${dir}
           limit $2
         ) o
         order by o.created_at ${dir}, o.id ${dir}
         limit $2`;
  return {
  /** How long ago the last create that may have executed was sent, by the database clock (null: never). */
  lastAttemptAge: statement<[id: string]>(
    'outboxd_last_attempt_age',
    `select extract(epoch from now() - coalesce(last_attempted_at, first_attempted_at))::float8 as age_seconds
     from ${s}.payment_operations where id = $1`,
  ),

  insertAudit: statement<[actor: string, action: string, operationId: string | null, details: string]>(
    'outboxd_insert_audit',
    `insert into ${s}.admin_audit (actor, action, operation_id, details) values ($1, $2, $3, $4::jsonb) returning id`,
  ),

  /** Serialises admin re-drives of one operation (check for a live job, then enqueue). */
  lockOperationForRequeue: statement<[id: string]>(
    'outboxd_lock_operation_for_requeue',
    `select pg_advisory_xact_lock(hashtextextended('outboxd-requeue:' || $1, 0))`,
  ),

  /** Unsettled operations untouched for a while that nothing drives (no live lease, nothing in the
   * outbox, no live job in their kind's queue): candidates for `requeue --stuck`, which checks each
   * again under its lock. Those driven are left out here, not after the limit: a thousand waiting quietly
   * (payments processing for days, their next check hours away) hid every stuck one behind them. */
  stuckOperations: statement<[olderThanSeconds: number, limit: number]>(
    'outboxd_stuck_operations',
    `select ${operationColumns('op')} from ${s}.payment_operations op
     where ${UNSETTLED} and updated_at < now() - make_interval(secs => $1) and ${undriven('op', 'op.kind')}
     order by updated_at
     limit $2`,
  ),

  /** A page of the ledger, oldest first, of every status or one (null: every). */
  listOperations: statement<[status: string | null, limit: number]>('outboxd_list_operations', listPage('asc', false)),
  /** listOperations' newest first: what an operator looking at a busy ledger wants to see. */
  listOperationsNewest: statement<[status: string | null, limit: number]>('outboxd_list_operations_newest', listPage('desc', false)),
  /** A page of the review queue, oldest first, of every status or one. */
  listReview: statement<[status: string | null, limit: number]>('outboxd_list_review', listPage('asc', true)),
  listReviewNewest: statement<[status: string | null, limit: number]>('outboxd_list_review_newest', listPage('desc', true)),

  showOperation: statement<[id: string]>(
    'outboxd_show_operation',
    `select ${operationColumns()} from ${s}.payment_operations where id = $1`,
  ),

  /** Operations whose id begins with a prefix (hex digits, dashes ignored): the short ids people copy.
   * A range of the primary key (uuids order as their hex digits), not a scan of the table. */
  operationsByIdPrefix: statement<[hexPrefix: string, limit: number]>(
    'outboxd_operations_by_id_prefix',
    `select ${operationColumns()} from ${s}.payment_operations
     where id between rpad($1, 32, '0')::uuid and rpad($1, 32, 'f')::uuid
     order by id limit $2`,
  ),

  /** The newest audit entries, of one operation or of all, returned oldest first. */
  listAudit: statement<[operationId: string | null, limit: number]>(
    'outboxd_list_audit',
    `select * from (
       select id, at, actor, action, operation_id, details from ${s}.admin_audit
       where $1::uuid is null or operation_id = $1
       order by at desc, id desc
       limit $2
     ) newest
     order by at, id`,
  ),
};
};
