// The built-in example of an application (`outboxd order confirm`): its own orders table, and a charge
// requested in the same transaction that records the order (invariant 1), exactly as an application
// embedding outboxd does with requestCharge.
import { inTransaction, type Pool } from '../db/pool.ts';
import { requestValidCharge, type ChargeRequested } from '../kinds/charge/request.ts';
import { ATTR, withSpan } from '../telemetry/tracing.ts';
import { parseOrderInput } from '../kinds/charge/input.ts';
import { exampleStatementsFor } from './sql.ts';

export async function confirmOrder(db: Pool, input: unknown): Promise<ChargeRequested> {
  const order = parseOrderInput(input);
  return withSpan('outboxd.confirm', { [ATTR.orderId]: order.orderId }, () =>
    inTransaction(db, async (tx) => {
      await tx.query(exampleStatementsFor(tx.sql.schema).insertOrder(order.orderId, order.amount, order.currency, order.customer, order.paymentMethod));
      return requestValidCharge(tx, order);
    }),
  );
}
