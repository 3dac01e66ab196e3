// The reconcile sweep: settles what idempotency keys can no longer settle. Operations past the key
// window are looked up through Search (all pages), operations with a known charge are retrieved;
// operations inside the window are left to the dispatcher. It never creates a charge, and it claims
// each operation with a lease and fence like any worker, so it can run beside the dispatchers.
import type { Pool } from '../db/pool.ts';
import type { Logger } from '../log.ts';
import { executeCharge, KEY_WINDOW_SECONDS } from '../payments/executor.ts';
import type { PaymentGateway } from '../payments/gateway.ts';
import { claimOperation, releaseLease, StaleFenceError, type Operation } from '../payments/operation.ts';

export interface SweepDecision {
  operationId: string;
  call: 'retrieve' | 'search' | null;
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
  decisions: SweepDecision[];
}

export async function reconcileSweep(
  pool: Pool,
  gateway: PaymentGateway,
  opts: { owner: string; leaseTtlMs: number; log: Logger; limit?: number; keyWindowSeconds?: number },
): Promise<SweepReport> {
  const keyWindowSeconds = opts.keyWindowSeconds ?? KEY_WINDOW_SECONDS;
  const { rows } = await pool.query(pool.sql.reconcileCandidates(keyWindowSeconds, opts.limit ?? 500));
  const report: SweepReport = { examined: rows.length, settled: 0, needsReview: 0, skipped: 0, decisions: [] };
  for (const { id } of rows as { id: string }[]) {
    const lease = await claimOperation(pool, id, opts.owner, opts.leaseTtlMs, keyWindowSeconds);
    if (!lease) {
      report.skipped++; // settled or claimed since the candidates were read
      continue;
    }
    const log = opts.log.child({ operationId: id, fence: lease.fence });
    try {
      const run = await executeCharge(pool, gateway, id, lease.fence, { keyWindowSeconds, claimed: lease.operation, allowCreate: false, source: 'reconcile', log });
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
  }
  return report;
}
