// The built-in example's settlement subscriber (`outboxd order follow`): it marks the example's orders
// paid or payment_failed as their charges settle, the way an application does with a transactional
// onSettled: the update commits with outboxd's record that the subscriber consumed the event, so each
// settlement changes an order once. An authorization (`order confirm --capture manual`) only holds the
// funds: its order is authorized, then paid once captured, or released once cancelled (by the
// application, or by Stripe at its expiry).
import type { SettlementEvent } from '../outbox/settlements.ts';
import type { Outboxd } from '../outboxd.ts';
import { exampleStatementsFor, type OrderSettledStatus } from './sql.ts';
import { CHARGE } from '../kinds/charge/evidence.ts';
import { CAPTURE } from '../kinds/capture/index.ts';
import { CANCEL } from '../kinds/cancel/index.ts';

export const EXAMPLE_SUBSCRIBER = 'example-orders';

/** Subscribes the example's orders to their settlements; resolves once subscribed. */
export async function followOrders(outboxd: Outboxd): Promise<void> {
  const sql = exampleStatementsFor(outboxd.schema);
  await outboxd.onSettled(
    async (event, tx) => {
      const status = orderStatusOf(event);
      if (status && event.orderId !== null) await tx.query(sql.markOrderSettled(event.orderId, status));
    },
    { transactional: true, subscriber: EXAMPLE_SUBSCRIBER },
  );
}

/** What a settlement makes of its order; undefined for one that changes nothing (a refund, a failed
 * capture or cancel: the hold stays as it was). */
function orderStatusOf(event: SettlementEvent): OrderSettledStatus | undefined {
  const succeeded = event.status === 'succeeded';
  if (event.kind === CHARGE) return succeeded ? (event.hold ? 'authorized' : 'paid') : 'payment_failed';
  if (event.kind === CAPTURE && succeeded) return 'paid';
  if (event.kind === CANCEL && succeeded) return 'released';
  return undefined;
}
