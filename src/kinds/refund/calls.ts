// The refund's calls (policy idempotent-key): `POST /v1/refunds` under `refund-op:<refund operation id>`,
// read back by id, and past the key window found in the PaymentIntent's list of refunds by its operation
// id, never created again.
import { DISCREPANCY_PREFIX } from '../../types/contracts.ts';
import type { EffectCalls } from '../../types/kind.ts';
import type { LoadedOperation, Operation, Outcome } from '../../types/operation.ts';
import { accountOf, FAILED_REFUND_STATUSES, namingNoIntent, refundIdempotencyKeyFor, type PaymentGateway, type Refund } from '../../stripe/gateway.ts';
import { payloadOf, refundMismatch } from './evidence.ts';

export function refundCalls(gateway: PaymentGateway): EffectCalls {
  return {
    // The refund's id (re_…) comes only from a Refund; a PaymentIntent an error names is the charge's.
    create: async (op, ctx) => {
      const { payment_intent, reason, reverse_transfer, refund_application_fee } = payloadOf(op);
      const refund = await namingNoIntent(
        gateway.createRefund({
          operationId: op.id,
          paymentIntent: payment_intent,
          amount: op.amount!, // a refund has one (payment_operations_money_check)
          reason,
          idempotencyKey: refundIdempotencyKeyFor(op.id),
          account: accountOf(op),
          reverseTransfer: reverse_transfer === true,
          refundApplicationFee: refund_application_fee === true,
          guard: ctx,
        }),
      );
      return fromRefund(op, refund);
    },
    retrieve: async (op) => fromRefund(op, await namingNoIntent(gateway.retrieveRefund(op.external_id!, accountOf(op)))),
    search: async (op) => {
      // A list, not a search: what it shows is current, so the one match settles by its own status.
      const mine = (await namingNoIntent(gateway.findRefunds(payloadOf(op).payment_intent, accountOf(op)))).filter((r) => r.operationId === op.id);
      if (mine.length === 1) return fromRefund(op, mine[0]!);
      return fromList(op, mine);
    },
  };
}

/** A 2xx is not success by itself: the Refund's status decides (only succeeded is done). */
function fromRefund(op: Operation, refund: Refund): Outcome {
  const { requestId } = refund;
  const mismatch = refundMismatch(op, refund);
  if (mismatch) return { kind: 'needs_review', externalId: null, reason: mismatch, retry: false, requestId };
  if (refund.status === 'succeeded') return { kind: 'succeeded', externalId: refund.id, requestId };
  if (FAILED_REFUND_STATUSES.has(refund.status)) return { kind: 'failed', externalId: refund.id, reason: `refund ${refund.status}`, requestId };
  // A refund to a bank account may take days, and one waiting for the customer (requires_action: their
  // bank details, say) as long: waiting, not unknown (src/engine/processing.ts), which would resend it
  // until its job is dead-lettered, hours later, into review.
  if (refund.status === 'pending' || refund.status === 'requires_action') return { kind: 'processing', externalId: refund.id, reason: `refund ${refund.status}`, requestId };
  return { kind: 'ambiguous', externalId: refund.id, reason: `refund ${refund.status}`, requestId };
}

/** Zero or several refunds carry this operation's id. The list is read-after-write, so waiting will not
 * change it: a person decides. Several is money refunded twice, a discrepancy: one of them settling the
 * operation later (its webhook) answers neither. */
function fromList(op: LoadedOperation, mine: Refund[]): Outcome {
  const when = op.key_window_passed ? 'key window passed and ' : '';
  const reason = mine.length === 0
    ? `${when}the PaymentIntent's refunds list none for this operation`
    : `${DISCREPANCY_PREFIX}the PaymentIntent's refunds list ${mine.length} for this operation: ${mine.map((r) => r.id).join(', ')}`;
  return { kind: 'needs_review', externalId: null, reason, retry: false };
}
