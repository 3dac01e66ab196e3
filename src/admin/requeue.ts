// Re-drive of stuck operations. A requeue only ever enqueues a new job for the SAME operation, so it
// is driven with the same idempotency key and cannot create a second effect (invariant 10).
import type { PgBoss } from 'pg-boss';
import { bossDb, inTransaction, type Pool } from '../db/pool.ts';
import { enqueueOperation, liveJobFor, queueFor } from '../outbox/outbox.ts';
import type { Operation } from '../engine/operation.ts';
import { traceOperation, withSpan } from '../telemetry/tracing.ts';
import { recordAudit } from './audit.ts';
import { showOperation } from './operations.ts';

export type RequeueResult =
  | { operationId: string; result: 'requeued'; jobId: string | null }
  | { operationId: string; result: 'would_requeue' }
  | { operationId: string; result: 'skipped'; reason: string }
  | { operationId: string; result: 'refused'; reason: string };

/** In a span whose trace the new job is processed in (pg-boss propagates it), linked to the operation's. */
export function requeueOperation(
  pool: Pool,
  boss: PgBoss,
  id: string,
  opts: { actor: string; dryRun?: boolean },
): Promise<RequeueResult> {
  return withSpan('outboxd.requeue', { 'outboxd.actor': opts.actor }, async (span) => {
    const result = await requeue(pool, boss, id, opts);
    span.setAttribute('outboxd.requeue.result', result.result);
    return result;
  });
}

async function requeue(pool: Pool, boss: PgBoss, id: string, opts: { actor: string; dryRun?: boolean }): Promise<RequeueResult> {
  const result = await decide(pool, boss, id, opts);
  // A person's requeue that did nothing is on the record too, with why.
  if (!opts.dryRun && (result.result === 'skipped' || result.result === 'refused')) {
    await recordAudit(pool, { actor: opts.actor, action: 'requeue_refused', operationId: result.operationId, details: { result: result.result, reason: result.reason } });
  }
  return result;
}

async function decide(pool: Pool, boss: PgBoss, id: string, opts: { actor: string; dryRun?: boolean }): Promise<RequeueResult> {
  const op = await showOperation(pool, id);
  traceOperation(op);
  return inTransaction(pool, async (tx) => {
    // One requeue of an operation at a time: the check for a live job and the enqueue are one step.
    await tx.query(tx.sql.lockOperationForRequeue(op.id));
    const { rows } = await tx.query(tx.sql.showOperation(op.id));
    const current: Operation = rows[0];
    if (current.status === 'succeeded' || current.status === 'failed') {
      return { operationId: op.id, result: 'refused', reason: `operation is ${current.status}` };
    }
    if (current.lease_expires_at && current.lease_expires_at > new Date()) {
      return { operationId: op.id, result: 'skipped', reason: `leased by ${current.lease_owner} until ${current.lease_expires_at.toISOString()}` };
    }
    const { rows: waiting } = await tx.query(tx.sql.outboxRowFor(op.id));
    if (waiting[0]) return { operationId: op.id, result: 'skipped', reason: 'waiting in the outbox to be relayed' };
    const live = await liveJobFor(tx, op.id, [queueFor(current.kind)]);
    if (live) return { operationId: op.id, result: 'skipped', reason: `job ${live.id} is ${live.state}` };
    if (opts.dryRun) return { operationId: op.id, result: 'would_requeue' };
    const jobId = await enqueueOperation(boss, bossDb(tx), current);
    await recordAudit(tx, {
      actor: opts.actor,
      action: 'requeue',
      operationId: op.id,
      details: { jobId, status: current.status },
    });
    return { operationId: op.id, result: 'requeued', jobId };
  });
}

/** Every unsettled operation untouched for `olderThanSeconds` that has no live job or lease. */
export async function requeueStuck(
  pool: Pool,
  boss: PgBoss,
  opts: { actor: string; olderThanSeconds: number; dryRun?: boolean; limit?: number },
): Promise<RequeueResult[]> {
  const { rows } = await pool.query(pool.sql.stuckOperations(opts.olderThanSeconds, opts.limit ?? 1000));
  const results: RequeueResult[] = [];
  for (const op of rows as Operation[]) {
    const result = await requeueOperation(pool, boss, op.id, opts);
    // Settled since it was listed: nothing to requeue, and nothing the operator asked amiss.
    results.push(result.result === 'refused' ? { operationId: op.id, result: 'skipped', reason: `settled since it was listed (${result.reason})` } : result);
  }
  return results;
}
