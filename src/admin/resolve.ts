// A person settles an operation held for review, after checking Stripe. The evidence is checked
// again here before anything is written: a succeeded resolution must name a charge that exists, carries
// this operation's id, amount and currency, and succeeded; a failed one must not contradict a
// succeeded charge that Stripe can find.
import { inTransaction, type Pool } from '../db/pool.ts';
import { ValidationError } from '../orders/validate.ts';
import type { PaymentGateway } from '../payments/gateway.ts';
import { isSettled, settleFromOutside, type Operation } from '../payments/operation.ts';
import { recordAudit } from './audit.ts';
import { showOperation } from './operations.ts';

export type Resolution = { outcome: 'succeeded'; externalId: string } | { outcome: 'failed'; reason: string };

export class ResolutionRefused extends Error {
  override name = 'ResolutionRefused';
}

export async function resolveOperation(
  pool: Pool,
  gateway: PaymentGateway,
  id: string,
  resolution: Resolution,
  actor: string,
): Promise<Operation> {
  if (!actor.trim()) throw new ValidationError('actor', 'who resolves must be named');
  const op = await showOperation(pool, id);
  if (isSettled(op.status)) throw new ResolutionRefused(`operation ${op.id} is already ${op.status}; a settled operation is never overwritten`);

  let evidence: Record<string, unknown>;
  if (resolution.outcome === 'succeeded') {
    if (!/^pi_\w+$/.test(resolution.externalId)) throw new ValidationError('externalId', 'must be a PaymentIntent id (pi_…)');
    const charge = await gateway.retrieveCharge(resolution.externalId);
    if (charge.operationId !== op.id) throw new ResolutionRefused(`${charge.id} belongs to operation ${charge.operationId ?? '(none)'}, not ${op.id}`);
    if (charge.amount !== op.amount || charge.currency !== op.currency) {
      throw new ResolutionRefused(`${charge.id} is ${charge.amount} ${charge.currency}; the operation is ${op.amount} ${op.currency}`);
    }
    if (charge.status !== 'succeeded') throw new ResolutionRefused(`${charge.id} is ${charge.status}, not succeeded`);
    evidence = { charge };
  } else {
    if (!resolution.reason.trim()) throw new ValidationError('reason', 'a failed resolution needs the reason');
    const paid = (await gateway.findCharges(op.id)).filter((c) => c.status === 'succeeded');
    if (paid.length > 0) throw new ResolutionRefused(`Stripe shows succeeded charges for this operation: ${paid.map((c) => c.id).join(', ')}`);
    evidence = { reason: resolution.reason, searchedSucceededCharges: 0 };
  }

  return inTransaction(pool, async (tx) => {
    const externalId = resolution.outcome === 'succeeded' ? resolution.externalId : null;
    const reason = resolution.outcome === 'failed' ? `resolved by ${actor}: ${resolution.reason}` : null;
    const settled = await settleFromOutside(tx, op.id, resolution.outcome, externalId, 'resolved_by_admin', reason);
    if (!settled) throw new ResolutionRefused(`operation ${op.id} settled while it was being resolved`);
    await recordAudit(tx, {
      actor,
      action: 'resolve',
      operationId: op.id,
      details: { outcome: resolution.outcome, previousStatus: op.status, reviewReason: op.review_reason, evidence },
    });
    return settled;
  });
}
