// How a PaymentIntent matches and settles a charge operation: one rule, used by the charge's own calls,
// the webhooks, a person's resolution and the drift report.
import type { Operation } from '../../types/operation.ts';
import { isSettled } from '../../types/operation.ts';
import { unreadableDrift, type Drift, type DriftContext, type KindEvidence, type KindNaming, type ProviderObject, type Refuse } from '../../types/kind.ts';
import { AccessRevoked, accountOf, driftRead, EXPIRED_HOLD_REASONS, FAILED_CHARGE_STATUSES, idempotencyKeyFor, type Charge, type PaymentGateway } from '../../stripe/gateway.ts';
import type { ChargePayload } from './input.ts';
import type { Queryable } from '../../db/pool.ts';
import { CANCEL } from '../cancel/index.ts';
import { CAPTURE } from '../capture/index.ts';
import { RELEASE_KEY_PREFIX } from '../hold/change.ts';

/** The kind's name: its queue's, and the operations' `kind`. */
export const CHARGE = 'charge';

export const CHARGE_NAMING: KindNaming = {
  externalId: { pattern: /^pi_\w+$/, what: 'a PaymentIntent id (pi_…)' },
  settledBy: 'PaymentIntent that charged',
  object: 'payment intent',
  idempotencyKey: idempotencyKeyFor,
};

export const chargePayloadOf = (op: Pick<Operation, 'payload'>): ChargePayload => (op.payload ?? {}) as ChargePayload;
/** A charge requested with captureMethod manual: an authorization, whose success is a hold. */
export const isAuthorization = (op: Pick<Operation, 'payload'>): boolean => chargePayloadOf(op).capture_method === 'manual';

const where = (account: string | null) => account ?? 'the platform';

/** A PaymentIntent that is on another account than the operation's, does not carry this operation's id,
 * amount and currency (or its capture method, or, unsettled, its customer), or is another than the one
 * the operation already knows, must not settle it. The account first: a connected account writes its
 * objects' metadata itself. */
export function chargeMismatch(op: Operation, charge: ProviderObject, byPerson = false): string | null {
  // What a gateway reading a PaymentIntent says beyond any provider object's fields (absent: not said).
  const { customer, captureMethod: method, applicationFeeAmount: fee } = charge as Partial<Charge>;
  if (charge.account !== accountOf(op)) return `${charge.id} is on ${where(charge.account)}; the operation's charge is on ${where(accountOf(op))}`;
  if (charge.operationId !== op.id) return `${charge.id} belongs to operation ${charge.operationId ?? '(none)'}, not ${op.id}`;
  if (charge.amount !== op.amount || charge.currency !== op.currency) return `${charge.id} is ${charge.amount} ${charge.currency}; the operation is ${op.amount} ${op.currency}`;
  if (op.external_id && op.external_id !== charge.id) return `${charge.id} is not the operation's charge ${op.external_id}`;
  // Ours is made for the operation's customer; metadata naming the operation is anyone's to write. A
  // person may still name one that charged another (its key misused by another deployment, say).
  if (customer !== undefined && !byPerson && !isSettled(op.status) && customer !== op.customer_id) return `${charge.id} charges ${customer ?? 'no customer'}; the operation's customer is ${op.customer_id}`;
  if (method !== undefined && (method === 'manual') !== isAuthorization(op)) return `${charge.id} has capture_method ${method}; the operation asked for ${isAuthorization(op) ? 'manual' : 'automatic'}`;
  // A connected account writes its own PaymentIntents' metadata, and may name our pending operation there
  // with the same amount; only the platform can set a fee, so one made by the account carries none. Not
  // asked of a settled operation's own PaymentIntent, whose fee the platform may change since.
  const asked = (op.payload as ChargePayload | null)?.application_fee_amount ?? 0;
  if (fee !== undefined && !isSettled(op.status) && (fee ?? 0) !== asked) return `${charge.id} carries an application fee of ${fee ?? 'none'}; the operation asked for ${asked || 'none'}`;
  return null;
}

/** The status a PaymentIntent settles a charge operation with: succeeded once charged, or for an
 * authorization once Stripe holds the funds (requires_capture); failed when final and nothing charged
 * or held; undefined while it may still change (processing, requires_action, …). */
export function chargeSettles(op: Pick<Operation, 'payload'>, charge: Pick<ProviderObject, 'status'>): 'succeeded' | 'failed' | undefined {
  if (charge.status === 'succeeded' || (charge.status === 'requires_capture' && isAuthorization(op))) return 'succeeded';
  if (FAILED_CHARGE_STATUSES.has(charge.status)) return 'failed';
  return undefined;
}

/** What an authorization keeps as the charge operation's result: the PaymentIntent's status when it
 * settled (requires_capture: held; succeeded: captured outside outboxd already, and then what Stripe
 * took, which a refund may return), what it holds, and until when Stripe keeps it. */
export interface Hold {
  status: string;
  amount_capturable: number;
  capture_before: string | null;
  amount_received?: number;
}

/** The hold an authorization settled succeeded kept (its status requires_capture: held; succeeded: first
 * seen captured), or null for any other charge operation. */
const keptHold = (op: Operation): Partial<Hold> | null =>
  isAuthorization(op) && op.status === 'succeeded' ? ((op.result as Partial<Hold> | null) ?? {}) : null;

/** What a charge operation keeps of the PaymentIntent that settled it, however it settled (its own call, a
 * webhook, a person): an authorization's hold (JSON), nothing for an automatic charge. */
export function chargeResultOf(op: Pick<Operation, 'payload'>, charge: Charge): string | null {
  if (!isAuthorization(op)) return null;
  const hold: Hold = {
    status: charge.status,
    amount_capturable: charge.amountCapturable,
    capture_before: charge.captureBefore?.toISOString() ?? null,
    ...(charge.status === 'succeeded' ? { amount_received: charge.amountReceived } : {}),
  };
  return JSON.stringify(hold);
}

export function chargeEvidence(gateway: PaymentGateway): KindEvidence<Queryable> {
  return {
    naming: CHARGE_NAMING,
    foundByMetadata: true,
    record: { event: 'payment_intent', log: 'paymentIntent' },
    names: (type, id) => type.startsWith('payment_intent.') && CHARGE_NAMING.externalId.pattern.test(id),
    retrieve: (id, account) => gateway.retrieveCharge(id, account),
    mismatch: chargeMismatch,
    settles: chargeSettles,
    // Only what retrieve returned reaches here: a PaymentIntent.
    resultOf: (op, object) => chargeResultOf(op, object as Charge),
    noneSucceeded: (op, reason, refuse) => noCharge(gateway, op, reason, refuse),
    drift: (ctx) => chargeDrift(gateway, ctx),
    followUp: recordChangeInStripe,
    // A succeeded authorization kept as held that the event shows otherwise: retrieved, for followUp (a
    // failed one keeps no hold, and nothing follows it up); unless a capture or cancel of its own that has
    // not failed says what became of it (outboxd's own capture, whose event this is, as a rule).
    changed: async (db, op, status) => {
      const hold = keptHold(op);
      return (
        hold !== null &&
        hold.status !== status &&
        !(await db.query(db.sql.changesOfCharge(op.id, op.order_id!))).rows.some((change: { status: string }) => change.status !== 'failed')
      );
    },
    toFollowUp: async (db, limit) => {
      const now = new Date();
      const since = new Date(now.getTime() - FOLLOW_UP_FOR_MS).toISOString();
      return (await db.query(db.sql.authorizationsToFollowUp(now.toISOString(), since, limit, UNDATED_HOLD_SECONDS))).rows;
    },
  };
}

/** How long after its capture_before a held authorization is still looked at (Stripe releases it at that
 * time, give or take, and the drift report lists one it never did), and after a change of it failed. */
const FOLLOW_UP_FOR_MS = 30 * 86_400_000;
/** A hold Stripe gave no capture_before (a wallet's) is looked at once the shortest card window since it
 * settled has passed (then every sweep, until it changes or FOLLOW_UP_FOR_MS more have passed). */
const UNDATED_HOLD_SECONDS = 4 * 86_400;

/** A succeeded authorization changed in Stripe, which the application must hear of: cancelled (it expired:
 * cancellation_reason automatic; or someone cancelled it in the dashboard), it holds nothing any more,
 * recorded as a cancel of the charge; captured in the dashboard, it took the money, recorded as a capture
 * of what Stripe took (what a refund of it may return). Each settled, its settlement event telling the
 * application. */
async function recordChangeInStripe(tx: Queryable, op: Operation, pi: ProviderObject, source: 'webhook' | 'reconcile'): Promise<boolean> {
  // One first seen captured held nothing: its own settlement told what Stripe took.
  const hold = keptHold(op);
  if (!hold || hold.status === 'succeeded') return false;
  const shown = pi as Partial<Charge>;
  const record = async (kind: 'capture' | 'cancel', key: string, reason: string | null, kept: Record<string, unknown>, amount: number | null) => {
    const shownAs = JSON.stringify({ status: pi.status, ...kept });
    return (await tx.query(tx.sql.recordChangeInStripe(op.id, kind, `${RELEASE_KEY_PREFIX}${key}`, reason, shownAs, source, amount))).rows.length > 0;
  };
  if (pi.status === 'canceled') {
    const reason = shown.cancellationReason ?? null;
    const expired = EXPIRED_HOLD_REASONS.has(reason);
    return record('cancel', expired ? 'expired' : 'canceled-in-stripe', expired ? 'the authorization expired' : reason, { cancellation_reason: reason }, null);
  }
  if (pi.status === 'succeeded' && shown.amountReceived) {
    return record('capture', 'captured-in-stripe', 'captured in Stripe', { amount_received: shown.amountReceived }, shown.amountReceived);
  }
  return false;
}

/** --failed is refused while any charge Stripe shows for the operation has not failed (resolve first
 * waits out Search's freshness horizon after the last create: Search is not read-after-write). */
async function noCharge(gateway: PaymentGateway, op: Operation, reason: string, refuse: Refuse): Promise<Record<string, unknown>> {
  let known;
  const account = accountOf(op);
  if (op.external_id) {
    known = await gateway.retrieveCharge(op.external_id, account);
    if (!FAILED_CHARGE_STATUSES.has(known.status)) {
      const done = chargeSettles(op, known) === 'succeeded';
      throw refuse(`${known.id} is ${known.status}, not failed: ${done ? (known.status === 'succeeded' ? 'the customer was charged' : 'Stripe holds the funds') : 'it may still charge; try again when it is final in Stripe'}`);
    }
  }
  // Search shows each status as it indexed it, which may lag an update (a declined PaymentIntent the
  // customer paid since, on the application's own recovery flow): a failed one is read again, unless
  // it is the one just retrieved.
  const searched = await gateway.findCharges(op.id, account);
  const charges: Charge[] = [];
  for (const c of searched) {
    charges.push(c.id === known?.id ? known : FAILED_CHARGE_STATUSES.has(c.status) ? await gateway.retrieveCharge(c.id, account) : c);
  }
  const live = charges.filter((c) => !FAILED_CHARGE_STATUSES.has(c.status));
  if (live.length > 0) {
    throw refuse(`Stripe shows charges for this operation that have not failed: ${live.map((c) => `${c.id} (${c.status})`).join(', ')}`);
  }
  return { reason, knownCharge: known ?? null, searchedCharges: charges.map((c) => ({ id: c.id, status: c.status })) };
}

/**
 * The charges' side of the drift report:
 * - orphan_charge: a charge whose metadata names no operation of ours;
 * - duplicate_charge: more than one charge that took money (or, of an authorization, holds it) carries the
 *   same operation id;
 * - charged_not_succeeded: such a charge for an operation that is not succeeded;
 * - amount_mismatch: the operation's charge has another amount or currency;
 * - missing_charge: a succeeded operation whose charge is not among Stripe's charges, or does not show
 *   it charged (an authorization: held or captured);
 * - released_hold: a succeeded authorization released in Stripe that no succeeded cancel records;
 * - captured_hold: a succeeded authorization held when it settled, captured in Stripe, that no capture
 *   records;
 * - shared_charge: one PaymentIntent recorded by two succeeded operations (its metadata edited from one to
 *   the other before either recorded it): two orders told they were paid by one charge.
 * Stripe lists the platform's PaymentIntents: a connected account's charge is checked by retrieve.
 */
async function chargeDrift(gateway: PaymentGateway, { since, named, byExternalIds, succeeded }: DriftContext) {
  const charges = (await gateway.listCharges(since)).filter((c) => c.operationId !== undefined);
  const drift: Drift[] = [];
  for await (const page of named(charges)) {
    for (const [operationId, list, found] of page) {
      const op = found?.kind === CHARGE ? found : undefined;
      if (!op) {
        drift.push({ kind: 'orphan_charge', operationId, chargeIds: list.map((c) => c.id), detail: 'no operation with this id' });
        continue;
      }
      // An authorization's second hold is money taken from the customer's card too, until it expires.
      const paid = list.filter((c) => chargeSettles(op, c) === 'succeeded');
      if (paid.length > 1) {
        drift.push({ kind: 'duplicate_charge', operationId, chargeIds: paid.map((c) => c.id), detail: `${paid.length} charges that took or hold money for one operation` });
      }
      if (paid.length > 0 && op.status !== 'succeeded') {
        drift.push({ kind: 'charged_not_succeeded', operationId, chargeIds: paid.map((c) => c.id), detail: `operation is ${op.status}` });
      }
      for (const c of list) {
        if (c.amount !== op.amount || c.currency !== op.currency) {
          drift.push({ kind: 'amount_mismatch', operationId, chargeIds: [c.id], detail: `charge ${c.amount} ${c.currency}, operation ${op.amount} ${op.currency}` });
        }
      }
    }
  }
  const listed = new Map(charges.map((c) => [c.id, c]));
  const released: Operation[] = [];
  const captured: Operation[] = [];
  const recordedBy = new Map<string, string>();
  for await (const page of succeeded()) {
    for (const op of page) {
      const first = op.external_id ? recordedBy.get(op.external_id) : undefined;
      if (first) drift.push({ kind: 'shared_charge', operationId: op.id, chargeIds: [op.external_id!], detail: `operation ${first} records this PaymentIntent too: one charge for two operations` });
      else if (op.external_id) recordedBy.set(op.external_id, op.id);
      // It may predate `since`, or be on a connected account (the listing is the platform's): retrieve it
      // there before calling it missing.
      const found = op.external_id ? (listed.get(op.external_id) ?? (await driftRead(gateway.retrieveCharge(op.external_id, accountOf(op))))) : undefined;
      if (found instanceof AccessRevoked) {
        drift.push(unreadableDrift(op.id, op.external_id!, found));
        continue;
      }
      if (found && chargeSettles(op, found) === 'succeeded') {
        if (found.status === 'succeeded' && keptHold(op)?.status === 'requires_capture') captured.push(op);
        continue;
      }
      if (found && isAuthorization(op) && found.status === 'canceled') released.push(op);
      else drift.push({ kind: 'missing_charge', operationId: op.id, chargeIds: op.external_id ? [op.external_id] : [], detail: found ? `charge is ${found.status}` : 'charge not found' });
    }
  }
  // An authorization released in Stripe is accounted for by a succeeded cancel of it (outboxd's, or the
  // one its webhook recorded); without one, the application still believes the funds are held.
  const cancels = released.length ? await byExternalIds(CANCEL, released.map((o) => o.external_id!)) : [];
  for (const op of released) {
    if (!cancels.some((c) => c.parent_operation_id === op.id && c.status === 'succeeded')) {
      drift.push({ kind: 'released_hold', operationId: op.id, chargeIds: [op.external_id!], detail: 'the authorization was released in Stripe (expired or cancelled), and no cancel operation records it' });
    }
  }
  // One captured in Stripe, by a succeeded capture of it (outboxd's, or the one its webhook recorded);
  // without one, the application believes the funds are held and every refund of the charge is refused.
  const captures = captured.length ? await byExternalIds(CAPTURE, captured.map((o) => o.external_id!)) : [];
  for (const op of captured) {
    if (!captures.some((c) => c.parent_operation_id === op.id && c.status === 'succeeded')) {
      drift.push({ kind: 'captured_hold', operationId: op.id, chargeIds: [op.external_id!], detail: 'the authorization was captured in Stripe, and no capture operation records it: refunds of the charge are refused until one does' });
    }
  }
  return { listed: charges.length, label: 'charges', drift };
}
