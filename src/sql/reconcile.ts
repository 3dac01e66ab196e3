// The statements of reconciliation (src/reconcile/): the sweep's candidates and the drift report's reads.
import { DEAD_LETTER_SUFFIX } from '../types/contracts.ts';
import type { SqlContext } from './context.ts';

export const reconcileStatements = ({ UNSETTLED, operationColumns, s, statement, undriven }: SqlContext) => ({
  /** What the reconcile sweep may decide, of the kinds it reconciles through the provider ($3): a known
   * object to retrieve, a key window that has passed, or an operation held for review after an attempt
   * that may have acted (searched read-only inside the window too: a dead-lettered job drives it no
   * more). Other operations inside the window without an external id are the dispatcher's, leased
   * ones are busy, and a payment waiting on `processing` (next_check_at) is its job's, on its schedule,
   * unless held for review (its job was lost, say). */
  reconcileCandidates: statement<[keyWindowSeconds: number, limit: number, kinds: readonly string[]]>(
    'outboxd_reconcile_candidates',
    `select id from ${s}.payment_operations
     where ${UNSETTLED} and kind = any($3::text[])
       and (external_id is not null
            or first_attempted_at < now() - make_interval(secs => $1)
            or (review_reason is not null and first_attempted_at is not null))
       and (lease_expires_at is null or lease_expires_at < now())
       and (next_check_at is null or review_reason is not null)
     order by updated_at
     limit $2`,
  ),

  /** Unsettled, unflagged operations of any kind untouched for a while, or read by this sweep ($3: its own
   * writes touch them, every sweep), that nothing drives, not even a job in their kind's dead letter
   * (src/types/contracts.ts: DEAD_LETTER_SUFFIX): the sweep claims each, checks again for a live job, and
   * flags one that nothing drives. */
  undrivenCandidates: statement<[idleSeconds: number, limit: number, readBySweep: string[]]>(
    'outboxd_undriven_candidates',
    `select id from ${s}.payment_operations op
     where ${UNSETTLED} and review_reason is null
       and (updated_at < now() - make_interval(secs => $1) or id = any($3::uuid[]))
       and ${undriven('op', `op.kind, op.kind || '${DEAD_LETTER_SUFFIX}'`)}
     order by updated_at
     limit $2`,
  ),

  operationsByIds: statement<[ids: string[]]>(
    'outboxd_operations_by_ids',
    `select ${operationColumns()} from ${s}.payment_operations where id = any($1::uuid[])`,
  ),

  /** Operations of a kind known to the provider by these ids (the drift report's refunds of our charges). */
  operationsByExternalIds: statement<[kind: string, externalIds: string[]]>(
    'outboxd_operations_by_external_ids',
    `select ${operationColumns()} from ${s}.payment_operations where kind = $1 and external_id = any($2::text[])`,
  ),

  /** Succeeded operations of a kind settled since a time, $5 after ($3, $4) in (settled_at, id) order,
   * each with its settled_at as text (to the microsecond, the next page's cursor): each must have its
   * charge (refund) in Stripe. Of the kinds Stripe knows only: an application's
   * effects, with payloads and results of up to 64 KiB, are compared with nothing there. */
  succeededSince: statement<[since: Date, kind: string, afterSettledAt: string | null, afterId: string | null, limit: number]>(
    'outboxd_succeeded_since',
    `select ${operationColumns('o')}, o.settled_at::text as cursor_settled_at from ${s}.payment_operations o
     where o.status = 'succeeded' and o.kind = $2 and o.settled_at >= $1
       and ($3::timestamptz is null or (o.settled_at >= $3::timestamptz and (o.settled_at, o.id) > ($3::timestamptz, $4::uuid)))
     order by o.settled_at, o.id
     limit $5`,
  ),
});
