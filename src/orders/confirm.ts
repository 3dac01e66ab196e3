// Order confirmation: the order, its charge operation and its outbox row commit in ONE transaction
// (invariant 1), before anything talks to Stripe.
import { inTransaction, type Pool } from '../db/pool.ts';
import { recordOutboxRow } from '../outbox.ts';
import type { Operation } from '../payments/operation.ts';
import { parseOrderInput, type OrderInput } from './validate.ts';

export class OrderConflictError extends Error {
  override name = 'OrderConflictError';
  readonly orderId: string;
  readonly operationId: string;
  readonly field: string;
  constructor(orderId: string, operationId: string, field: string) {
    super(`order ${orderId} was already confirmed with a different ${field} (operation ${operationId})`);
    this.orderId = orderId;
    this.operationId = operationId;
    this.field = field;
  }
}

export interface Confirmation {
  operationId: string;
  /** false when the order had been confirmed before: same operation, no new job. */
  created: boolean;
}

export async function confirmOrder(db: Pool, input: unknown): Promise<Confirmation> {
  const order = parseOrderInput(input);
  return inTransaction(db, async (tx) => {
    const values = [order.orderId, order.amount, order.currency, order.customer, order.paymentMethod] as const;
    await tx.query(tx.sql.insertOrder(...values));
    const inserted = await tx.query(tx.sql.insertChargeOperation(...values));
    if (inserted.rows[0]) {
      const operationId: string = inserted.rows[0].id;
      await recordOutboxRow(tx, operationId);
      return { operationId, created: true };
    }
    // Confirmed before: the same operation id, and nothing enqueued, provided it is the same order.
    const { rows } = await tx.query(tx.sql.findChargeOperationByOrder(order.orderId));
    const existing: Operation = rows[0];
    const differs = differingField(existing, order);
    if (differs) throw new OrderConflictError(order.orderId, existing.id, differs);
    return { operationId: existing.id, created: false };
  });
}

function differingField(op: Operation, order: OrderInput): string | undefined {
  if (op.amount !== order.amount) return 'amount';
  if (op.currency !== order.currency) return 'currency';
  if (op.customer_id !== order.customer) return 'customer';
  if (op.payment_method !== order.paymentMethod) return 'payment method';
  return undefined;
}
