// The agreement check shared by the demo and chaos: the emulator's ledger is the truth about money.
import type { Pool } from '../../src/db/pool.ts';
import { idempotencyKeyFor } from '../../src/payments/gateway.ts';
import type { Operation } from '../../src/payments/operation.ts';
import type { StripeEmulator } from '../../src/stripe/emulator/emulator.ts';

export interface Violation {
  kind: 'double_charge' | 'failed_but_charged' | 'succeeded_without_charge' | 'amount_mismatch' | 'orphan_charge' | 'create_without_our_key';
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
  for (const { paymentIntent: pi } of emulator.ledger()) {
    const opId = pi.metadata.operation_id ?? null;
    const op = opId ? byId.get(opId) : undefined;
    if (!op) {
      violations.push({ kind: 'orphan_charge', operationId: opId, detail: `${pi.id} (${pi.status}) names no operation` });
      continue;
    }
    if (pi.status !== 'succeeded') continue;
    paid.set(op.id, (paid.get(op.id) ?? 0) + 1);
    if (pi.amount !== op.amount || pi.currency !== op.currency) {
      violations.push({ kind: 'amount_mismatch', operationId: op.id, detail: `${pi.id} is ${pi.amount} ${pi.currency}, operation ${op.amount} ${op.currency}` });
    }
  }
  for (const op of operations) {
    const n = paid.get(op.id) ?? 0;
    if (n > 1) violations.push({ kind: 'double_charge', operationId: op.id, detail: `${n} succeeded charges` });
    if (op.status === 'failed' && n > 0) violations.push({ kind: 'failed_but_charged', operationId: op.id, detail: `failed, but ${n} succeeded charge(s)` });
    if (op.status === 'succeeded') {
      const charge = emulator.ledger().find((l) => l.paymentIntent.id === op.external_id)?.paymentIntent;
      if (!charge || charge.status !== 'succeeded') {
        violations.push({ kind: 'succeeded_without_charge', operationId: op.id, detail: `external_id ${op.external_id} is ${charge?.status ?? 'not in the ledger'}` });
      }
    }
  }
  for (const r of emulator.requests()) {
    if (r.endpoint === 'create' && r.operationId && r.idempotencyKey !== idempotencyKeyFor(r.operationId)) {
      violations.push({ kind: 'create_without_our_key', operationId: r.operationId, detail: `create ${r.requestId} with key ${r.idempotencyKey}` });
    }
  }
  return { operations, violations, paid };
}

/** What the emulator saw for one operation, e.g. "create:truncated create:200↺". */
export function pathOf(emulator: StripeEmulator, operationId: string): string {
  return emulator
    .requests()
    .filter((r) => r.operationId === operationId)
    .map((r) => `${r.endpoint}:${r.status}${r.replayed ? '↺' : ''}`)
    .join(' ');
}
