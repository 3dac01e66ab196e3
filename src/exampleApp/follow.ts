// The built-in example's settlement subscriber (`outboxd order follow`): it marks the example's orders
// paid or payment_failed as their charges settle, the way an application does with a transactional
// onSettled: the update commits with outboxd's record that the subscriber consumed the event, so each
// settlement changes an order once.
import type { Outboxd } from '../outboxd.ts';
import { exampleStatementsFor } from './sql.ts';
import { CHARGE } from '../kinds/charge/evidence.ts';

export const EXAMPLE_SUBSCRIBER = 'example-orders';

/** Subscribes the example's orders to their settlements; resolves once subscribed. */
export async function followOrders(outboxd: Outboxd): Promise<void> {
  const sql = exampleStatementsFor(outboxd.schema);
  await outboxd.onSettled(
    async (event, tx) => {
      if (event.kind !== CHARGE || event.orderId === null) return;
      await tx.query(sql.markOrderSettled(event.orderId, event.status === 'succeeded' ? 'paid' : 'payment_failed'));
    },
    { transactional: true, subscriber: EXAMPLE_SUBSCRIBER },
  );
}
