// How a Refund matches and settles a refund operation: one rule, used by the refund's own calls, the
// webhooks, a person's resolution and the drift report.
import { unreadableDrift, type Drift, type DriftContext, type KindEvidence, type KindNaming, type ProviderObject, type Refuse } from '../../types/kind.ts';
import type { Operation } from '../../types/operation.ts';
import { AccessRevoked, accountOf, driftRead, FAILED_REFUND_STATUSES, refundIdempotencyKeyFor, type PaymentGateway, type Refund } from '../../stripe/gateway.ts';
import { CHARGE } from '../charge/evidence.ts';
import type { RefundPayload } from './request.ts';
import type { Queryable } from '../../db/pool.ts';
import { DISCREPANCY_PREFIX } from '../../types/contracts.ts';

/** The kind's name: its queue's, and the operations' `kind`. */
export const REFUND = 'refund';

export const REFUND_NAMING: KindNaming = {
  // pyr_: Stripe's refund of a payment by bank debit (SEPA Debit, ACH: a py_ charge).
  externalId: { pattern: /^(re|pyr)_\w+$/, what: 'a Refund id (re_… or pyr_…)' },
  settledBy: 'Refund that returned the money',
  object: 'refund',
  idempotencyKey: refundIdempotencyKeyFor,
};

export const payloadOf = (op: Operation): RefundPayload => op.payload as RefundPayload;

/** A refund that does not carry this operation's id, amount, currency and PaymentIntent, or is another
 * than the one the operation already knows, must not settle it. */
export function refundMismatch(op: Operation, refund: Refund): string | null {
  if (refund.account !== accountOf(op)) return `refund ${refund.id} is on ${refund.account ?? 'the platform'}; the operation's is on ${accountOf(op) ?? 'the platform'}`;
  if (refund.operationId !== op.id) return `refund ${refund.id} belongs to operation ${refund.operationId ?? '(none)'}`;
  if (refund.amount !== op.amount || refund.currency !== op.currency)
    return `refund ${refund.id} is ${refund.amount} ${refund.currency}, operation is ${op.amount} ${op.currency}`;
  const paymentIntent = payloadOf(op).payment_intent;
  if (refund.paymentIntent !== paymentIntent) return `refund ${refund.id} refunds ${refund.paymentIntent}, not ${paymentIntent}`;
  if (op.external_id && op.external_id !== refund.id) return `${refund.id} is not the operation's refund ${op.external_id}`;
  return null;
}

/**
 * A refund Stripe failed after it had succeeded (the customer's card closed, say: the money went back to
 * the balance, and Stripe lets it be refunded again). The operation stays succeeded, as every settled one
 * does, but records it (`result.failed_in_stripe`): it no longer counts against what the charge has left
 * to refund, or the refund still owed could never be requested again; and a person must hear of it.
 * False when there is nothing to record (not failed, or recorded already).
 */
async function recordFailedSince(tx: Queryable, op: Operation, refund: Refund, source: 'webhook' | 'reconcile'): Promise<boolean> {
  if (op.status !== 'succeeded' || !FAILED_REFUND_STATUSES.has(refund.status)) return false;
  if ((await tx.query(tx.sql.recordRefundFailedInStripe(op.id, refund.status, source))).rows.length === 0) return false;
  const reason = `${source}: refund ${refund.id} is ${refund.status} although the operation settled succeeded: the money did not reach the customer (it no longer counts as refunded: a new refund may return it)`;
  await tx.query(tx.sql.flagDiscrepancy(op.id, `${DISCREPANCY_PREFIX}${reason}`));
  return true;
}

export function refundEvidence(gateway: PaymentGateway): KindEvidence<Queryable> {
  return {
    naming: REFUND_NAMING,
    foundByMetadata: true,
    record: { event: 'refund', log: 'refund' },
    names: (type, id) => (type.startsWith('refund.') || type === 'charge.refund.updated') && REFUND_NAMING.externalId.pattern.test(id),
    retrieve: (id, account) => gateway.retrieveRefund(id, account),
    // Only what retrieve returned reaches here: a Refund.
    mismatch: (op, object: ProviderObject) => refundMismatch(op, object as Refund),
    settles: (_op, refund) => (refund.status === 'succeeded' ? 'succeeded' : FAILED_REFUND_STATUSES.has(refund.status) ? 'failed' : undefined),
    noneSucceeded: (op, reason, refuse) => noRefund(gateway, op, reason, refuse),
    drift: (ctx) => refundDrift(gateway, ctx),
    followUp: (tx, op, object, source) => recordFailedSince(tx, op, object as Refund, source),
  };
}

/** No refund of the operation's that has not failed: the known one, and every one the PaymentIntent's
 * list shows for the operation (a list is read-after-write, but shows no request Stripe is still
 * running: resolve first waits out a recent create itself). */
async function noRefund(gateway: PaymentGateway, op: Operation, reason: string, refuse: Refuse): Promise<Record<string, unknown>> {
  let known;
  const account = accountOf(op);
  if (op.external_id) {
    known = await gateway.retrieveRefund(op.external_id, account);
    if (!FAILED_REFUND_STATUSES.has(known.status)) {
      throw refuse(`${known.id} is ${known.status}, not failed: ${known.status === 'succeeded' ? 'the money went back' : 'it may still succeed; try again when it is final in Stripe'}`);
    }
  }
  const refunds = (await gateway.findRefunds(payloadOf(op).payment_intent, account)).filter((r) => r.operationId === op.id);
  const live = refunds.filter((r) => !FAILED_REFUND_STATUSES.has(r.status));
  if (live.length > 0) {
    throw refuse(`Stripe shows refunds for this operation that have not failed: ${live.map((r) => `${r.id} (${r.status})`).join(', ')}`);
  }
  return { reason, knownRefund: known ?? null, listedRefunds: refunds.map((r) => ({ id: r.id, status: r.status })) };
}

/**
 * The refunds' side of the drift report, each refund with its operation, each succeeded refund operation
 * with its refund:
 * - orphan_refund: a refund that names no refund operation of ours, or none at all while it refunds one
 *   of our charges;
 * - duplicate_refund: more than one refund that has not failed carries the same operation id;
 * - refunded_not_succeeded: a succeeded refund for an operation that is not succeeded;
 * - amount_mismatch: the operation's refund has another amount, currency or PaymentIntent;
 * - missing_refund: a succeeded refund operation whose refund has not succeeded (but one recorded failed
 *   in Stripe since: a person was told), or is not found;
 * - shared_refund: one Refund recorded by two succeeded refund operations (its metadata edited from one
 *   to the other before either recorded it): the application told twice of one refund.
 * Stripe lists the platform's refunds: a connected account's are checked by retrieve, for succeeded
 * operations only.
 */
async function refundDrift(gateway: PaymentGateway, { since, named, byExternalIds, succeeded }: DriftContext) {
  const refunds = await gateway.listRefunds(since);
  const drift: Drift[] = [];
  // A refund made outside outboxd (the dashboard) names no operation: drift only when it takes money back
  // from one of our charges, whose unrefunded amount outboxd would otherwise misjudge.
  const anonymous = refunds.filter((r) => r.operationId === undefined && r.paymentIntent !== null);
  const ours = anonymous.length ? await byExternalIds(CHARGE, anonymous.map((r) => r.paymentIntent!)) : [];
  for (const r of anonymous) {
    const charge = ours.find((o) => o.external_id === r.paymentIntent);
    if (charge) drift.push({ kind: 'orphan_refund', operationId: null, chargeIds: [r.id], detail: `refunds ${r.amount} ${r.currency} of charge operation ${charge.id} without naming a refund operation` });
  }
  for await (const page of named(refunds)) {
    for (const [operationId, list, op] of page) {
      if (op?.kind !== REFUND) {
        drift.push({ kind: 'orphan_refund', operationId, chargeIds: list.map((r) => r.id), detail: op ? `names a ${op.kind} operation` : 'no operation with this id' });
        continue;
      }
      const live = list.filter((r) => r.status !== 'failed' && r.status !== 'canceled');
      if (live.length > 1) drift.push({ kind: 'duplicate_refund', operationId, chargeIds: live.map((r) => r.id), detail: `${live.length} refunds for one operation` });
      const done = list.filter((r) => r.status === 'succeeded');
      if (done.length > 0 && op.status !== 'succeeded') drift.push({ kind: 'refunded_not_succeeded', operationId, chargeIds: done.map((r) => r.id), detail: `operation is ${op.status}` });
      for (const r of list) {
        if (r.amount !== op.amount || r.currency !== op.currency || r.paymentIntent !== payloadOf(op).payment_intent) {
          drift.push({ kind: 'amount_mismatch', operationId, chargeIds: [r.id], detail: `refund ${r.amount} ${r.currency} of ${r.paymentIntent}, operation ${op.amount} ${op.currency}` });
        }
      }
    }
  }
  const listed = new Map(refunds.map((r) => [r.id, r]));
  const recordedBy = new Map<string, string>();
  for await (const page of succeeded()) {
    for (const op of page) {
      const first = op.external_id ? recordedBy.get(op.external_id) : undefined;
      if (first) drift.push({ kind: 'shared_refund', operationId: op.id, chargeIds: [op.external_id!], detail: `operation ${first} records this refund too: one refund for two operations` });
      else if (op.external_id) recordedBy.set(op.external_id, op.id);
      if ((op.result as { failed_in_stripe?: unknown } | null)?.failed_in_stripe) continue;
      // It may predate `since`: retrieve it before calling it missing.
      const found = op.external_id ? (listed.get(op.external_id) ?? (await driftRead(gateway.retrieveRefund(op.external_id, accountOf(op))))) : undefined;
      if (found instanceof AccessRevoked) {
        drift.push(unreadableDrift(op.id, op.external_id!, found));
        continue;
      }
      if (!found || found.status !== 'succeeded') {
        drift.push({ kind: 'missing_refund', operationId: op.id, chargeIds: op.external_id ? [op.external_id] : [], detail: found ? `refund is ${found.status}` : 'refund not found' });
      }
    }
  }
  return { listed: refunds.length, label: 'refunds', drift };
}
