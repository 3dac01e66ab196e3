// The Stripe webhook inbox. Each verified event is recorded by its id in the same transaction that
// acts on it, so a redelivered event (Stripe delivers at least once) is acknowledged, not reprocessed.
// A payment_intent.succeeded / payment_failed / canceled event settles the matching unsettled
// operation, through the same guarded write as an admin resolution: never over a settled status,
// and with a fence bump so a worker mid-call writes nothing after it.
import type Stripe from 'stripe';
import { inTransaction, type Pool } from '../db/pool.ts';
import type { Logger } from '../log.ts';
import { isOperationId, settleFromOutside, type Operation } from '../payments/operation.ts';

export type InboxResult = 'settled' | 'already_settled' | 'ignored' | 'no_operation' | 'mismatch' | 'duplicate';

const SETTLING: Record<string, 'succeeded' | 'failed'> = {
  'payment_intent.succeeded': 'succeeded',
  'payment_intent.payment_failed': 'failed',
  'payment_intent.canceled': 'failed',
};

class Duplicate extends Error {}

export async function receiveStripeEvent(pool: Pool, event: Stripe.Event, log: Logger): Promise<InboxResult> {
  const pi = event.data.object as Partial<Stripe.PaymentIntent>;
  const operationId = event.type.startsWith('payment_intent.') ? pi.metadata?.operation_id : undefined;
  const opId = operationId && isOperationId(operationId) ? operationId : null;
  try {
    return await inTransaction(pool, async (tx) => {
      const result = await act(tx, event, pi, opId);
      const { rows } = await tx.query(tx.sql.insertWebhookEvent(event.id, event.type, opId, result, JSON.stringify(event)));
      if (!rows[0]) throw new Duplicate(); // recorded by an earlier delivery: undo whatever this one did
      log.info({ eventId: event.id, type: event.type, operationId: opId, result }, 'stripe event received');
      return result;
    });
  } catch (err) {
    if (err instanceof Duplicate) return 'duplicate';
    throw err;
  }
}

async function act(
  tx: Parameters<Parameters<typeof inTransaction>[1]>[0],
  event: Stripe.Event,
  pi: Partial<Stripe.PaymentIntent>,
  opId: string | null,
): Promise<InboxResult> {
  const status = SETTLING[event.type];
  if (!status) return 'ignored';
  if (!opId) return 'no_operation';
  const { rows } = await tx.query(tx.sql.showOperation(opId));
  const op: Operation | undefined = rows[0];
  if (!op) return 'no_operation';
  if (pi.amount !== op.amount || pi.currency !== op.currency) return 'mismatch';
  const reason = status === 'failed' ? `${event.type}: ${pi.last_payment_error?.message ?? pi.status}` : null;
  const settled = await settleFromOutside(tx, opId, status, pi.id ?? null, `webhook:${event.type}`, reason);
  return settled ? 'settled' : 'already_settled';
}
