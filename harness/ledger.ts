// The agreement check shared by the demo and chaos: the emulator's ledger is the truth about money,
// PaymentIntents for the charges and Refunds for the refunds.
import type { Pool } from '../src/db/pool.ts';
import { idempotencyKeyFor, refundIdempotencyKeyFor } from '../src/stripe/gateway.ts';
import type { Operation } from '../src/engine/operation.ts';
import type { StripeEmulator } from '../src/emulator/index.ts';

export interface Violation {
  kind:
    | 'double_charge'
    | 'failed_but_charged'
    | 'succeeded_without_charge'
    | 'amount_mismatch'
    | 'orphan_charge'
    | 'create_without_our_key'
    | 'double_refund'
    | 'failed_but_refunded'
    | 'succeeded_without_refund'
    | 'refund_without_operation'
    | 'over_refund';
  operationId: string | null;
  detail: string;
}

export interface Agreement {
  operations: Operation[];
  violations: Violation[];
  /** Succeeded charges per operation id. */
  paid: Map<string, number>;
}

export async function checkAgainstLedger(pool: Pool, emulator: StripeEmulator): Promise<Agreement> {
  const operations: Operation[] = (await pool.query(`select * from outboxd.payment_operations order by created_at, id`)).rows;
  const byId = new Map(operations.map((o) => [o.id, o]));
  const violations: Violation[] = [];
  const paid = new Map<string, number>();
  const ledger = emulator.ledger();
  for (const { paymentIntent: pi } of ledger) {
    const opId = pi.metadata.operation_id ?? null;
    const op = opId ? byId.get(opId) : undefined;
    if (op?.kind !== 'charge') {
      violations.push({ kind: 'orphan_charge', operationId: opId, detail: `${pi.id} (${pi.status}) names no charge operation` });
      continue;
    }
    if (pi.status !== 'succeeded') continue;
    paid.set(op.id, (paid.get(op.id) ?? 0) + 1);
    if (pi.amount !== op.amount || pi.currency !== op.currency) {
      violations.push({ kind: 'amount_mismatch', operationId: op.id, detail: `${pi.id} is ${pi.amount} ${pi.currency}, operation ${op.amount} ${op.currency}` });
    }
  }
  for (const op of operations.filter((o) => o.kind === 'charge')) {
    const n = paid.get(op.id) ?? 0;
    if (n > 1) violations.push({ kind: 'double_charge', operationId: op.id, detail: `${n} succeeded charges` });
    if (op.status === 'failed' && n > 0) violations.push({ kind: 'failed_but_charged', operationId: op.id, detail: `failed, but ${n} succeeded charge(s)` });
    if (op.status === 'succeeded') {
      const charge = ledger.find((l) => l.paymentIntent.id === op.external_id)?.paymentIntent;
      if (!charge || charge.status !== 'succeeded') {
        violations.push({ kind: 'succeeded_without_charge', operationId: op.id, detail: `external_id ${op.external_id} is ${charge?.status ?? 'not in the ledger'}` });
      }
    }
  }
  violations.push(...refundViolations(emulator, byId));
  for (const r of emulator.requests()) {
    const expected = r.endpoint === 'create' ? idempotencyKeyFor : r.endpoint === 'create_refund' ? refundIdempotencyKeyFor : undefined;
    if (expected && r.operationId && r.idempotencyKey !== expected(r.operationId)) {
      violations.push({ kind: 'create_without_our_key', operationId: r.operationId, detail: `${r.endpoint} ${r.requestId} with key ${r.idempotencyKey}` });
    }
  }
  return { operations, violations, paid };
}

/** No refund without its operation, no operation refunded twice, a succeeded refund operation ⇔ a
 * succeeded refund, and never more refunded than charged. */
function refundViolations(emulator: StripeEmulator, byId: Map<string, Operation>): Violation[] {
  const violations: Violation[] = [];
  const refunds = emulator.refundLedger().map((e) => e.refund);
  const held = new Map<string, number>();
  const refunded = new Map<string, number>();
  for (const r of refunds) {
    const opId = r.metadata.operation_id ?? null;
    const op = opId ? byId.get(opId) : undefined;
    if (op?.kind !== 'refund') {
      violations.push({ kind: 'refund_without_operation', operationId: opId, detail: `${r.id} (${r.status}, ${r.amount} of ${r.payment_intent}) names no refund operation` });
      continue;
    }
    if (r.status !== 'failed' && r.status !== 'canceled') held.set(op.id, (held.get(op.id) ?? 0) + 1);
    if (r.status === 'succeeded') refunded.set(r.payment_intent, (refunded.get(r.payment_intent) ?? 0) + r.amount);
    if (r.amount !== op.amount || r.currency !== op.currency) {
      violations.push({ kind: 'amount_mismatch', operationId: op.id, detail: `${r.id} is ${r.amount} ${r.currency}, operation ${op.amount} ${op.currency}` });
    }
    if (r.status === 'succeeded' && op.status === 'failed') violations.push({ kind: 'failed_but_refunded', operationId: op.id, detail: `failed, but ${r.id} succeeded` });
  }
  for (const [opId, n] of held) if (n > 1) violations.push({ kind: 'double_refund', operationId: opId, detail: `${n} refunds that have not failed` });
  for (const op of byId.values()) {
    if (op.kind !== 'refund' || op.status !== 'succeeded') continue;
    const refund = refunds.find((r) => r.id === op.external_id);
    if (refund?.status !== 'succeeded' || refund.metadata.operation_id !== op.id) {
      violations.push({ kind: 'succeeded_without_refund', operationId: op.id, detail: `external_id ${op.external_id} is ${refund?.status ?? 'not in the ledger'}` });
    }
  }
  for (const { paymentIntent: pi } of emulator.ledger()) {
    const n = refunded.get(pi.id) ?? 0;
    if (n > pi.amount_received) violations.push({ kind: 'over_refund', operationId: pi.metadata.operation_id ?? null, detail: `${n} refunded of ${pi.id}'s ${pi.amount_received}` });
  }
  return violations;
}

/** What the emulator saw for one operation, e.g. "create:truncated create:200↺". */
export function pathOf(emulator: StripeEmulator, operationId: string): string {
  return emulator
    .requests()
    .filter((r) => r.operationId === operationId)
    .map((r) => `${r.endpoint}:${r.status}${r.replayed ? '↺' : ''}`)
    .join(' ');
}
