// The cancel: releases what an authorization holds (policy idempotent-key), under
// `cancel-op:<cancel operation id>`: `POST /v1/payment_intents/:id/cancel`. Settled by what the
// PaymentIntent shows after: cancelled (by this request, or expired: released either way), or captured
// (failed: refund it instead). Its request, like a capture's, is src/kinds/hold/request.ts.
import type { Kind, KindNaming } from '../../types/kind.ts';
import { cancelIdempotencyKeyFor, type CancellationReason, type PaymentGateway } from '../../stripe/gateway.ts';
import { changeCalls, changeEvidence, type ChangeRules } from '../hold/change.ts';

export const CANCEL = 'cancel';

export const CANCEL_NAMING: KindNaming = {
  externalId: { pattern: /^pi_\w+$/, what: 'the charge\'s PaymentIntent id (pi_…)' },
  settledBy: 'PaymentIntent it cancelled',
  object: 'payment intent',
  idempotencyKey: cancelIdempotencyKeyFor,
};

const rules: ChangeRules = {
  kind: CANCEL,
  naming: CANCEL_NAMING,
  send: (gateway, op, payload, account, guard) =>
    gateway.cancelPaymentIntent({
      paymentIntent: payload.payment_intent,
      reason: (payload.reason as CancellationReason | undefined) ?? null,
      idempotencyKey: cancelIdempotencyKeyFor(op.id),
      account,
      guard,
    }),
  settles: (_op, pi) => {
    if (pi.status === 'canceled') return { status: 'succeeded', reason: 'released' };
    if (pi.status === 'succeeded') return { status: 'failed', reason: `${pi.id} was captured (${pi.amountReceived} ${pi.currency}): refund it instead` };
    return undefined;
  },
};

export function cancelKind(gateway: PaymentGateway): Kind {
  return { kind: CANCEL, policy: 'idempotent-key', calls: changeCalls(rules, gateway), evidence: changeEvidence(rules, gateway) };
}
