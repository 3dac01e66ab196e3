import type { Pool } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import { reconcileSweep, type SweepReport } from '../reconcile/sweep.ts';
import { recordAudit } from './audit.ts';

/** A sweep a person asked for (CLI or admin API), recorded in the audit trail. */
export async function reconcileNow(
  pool: Pool,
  gateway: PaymentGateway,
  opts: { actor: string; owner: string; leaseTtlMs: number; log: Logger; processingReviewDays?: number },
): Promise<SweepReport> {
  const { actor: _actor, ...sweep } = opts;
  let report: SweepReport | undefined;
  let failure: string | undefined;
  try {
    report = await reconcileSweep(pool, gateway, sweep);
    return report;
  } catch (err) {
    failure = (err as Error).message;
    throw err;
  } finally {
    // Whatever it did, recorded once it ends, a sweep that failed part way too (what it settled before is
    // on each operation's timeline).
    const details = report
      ? {
          examined: report.examined,
          settled: report.settled,
          needsReview: report.needsReview,
          undriven: report.undriven,
          followedUp: report.followedUp,
          decisions: report.decisions.map((d) => ({ operationId: d.operationId, to: d.to, outcome: d.outcome, evidence: d.evidence })),
        }
      : { failed: failure };
    await recordAudit(pool, { actor: opts.actor, action: 'reconcile', operationId: null, details });
  }
}
