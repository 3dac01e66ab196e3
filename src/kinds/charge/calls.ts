// The charge's calls (policy idempotent-key): a PaymentIntent created under `payment-op:<operation id>`
// (on the operation's connected account, if any; an authorization for a manual capture), read back by id,
// or found through Search once the key may be gone. What each answer means for the
// operation is decided here; errors are the executor's.
import { DISCREPANCY_PREFIX } from '../../types/contracts.ts';
import type { EffectCalls } from '../../types/kind.ts';
import type { LoadedOperation, Operation, Outcome } from '../../types/operation.ts';
import { accountOf, idempotencyKeyFor, type Charge, type PaymentGateway } from '../../stripe/gateway.ts';
import { chargeMismatch, chargePayloadOf, chargeResultOf, chargeSettles } from './evidence.ts';

export function chargeCalls(gateway: PaymentGateway): EffectCalls {
  return {
    create: async (op, ctx) => {
      const options = chargePayloadOf(op);
      const charge = await gateway.createCharge({
        operationId: op.id,
        // A charge has them all (payment_operations_money_check, payment_operations_charge_check).
        amount: op.amount!,
        currency: op.currency!,
        customer: op.customer_id!,
        paymentMethod: op.payment_method!,
        metadata: op.metadata,
        idempotencyKey: idempotencyKeyFor(op.id),
        captureMethod: options.capture_method ?? 'automatic',
        account: accountOf(op),
        transferDestination: options.transfer_destination ?? null,
        applicationFeeAmount: options.application_fee_amount ?? null,
        guard: ctx,
      });
      // A resend's answer is Stripe's first one, replayed: an authorization held then may have been released
      // since (the dashboard, Radar, its expiry), a processing payment settled. Only succeeded stays true.
      if (!charge.replayed || charge.status === 'succeeded') return fromCharge(op, charge);
      // Read as the charge's: a failed read is no refusal of the create (which a create's 4xx would be).
      const now = await gateway.retrieveCharge(charge.id, accountOf(op)).catch(() => undefined);
      return now ? fromCharge(op, now) : { kind: 'ambiguous', externalId: charge.id, reason: `payment intent ${charge.status} when its key was first used; reading it now failed` };
    },
    retrieve: async (op) => fromCharge(op, await gateway.retrieveCharge(op.external_id!, accountOf(op))),
    search: async (op) => {
      // Search results may be stale: a single match settles by what retrieve says now.
      const matches = await gateway.findCharges(op.id, accountOf(op));
      if (matches.length !== 1) return fromSearch(op, matches);
      return fromCharge(op, await gateway.retrieveCharge(matches[0]!.id, accountOf(op)));
    },
  };
}

/** docs/architecture.md §2.4: a 2xx is not success by itself; the PaymentIntent's status decides. */
function fromCharge(op: Operation, charge: Charge): Outcome {
  const { requestId } = charge;
  const mismatch = chargeMismatch(op, charge);
  if (mismatch) return { kind: 'needs_review', externalId: null, reason: mismatch, retry: false, requestId };
  const settles = chargeSettles(op, charge);
  // A hold keeps what it holds and until when: a capture is refused past it without asking Stripe.
  if (settles === 'succeeded') {
    const result = chargeResultOf(op, charge);
    return { kind: 'succeeded', externalId: charge.id, requestId, ...(result !== null ? { result } : {}) };
  }
  if (settles === 'failed') return { kind: 'failed', externalId: charge.id, reason: `payment intent ${charge.status}`, requestId };
  // SEPA Debit, ACH: days until the bank answers. Waiting, not unknown (src/engine/processing.ts).
  if (charge.status === 'processing') return { kind: 'processing', externalId: charge.id, reason: 'payment intent processing', requestId };
  return { kind: 'ambiguous', externalId: charge.id, reason: `payment intent ${charge.status}`, requestId };
}

/** Zero or several matches (one is retrieved and settles by its status): search is not read-after-write,
 * so zero never means "not charged" — it waits, searched again later; several is a double charge for a
 * person, a discrepancy: one of them settling the operation later (its webhook) answers neither. */
function fromSearch(op: LoadedOperation, matches: Charge[]): Outcome {
  if (matches.length === 0) {
    const when = op.key_window_passed ? 'key window passed and search' : 'search';
    return { kind: 'needs_review', externalId: null, retry: true, reason: `${when} found no charge for this operation (search may lag; not proof of no charge)` };
  }
  const reason = `${DISCREPANCY_PREFIX}search found ${matches.length} charges for this operation: ${matches.map((m) => m.id).join(', ')}`;
  return { kind: 'needs_review', externalId: null, reason, retry: false };
}
