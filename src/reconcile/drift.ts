// The drift report: Stripe (the gateway's lists of charges and refunds) against our operations. Drift is
// money that moved without a succeeded operation to show for it, or a succeeded operation without its
// money.
import type { Pool } from '../db/pool.ts';
import type { Charge, PaymentGateway, Refund } from '../payments/gateway.ts';
import { isOperationId, type Operation } from '../payments/operation.ts';
import { inBackground } from '../stripe/budgetedGateway.ts';
import type { RefundPayload } from '../payments/refund.ts';

export type DriftKind =
  /** A charge whose metadata names no operation of ours. */
  | 'orphan_charge'
  /** More than one succeeded charge carries the same operation id. */
  | 'duplicate_charge'
  /** A succeeded charge for an operation that is not succeeded (failed, unknown or pending). */
  | 'charged_not_succeeded'
  /** The operation's charge has another amount or currency. */
  | 'amount_mismatch'
  /** A succeeded operation whose charge is not among Stripe's charges. */
  | 'missing_charge'
  /** A refund that names no refund operation of ours, or none at all while it refunds one of our charges. */
  | 'orphan_refund'
  /** More than one refund that has not failed carries the same operation id. */
  | 'duplicate_refund'
  /** A succeeded refund for an operation that is not succeeded. */
  | 'refunded_not_succeeded'
  /** A succeeded refund operation whose refund has not succeeded, or is not found. */
  | 'missing_refund';

export interface Drift {
  kind: DriftKind;
  operationId: string | null;
  chargeIds: string[];
  detail: string;
}

export interface DriftReport {
  since: string;
  charges: number;
  refunds: number;
  operations: number;
  drift: Drift[];
}

export async function driftReport(pool: Pool, budgeted: PaymentGateway, since: Date): Promise<DriftReport> {
  // A report yields to the dispatchers in the fleet's Stripe budget.
  const gateway = inBackground(budgeted);
  const charges = (await gateway.listCharges(since)).filter((c) => c.operationId !== undefined);
  const refunds = await gateway.listRefunds(since);
  const ids = [...new Set([...charges, ...refunds].flatMap((c) => (c.operationId === undefined ? [] : [c.operationId])))].filter(isOperationId);
  const referenced: Operation[] = (await pool.query(pool.sql.operationsByIds(ids))).rows;
  const succeededOps: Operation[] = (await pool.query(pool.sql.succeededSince(since))).rows;
  const ops = new Map([...referenced, ...succeededOps].map((o) => [o.id, o]));
  const drift: Drift[] = [];
  const succeeded = succeededOps.filter((o) => o.kind === 'charge');

  const byOperation = new Map<string, Charge[]>();
  for (const c of charges) byOperation.set(c.operationId!, [...(byOperation.get(c.operationId!) ?? []), c]);

  for (const [operationId, list] of byOperation) {
    const found = ops.get(operationId);
    const op = found?.kind === 'charge' ? found : undefined;
    const paid = list.filter((c) => c.status === 'succeeded');
    if (!op) {
      drift.push({ kind: 'orphan_charge', operationId, chargeIds: list.map((c) => c.id), detail: 'no operation with this id' });
      continue;
    }
    if (paid.length > 1) {
      drift.push({ kind: 'duplicate_charge', operationId, chargeIds: paid.map((c) => c.id), detail: `${paid.length} succeeded charges for one operation` });
    }
    if (paid.length > 0 && op.status !== 'succeeded') {
      drift.push({ kind: 'charged_not_succeeded', operationId, chargeIds: paid.map((c) => c.id), detail: `operation is ${op.status}` });
    }
    for (const c of list) {
      if (c.amount !== op.amount || c.currency !== op.currency) {
        drift.push({ kind: 'amount_mismatch', operationId, chargeIds: [c.id], detail: `charge ${c.amount} ${c.currency}, operation ${op.amount} ${op.currency}` });
      }
    }
  }
  const listed = new Set(charges.map((c) => c.id));
  for (const op of succeeded) {
    if (!op.external_id || !listed.has(op.external_id)) {
      // It may predate `since`: retrieve it before calling it missing.
      const found = op.external_id ? await gateway.retrieveCharge(op.external_id).catch(() => undefined) : undefined;
      if (!found || found.status !== 'succeeded') {
        drift.push({ kind: 'missing_charge', operationId: op.id, chargeIds: op.external_id ? [op.external_id] : [], detail: found ? `charge is ${found.status}` : 'charge not found' });
      }
    }
  }
  drift.push(...(await refundDrift(pool, gateway, refunds, ops, succeededOps.filter((o) => o.kind === 'refund'))));
  return { since: since.toISOString(), charges: charges.length, refunds: refunds.length, operations: ops.size, drift };
}

/** The refunds' side: each refund with its operation, each succeeded refund operation with its refund. */
async function refundDrift(pool: Pool, gateway: PaymentGateway, refunds: Refund[], ops: Map<string, Operation>, succeeded: Operation[]): Promise<Drift[]> {
  const drift: Drift[] = [];
  // A refund made outside outboxd (the dashboard) names no operation: drift only when it takes money back
  // from one of our charges, whose unrefunded amount outboxd would otherwise misjudge.
  const anonymous = refunds.filter((r) => r.operationId === undefined && r.paymentIntent !== null);
  const ours: Operation[] = anonymous.length ? (await pool.query(pool.sql.chargeOperationsByExternalIds(anonymous.map((r) => r.paymentIntent!)))).rows : [];
  for (const r of anonymous) {
    const charge = ours.find((o) => o.external_id === r.paymentIntent);
    if (charge) drift.push({ kind: 'orphan_refund', operationId: null, chargeIds: [r.id], detail: `refunds ${r.amount} ${r.currency} of charge operation ${charge.id} without naming a refund operation` });
  }
  const byOperation = new Map<string, Refund[]>();
  for (const r of refunds) if (r.operationId !== undefined) byOperation.set(r.operationId, [...(byOperation.get(r.operationId) ?? []), r]);
  for (const [operationId, list] of byOperation) {
    const op = ops.get(operationId);
    if (op?.kind !== 'refund') {
      drift.push({ kind: 'orphan_refund', operationId, chargeIds: list.map((r) => r.id), detail: op ? `names a ${op.kind} operation` : 'no operation with this id' });
      continue;
    }
    const live = list.filter((r) => r.status !== 'failed' && r.status !== 'canceled');
    if (live.length > 1) drift.push({ kind: 'duplicate_refund', operationId, chargeIds: live.map((r) => r.id), detail: `${live.length} refunds for one operation` });
    const done = list.filter((r) => r.status === 'succeeded');
    if (done.length > 0 && op.status !== 'succeeded') drift.push({ kind: 'refunded_not_succeeded', operationId, chargeIds: done.map((r) => r.id), detail: `operation is ${op.status}` });
    for (const r of list) {
      if (r.amount !== op.amount || r.currency !== op.currency || r.paymentIntent !== (op.payload as RefundPayload).payment_intent) {
        drift.push({ kind: 'amount_mismatch', operationId, chargeIds: [r.id], detail: `refund ${r.amount} ${r.currency} of ${r.paymentIntent}, operation ${op.amount} ${op.currency}` });
      }
    }
  }
  const listed = new Map(refunds.map((r) => [r.id, r]));
  for (const op of succeeded) {
    // It may predate `since`: retrieve it before calling it missing.
    const found = op.external_id ? (listed.get(op.external_id) ?? (await gateway.retrieveRefund(op.external_id).catch(() => undefined))) : undefined;
    if (!found || found.status !== 'succeeded') {
      drift.push({ kind: 'missing_refund', operationId: op.id, chargeIds: op.external_id ? [op.external_id] : [], detail: found ? `refund is ${found.status}` : 'refund not found' });
    }
  }
  return drift;
}
