// The capture: takes what an authorization holds, all or part (policy idempotent-key), under
// `capture-op:<capture operation id>`: `POST /v1/payment_intents/:id/capture` with amount_to_capture.
// Settled by what the PaymentIntent shows after: succeeded with this amount received, or cancelled (an
// authorization that expired or was cancelled: failed, no person needed). Its request is
// src/kinds/hold/request.ts.
import type { Kind, KindNaming } from '../../types/kind.ts';
import { captureIdempotencyKeyFor, EXPIRED_HOLD_REASONS, type PaymentGateway } from '../../stripe/gateway.ts';
import { changeCalls, changeEvidence, type ChangeRules } from '../hold/change.ts';

export const CAPTURE = 'capture';

export const CAPTURE_NAMING: KindNaming = {
  externalId: { pattern: /^pi_\w+$/, what: 'the charge\'s PaymentIntent id (pi_…)' },
  settledBy: 'PaymentIntent it captured',
  object: 'payment intent',
  idempotencyKey: captureIdempotencyKeyFor,
};

const rules: ChangeRules = {
  kind: CAPTURE,
  naming: CAPTURE_NAMING,
  send: (gateway, op, payload, account, guard) =>
    gateway.capturePaymentIntent({ paymentIntent: payload.payment_intent, amount: op.amount!, idempotencyKey: captureIdempotencyKeyFor(op.id), account, guard }),
  settles: (op, pi) => {
    if (pi.status === 'succeeded') {
      return pi.amountReceived === op.amount
        ? { status: 'succeeded', reason: 'captured' }
        : { mismatch: `${pi.id} was captured for ${pi.amountReceived} ${pi.currency}; this capture asked for ${op.amount} ${op.currency}` };
    }
    if (pi.status === 'canceled') {
      return { status: 'failed', reason: EXPIRED_HOLD_REASONS.has(pi.cancellationReason) ? 'the authorization expired before it was captured' : `the authorization was cancelled (${pi.cancellationReason ?? 'no reason given'})` };
    }
    return undefined;
  },
};

export function captureKind(gateway: PaymentGateway): Kind {
  return { kind: CAPTURE, policy: 'idempotent-key', calls: changeCalls(rules, gateway), evidence: changeEvidence(rules, gateway) };
}
