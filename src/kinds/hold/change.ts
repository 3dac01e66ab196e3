// What a capture and a cancel share: each changes a charge operation's authorization (a PaymentIntent
// created with capture_method=manual, which Stripe holds in requires_capture), and each is settled by
// what the PaymentIntent shows afterwards. Stripe captures or cancels an authorization at most once and
// refuses the second (payment_intent_unexpected_state), so sending the change again cannot move money
// twice, even once its key is forgotten: the key only replays the first answer.
import { unreadableDrift, type EffectCalls, type KindEvidence, type KindNaming, type Refuse } from '../../types/kind.ts';
import type { Operation, Outcome } from '../../types/operation.ts';
import { AccessRevoked, accountOf, driftRead, namingNoIntent, Rejected, type Charge, type PaymentGateway, type SendGuard, type StripeAccount } from '../../stripe/gateway.ts';

/** What a capture or a cancel keeps in its payload: the charge's PaymentIntent and account, the
 * caller's key as given (effect_key is `<charge operation id>/<key>`), and a cancel's reason. */
export interface ChangePayload {
  payment_intent: string;
  stripe_account?: string;
  key: string;
  reason?: string;
}

export const changePayloadOf = (op: Pick<Operation, 'payload'>): ChangePayload => op.payload as ChangePayload;

/** The keys of the cancels outboxd records for an authorization Stripe released by itself begin so; no
 * caller's key may. */
export const RELEASE_KEY_PREFIX = 'outboxd:';

/** How one kind of change reads a PaymentIntent: succeeded or failed once it is final for it, undefined
 * while the authorization is still held (the change has not happened), or a mismatch for a person. */
export interface ChangeRules {
  kind: 'capture' | 'cancel';
  naming: KindNaming;
  send(gateway: PaymentGateway, op: Operation, payload: ChangePayload, account: StripeAccount, guard: SendGuard): Promise<Charge>;
  settles(op: Operation, pi: Charge): { status: 'succeeded' | 'failed'; reason: string } | { mismatch: string } | undefined;
}

/** The PaymentIntent is the charge's, on the charge's account. */
export function changeMismatch(op: Operation, pi: Pick<Charge, 'id' | 'account'>): string | null {
  const { payment_intent } = changePayloadOf(op);
  if (pi.id !== payment_intent) return `${pi.id} is not the charge's PaymentIntent ${payment_intent}`;
  if (pi.account !== accountOf(op)) return `${pi.id} was read on ${pi.account ?? 'the platform'}, the charge is on ${accountOf(op) ?? 'the platform'}`;
  return null;
}

function fromIntent(rules: ChangeRules, op: Operation, pi: Charge, held: 'ambiguous' | 'not_done'): Outcome {
  const { requestId } = pi;
  const mismatch = changeMismatch(op, pi);
  if (mismatch) return { kind: 'needs_review', externalId: null, reason: mismatch, retry: false, requestId };
  const settled = rules.settles(op, pi);
  if (settled && 'mismatch' in settled) return { kind: 'needs_review', externalId: null, reason: settled.mismatch, retry: false, requestId };
  if (settled?.status === 'succeeded') return { kind: 'succeeded', externalId: pi.id, requestId, result: JSON.stringify({ status: pi.status, amount_received: pi.amountReceived, cancellation_reason: pi.cancellationReason }) };
  if (settled?.status === 'failed') return { kind: 'failed', externalId: pi.id, reason: settled.reason, requestId };
  const reason = `payment intent ${pi.status}: the ${rules.kind} has not happened`;
  return held === 'not_done' ? { kind: 'not_done', reason, requestId } : { kind: 'ambiguous', externalId: null, reason, requestId };
}

export function changeCalls(rules: ChangeRules, gateway: PaymentGateway): EffectCalls {
  /** The PaymentIntent as it is now; `held`: what a still-held authorization means after this call. */
  const read = (held: 'ambiguous' | 'not_done') => async (op: Operation) =>
    fromIntent(rules, op, await namingNoIntent(gateway.retrieveCharge(changePayloadOf(op).payment_intent, accountOf(op))), held);
  return {
    create: async (op, ctx) => {
      try {
        // The PaymentIntent an error names is the charge's, known already, not an object of this change:
        // without it, the next attempt sends the change again rather than only reading it.
        return fromIntent(rules, op, await namingNoIntent(rules.send(gateway, op, changePayloadOf(op), accountOf(op), ctx)), 'ambiguous');
      } catch (err) {
        // Refused by the PaymentIntent's state (already captured, cancelled, expired): what it shows decides.
        if (err instanceof Rejected && err.code === 'payment_intent_unexpected_state') return read('ambiguous')(op);
        throw err;
      }
    },
    // Read without sending (the sweep's search is read-only): still held, so sending it is safe and due.
    // No retrieve: a change knows its PaymentIntent from the start and records it only once settled.
    search: read('not_done'),
  };
}

export function changeEvidence(rules: ChangeRules, gateway: PaymentGateway): KindEvidence {
  return {
    naming: rules.naming,
    record: { event: 'payment_intent', log: 'paymentIntent' },
    // A PaymentIntent's events name its charge operation (metadata.operation_id): they are the charge's.
    names: () => false,
    retrieve: (id, account) => gateway.retrieveCharge(id, account),
    mismatch: (op, object) => {
      const mismatch = changeMismatch(op, object as Charge);
      if (mismatch) return mismatch;
      const settled = rules.settles(op, object as Charge);
      return settled && 'mismatch' in settled ? settled.mismatch : null;
    },
    settles: (op, object) => {
      const settled = rules.settles(op, object as Charge);
      return settled && 'status' in settled ? settled.status : undefined;
    },
    noneSucceeded: async (op, reason, refuse: Refuse) => {
      const pi = await gateway.retrieveCharge(changePayloadOf(op).payment_intent, accountOf(op));
      const settled = rules.settles(op, pi);
      if (settled && 'status' in settled && settled.status === 'succeeded') throw refuse(`${pi.id} is ${pi.status}: the ${rules.kind} happened`);
      // Changed, though not as this operation asked (captured for another amount, outside outboxd): this
      // one did not happen. What did is the charge's to record (the sweep follows up an authorization
      // whose change failed: a capture of what Stripe took), and the evidence says it.
      const otherwise = settled && 'mismatch' in settled ? { changedOtherwise: settled.mismatch } : {};
      return { reason, paymentIntent: { id: pi.id, status: pi.status, amount_received: pi.amountReceived }, ...otherwise };
    },
    drift: async ({ succeeded }) => {
      // Each succeeded change against what its PaymentIntent shows now, retrieved one by one (the charges'
      // listing covers the PaymentIntents themselves): `listed` counts those retrieved.
      const drift = [];
      let listed = 0;
      for await (const page of succeeded()) {
        for (const op of page) {
          listed++;
          // Only Stripe's refusal makes it missing: any other failure fails the report (as the charges').
          const pi = await driftRead(gateway.retrieveCharge(changePayloadOf(op).payment_intent, accountOf(op)));
          if (pi instanceof AccessRevoked) {
            drift.push(unreadableDrift(op.id, changePayloadOf(op).payment_intent, pi));
            continue;
          }
          const settled = pi && rules.settles(op, pi);
          if (!settled || !('status' in settled) || settled.status !== 'succeeded') {
            drift.push({ kind: `missing_${rules.kind}`, operationId: op.id, chargeIds: pi ? [pi.id] : [], detail: pi ? `payment intent is ${pi.status}` : 'payment intent not found' });
          }
        }
      }
      return { listed, label: `${rules.kind}s`, drift };
    },
  };
}
