// The Stripe webhook inbox. An event is a hint, never evidence: on any payment_intent.* event the
// PaymentIntent is retrieved from Stripe (no transaction open), checked against the operation its
// metadata names (operation id, amount, currency, the charge already known), and the operation is
// settled from the RETRIEVED status only, through the same guarded write as any outside settlement:
// never over a settled status, and with a fence bump so a worker mid-call writes nothing after it.
// Each event is recorded by its id in the transaction that acts on it, so a redelivery (Stripe
// delivers at least once) is acknowledged, not reprocessed. Only ids, type, times and the
// PaymentIntent's id and status are stored (no payment-method or billing details), and only for the
// retention period.
import type Stripe from 'stripe';
import { inTransaction, type Pool, type Tx } from '../db/pool.ts';
import type { Logger } from '../log.ts';
import { FAILED_CHARGE_STATUSES, Rejected, type Charge, type PaymentGateway } from '../payments/gateway.ts';
import { flagFromOutside, isOperationId, isSettled, settleFromOutside, type Operation } from '../payments/operation.ts';
import { traceOperation, withSpan } from '../tracing.ts';

export type InboxResult =
  | 'settled'
  | 'already_settled'
  | 'not_final'
  | 'ignored'
  | 'no_operation'
  /** The PaymentIntent does not match the unsettled operation it names: flagged for review. */
  | 'mismatch'
  /** Stripe contradicts a settled operation (charged although failed, another charge): for a person. */
  | 'contradiction'
  | 'duplicate';

export interface InboxDeps {
  pool: Pool;
  gateway: PaymentGateway;
  log: Logger;
  /** Counts events whose PaymentIntent does not match, or contradicts, the operation it names. */
  onMismatch?: (result: 'mismatch' | 'contradiction') => void;
}

class Duplicate extends Error {}

/** In a span of its own, linked to the trace of the operation it names. */
export function receiveStripeEvent(deps: InboxDeps, event: Stripe.Event): Promise<InboxResult> {
  const attributes = { 'stripe.event.id': event.id, 'stripe.event.type': event.type };
  return withSpan('outboxd.webhook', attributes, async (span) => {
    const result = await receive(deps, event);
    span.setAttribute('outboxd.webhook.result', result);
    return result;
  });
}

async function receive(deps: InboxDeps, event: Stripe.Event): Promise<InboxResult> {
  const { pool, log } = deps;
  const hinted = event.type.startsWith('payment_intent.') ? (event.data.object as { id?: unknown }).id : undefined;
  const piId = typeof hinted === 'string' && /^pi_\w+$/.test(hinted) ? hinted : undefined;
  if ((await pool.query(pool.sql.webhookEventSeen(event.id))).rows[0]) return 'duplicate';

  // The evidence, fetched before any transaction opens (invariant 3). A PaymentIntent Stripe refuses to
  // show (another account's, say) is no evidence of anything; any other failure answers 5xx and Stripe
  // delivers the event again later.
  const charge = piId ? await deps.gateway.retrieveCharge(piId).catch(unlessRejected) : undefined;
  const opId = charge?.operationId && isOperationId(charge.operationId) ? charge.operationId : null;
  try {
    return await inTransaction(pool, async (tx) => {
      const result = charge ? await act(tx, charge, opId, event.type) : piId ? 'no_operation' : 'ignored';
      const { rows } = await tx.query(tx.sql.insertWebhookEvent(event.id, event.type, opId, result, JSON.stringify(trimmed(event, charge))));
      if (!rows[0]) throw new Duplicate(); // recorded by a concurrent delivery: undo whatever this one did
      log.info({ eventId: event.id, type: event.type, operationId: opId, paymentIntent: piId, status: charge?.status, result }, 'stripe event received');
      if (result === 'mismatch' || result === 'contradiction') {
        deps.onMismatch?.(result);
        log.error({ eventId: event.id, operationId: opId, paymentIntent: piId, status: charge?.status, result },
          result === 'mismatch'
            ? 'stripe event names a payment intent that does not match its operation: flagged for review'
            : 'stripe contradicts a settled operation: see the drift report');
      }
      return result;
    });
  } catch (err) {
    if (err instanceof Duplicate) return 'duplicate';
    throw err;
  }
}

/** Deletes stored events older than the retention; returns how many. */
export async function pruneWebhookEvents(pool: Pool, retentionDays: number): Promise<number> {
  return (await pool.query(pool.sql.pruneWebhookEvents(retentionDays))).rowCount ?? 0;
}

async function act(tx: Tx, charge: Charge, opId: string | null, type: string): Promise<InboxResult> {
  if (!opId) return 'no_operation';
  const { rows } = await tx.query(tx.sql.showOperation(opId));
  const op: Operation | undefined = rows[0];
  if (!op) return 'no_operation';
  traceOperation(op);
  const mismatch = mismatchOf(op, charge);
  if (isSettled(op.status)) {
    // Never overwritten; but a charge the operation does not account for must reach a person.
    const contradicts = mismatch !== null || (op.status === 'failed' && charge.status === 'succeeded');
    return contradicts ? 'contradiction' : 'already_settled';
  }
  if (mismatch) {
    await flagFromOutside(tx, op.id, `webhook ${type}: ${mismatch}`);
    return 'mismatch';
  }
  const status = charge.status === 'succeeded' ? 'succeeded' : FAILED_CHARGE_STATUSES.has(charge.status) ? 'failed' : undefined;
  if (!status) return 'not_final';
  const reason = status === 'failed' ? `${type}: payment intent ${charge.status}` : null;
  const settled = await settleFromOutside(tx, op.id, status, charge.id, `webhook:${type}`, reason);
  return settled ? 'settled' : 'already_settled';
}

function mismatchOf(op: Operation, charge: Charge): string | null {
  if (charge.amount !== op.amount || charge.currency !== op.currency) {
    return `${charge.id} is ${charge.amount} ${charge.currency}, the operation ${op.amount} ${op.currency}`;
  }
  if (op.external_id && op.external_id !== charge.id) return `${charge.id} is not the operation's charge ${op.external_id}`;
  return null;
}

function unlessRejected(err: unknown): undefined {
  if (err instanceof Rejected) return undefined;
  throw err;
}

/** What is kept of an event: ids, type, times, and the PaymentIntent's id and retrieved status. */
function trimmed(event: Stripe.Event, charge: Charge | undefined) {
  return {
    id: event.id,
    type: event.type,
    created: event.created,
    livemode: event.livemode,
    payment_intent: charge ? { id: charge.id, status: charge.status } : null,
  };
}
