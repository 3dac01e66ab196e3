// The drift report: Stripe (the gateway's list of charges) against our operations. Drift is money that
// moved without a succeeded operation to show for it, or a succeeded operation without its money.
import type { Pool } from '../db/pool.ts';
import type { Charge, PaymentGateway } from '../payments/gateway.ts';
import { isOperationId, type Operation } from '../payments/operation.ts';
import { inBackground } from '../stripe/budgetedGateway.ts';

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
  | 'missing_charge';

export interface Drift {
  kind: DriftKind;
  operationId: string | null;
  chargeIds: string[];
  detail: string;
}

export interface DriftReport {
  since: string;
  charges: number;
  operations: number;
  drift: Drift[];
}

export async function driftReport(pool: Pool, budgeted: PaymentGateway, since: Date): Promise<DriftReport> {
  // A report yields to the dispatchers in the fleet's Stripe budget.
  const gateway = inBackground(budgeted);
  const charges = (await gateway.listCharges(since)).filter((c) => c.operationId !== undefined);
  const ids = [...new Set(charges.map((c) => c.operationId!))].filter(isOperationId);
  const referenced: Operation[] = (await pool.query(pool.sql.operationsByIds(ids))).rows;
  const succeeded: Operation[] = (await pool.query(pool.sql.succeededSince(since))).rows;
  const ops = new Map([...referenced, ...succeeded].map((o) => [o.id, o]));
  const drift: Drift[] = [];

  const byOperation = new Map<string, Charge[]>();
  for (const c of charges) byOperation.set(c.operationId!, [...(byOperation.get(c.operationId!) ?? []), c]);

  for (const [operationId, list] of byOperation) {
    const op = ops.get(operationId);
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
  return { since: since.toISOString(), charges: charges.length, operations: ops.size, drift };
}
