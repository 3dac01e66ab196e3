// The reconcile sweep: settles what idempotency keys can no longer settle, for the kinds whose policy is
// idempotent-key (src/engine/kinds.ts: reconciled). Operations past the key window, and operations held for
// review after an attempt that may have acted, are looked up at the provider (Search for charges: all
// pages, a single match is then retrieved); operations with a known external object are retrieved;
// other operations inside the window are left to the dispatcher. It never creates, and it claims each
// operation with a lease and fence like any worker, so it can run beside the dispatchers.
// Then it looks again at settled operations whose object Stripe changed by now (an authorization past
// its capture_before: released; or one whose capture or cancel failed: changed in the dashboard), for
// what the kind records of it (KindEvidence.followUp), in case no webhook told. Last, it flags any unsettled operation of any kind that no job drives any more (a
// dead-letter handler that kept failing, a job lost by hand): never neither driven nor flagged.
import { inTransaction, type Pool } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';
import type { EffectCall } from '../engine/kinds.ts';
import { evidenceOf, kindsFor } from '../kinds/index.ts';
import { deadQueueFor, liveJobFor, queueFor } from '../outbox/outbox.ts';
import { executeOperation, KEY_WINDOW_SECONDS } from '../engine/executor.ts';
import { accountOf, type PaymentGateway } from '../stripe/gateway.ts';
import { claimOperation, flagForReview, releaseLease, StaleFenceError, type Operation } from '../engine/operation.ts';
import { inBackground } from '../stripe/budgetedGateway.ts';
import { ATTR, traceOperation, withSpan } from '../telemetry/tracing.ts';

/** An unsettled operation untouched this long, with no lease, outbox row or live job, is flagged. */
export const UNDRIVEN_AFTER_SECONDS = 15 * 60;

export interface SweepDecision {
  operationId: string;
  call: Exclude<EffectCall, 'create'> | null;
  from: string;
  to: string;
  outcome: string | null;
  evidence: string | null;
  externalId: string | null;
}

export interface SweepReport {
  examined: number;
  settled: number;
  needsReview: number;
  skipped: number;
  /** Operations flagged because no job drove them. */
  undriven: string[];
  /** Settled operations whose object changed by itself, recorded (an authorization's release). */
  followedUp: string[];
  decisions: SweepDecision[];
}

export interface SweepOptions {
  owner: string;
  leaseTtlMs: number;
  log: Logger;
  limit?: number;
  keyWindowSeconds?: number;
  undrivenAfterSeconds?: number;
  /** PROCESSING_REVIEW_DAYS (src/engine/processing.ts). */
  processingReviewDays?: number;
}

export async function reconcileSweep(pool: Pool, gateway: PaymentGateway, opts: SweepOptions): Promise<SweepReport> {
  const keyWindowSeconds = opts.keyWindowSeconds ?? KEY_WINDOW_SECONDS;
  // Reconciliation yields to the dispatchers in the fleet's Stripe budget. Once the budget (or Stripe's
  // 429) turns a call away, the rest waits for the next sweep instead of each candidate waiting in turn.
  const kinds = kindsFor(inBackground(gateway));
  const { rows } = await pool.query(pool.sql.reconcileCandidates(keyWindowSeconds, opts.limit ?? 500, kinds.reconciled));
  const report: SweepReport = { examined: rows.length, settled: 0, needsReview: 0, skipped: 0, undriven: [], followedUp: [], decisions: [] };
  let rateLimited = false;
  // Connected accounts whose own limit turned a call away: the rest of theirs waits for the next sweep,
  // the platform's and other accounts' go on. One object another request held (lock_timeout) stops nothing.
  const busyAccounts = new Set<string>();
  const sweepOne = (id: string) => withSpan('outboxd.reconcile', { [ATTR.operationId]: id }, async () => {
    // Read before any claim, which its timeline would record.
    if (busyAccounts.size && busyAccounts.has(accountOf((await pool.query(pool.sql.showOperation(id))).rows[0] ?? { payload: null }) ?? '')) {
      report.skipped++;
      return;
    }
    const lease = await claimOperation(pool, id, opts.owner, opts.leaseTtlMs, keyWindowSeconds);
    if (!lease) {
      report.skipped++; // settled or claimed since the candidates were read
      return;
    }
    traceOperation(lease.operation, lease.fence);
    const log = opts.log.child({ operationId: id, kind: lease.operation.kind, fence: lease.fence });
    try {
      const review = opts.processingReviewDays !== undefined ? { processingReviewDays: opts.processingReviewDays } : {};
      const run = await executeOperation(pool, kinds, id, lease.fence, { keyWindowSeconds, claimed: lease.operation, allowCreate: false, source: 'reconcile', log, ...review });
      if (run.outcome?.kind === 'rate_limited' && !run.outcome.objectBusy) {
        if (run.outcome.account) busyAccounts.add(run.outcome.account);
        else rateLimited = true;
      }
      const op: Operation = run.operation;
      const decision: SweepDecision = {
        operationId: id,
        call: run.call === 'create' ? null : run.call,
        from: run.from,
        to: op.status,
        outcome: run.outcome?.kind ?? null,
        evidence: run.outcome && 'reason' in run.outcome ? run.outcome.reason : null,
        externalId: op.external_id,
      };
      report.decisions.push(decision);
      if (op.status === 'succeeded' || op.status === 'failed') report.settled++;
      else if (op.needs_review) report.needsReview++;
      log.info({ decision }, 'reconcile decision');
    } catch (err) {
      report.skipped++;
      if (!(err instanceof StaleFenceError)) log.error({ err }, 'reconcile failed for this operation');
    } finally {
      await releaseLease(pool, id, lease.fence).catch(() => {});
    }
  });
  for (const { id } of rows as { id: string }[]) {
    if (rateLimited) report.skipped++;
    else await sweepOne(id);
  }
  if (!rateLimited) report.followedUp = await followUp(pool, inBackground(gateway), opts);
  // An operation the sweep read and left unsettled counts as untouched: the sweep's own write of what it
  // read (a PaymentIntent still requires_action, say) must not keep one whose job was lost from the flag.
  const read = report.decisions.filter((d) => d.to !== 'succeeded' && d.to !== 'failed').map((d) => d.operationId);
  report.undriven = await flagUndriven(pool, opts, read);
  return report;
}

/** Each kind's settled operations to follow up, their objects retrieved (no transaction open) and handed to the
 * kind's followUp, each in a transaction of its own. A failed retrieve waits for the next sweep. */
async function followUp(pool: Pool, gateway: PaymentGateway, opts: SweepOptions): Promise<string[]> {
  const recorded: string[] = [];
  for (const { evidence } of evidenceOf(gateway)) {
    if (!evidence.toFollowUp || !evidence.followUp) continue;
    for (const op of await evidence.toFollowUp(pool, opts.limit ?? 500)) {
      const object = await evidence.retrieve(op.external_id!, accountOf(op)).catch((err: unknown) => opts.log.warn({ err, operationId: op.id }, 'retrieving an operation to follow up failed'));
      if (!object || evidence.mismatch(op, object)) continue;
      if (await inTransaction(pool, (tx) => evidence.followUp!(tx, op, object, 'reconcile'))) recorded.push(op.id);
    }
  }
  if (recorded.length) opts.log.info({ operations: recorded }, 'recorded what Stripe changed by itself');
  return recorded;
}

/** Flags unsettled operations that nothing drives. Each is claimed first, so no requeue or dispatcher
 * can start driving it between the check for a live job and the flag. */
async function flagUndriven(pool: Pool, opts: SweepOptions, readBySweep: string[]): Promise<string[]> {
  const idle = opts.undrivenAfterSeconds ?? UNDRIVEN_AFTER_SECONDS;
  const { rows } = await pool.query(pool.sql.undrivenCandidates(idle, opts.limit ?? 500, readBySweep));
  const flagged: string[] = [];
  for (const { id } of rows as { id: string }[]) {
    const lease = await claimOperation(pool, id, opts.owner, opts.leaseTtlMs, 0);
    if (!lease) continue;
    try {
      const { kind } = lease.operation;
      if (await liveJobFor(pool, id, [queueFor(kind), deadQueueFor(kind)])) continue;
      const reason = `no job drives this operation (its job ended without settling it, last error: ${lease.operation.last_error ?? 'none'}); requeue it (same key) or resolve it`;
      await flagForReview(pool, id, lease.fence, reason);
      flagged.push(id);
      opts.log.error({ operationId: id, reason }, 'operation needs review');
    } catch (err) {
      if (!(err instanceof StaleFenceError)) opts.log.error({ err, operationId: id }, 'checking for a job failed');
    } finally {
      await releaseLease(pool, id, lease.fence).catch(() => {});
    }
  }
  return flagged;
}
