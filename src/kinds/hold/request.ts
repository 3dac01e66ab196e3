// Requesting a capture or a cancel of an authorization inside the caller's transaction: linked to its
// charge operation and unique per (charge operation, kind, key), refused before anything is written when
// the charge holds no funds to change (not an authorization, not held, already captured or cancelled,
// expired) or a capture asks for more than is held.
import { z } from 'zod';
import type { Queryable } from '../../db/pool.ts';
import { jsonObjectOf } from '../../db/caller.ts';
import { MAX_AMOUNT, parseWith } from '../../types/input.ts';
import { activeTraceparent, ATTR, withSpan } from '../../telemetry/tracing.ts';
import { CANCELLATION_REASONS } from '../../stripe/gateway.ts';
import { OperationNotFoundError } from '../../types/errors.ts';
import { CHARGE, isAuthorization, type Hold } from '../charge/evidence.ts';
import { chargeChangeKey, chargeOperationIdInput } from '../refund/request.ts';
import { RELEASE_KEY_PREFIX, type ChangePayload } from './change.ts';

const key = chargeChangeKey.refine((s) => !s.startsWith(RELEASE_KEY_PREFIX), `key must not begin with "${RELEASE_KEY_PREFIX}", the prefix of outboxd's own releases`);

export const captureInputSchema = z.strictObject({
  chargeOperationId: chargeOperationIdInput,
  key,
  /** In minor units; absent: all the authorization holds. The rest is released. */
  amount: z
    .number({ error: 'amount must be a number of minor units' })
    .int('amount must be an integer number of minor units')
    .positive('amount must be positive')
    .max(MAX_AMOUNT, `amount must be at most ${MAX_AMOUNT} minor units`)
    .optional(),
});

export const cancelInputSchema = z.strictObject({
  chargeOperationId: chargeOperationIdInput,
  key,
  reason: z.enum(CANCELLATION_REASONS, { error: `reason must be one of ${CANCELLATION_REASONS.join(', ')}` }).optional(),
});

export type CaptureInput = z.infer<typeof captureInputSchema>;
export type CancelInput = z.infer<typeof cancelInputSchema>;

/** A capture or a cancel that must not be made, said before anything is written. */
export class AuthorizationRefused extends Error {
  override name = 'AuthorizationRefused';
  readonly kind: 'capture' | 'cancel';
  readonly chargeOperationId: string;
  /**
   * not_a_charge; not_an_authorization (an automatic charge: nothing is held); no_funds_held (the
   * charge has not succeeded: pending, unknown or failed); already_captured; canceled (cancelled, or
   * its cancel is under way); expired (past the authorization's capture_before); exceeds_capturable;
   * key_conflict (the key names a change with another amount or reason).
   */
  readonly code: 'not_a_charge' | 'not_an_authorization' | 'no_funds_held' | 'already_captured' | 'canceled' | 'expired' | 'exceeds_capturable' | 'key_conflict';
  constructor(kind: 'capture' | 'cancel', chargeOperationId: string, code: AuthorizationRefused['code'], message: string) {
    super(message);
    this.kind = kind;
    this.chargeOperationId = chargeOperationId;
    this.code = code;
  }
}

export interface ChangeRequested {
  operationId: string;
  /** false: this key already named this change of the charge (nothing new was written). */
  created: boolean;
}

/** Validates `input` and requests the capture on `db`, the caller's transaction. */
export function requestCapture(db: Queryable, input: unknown): Promise<ChangeRequested> {
  const req = parseWith(captureInputSchema, input);
  return requested(db, 'capture', req.chargeOperationId, req.key, (held) => req.amount ?? held, null);
}

/** Validates `input` and requests the cancel on `db`, the caller's transaction. */
export function requestCancel(db: Queryable, input: unknown): Promise<ChangeRequested> {
  const req = parseWith(cancelInputSchema, input);
  return requested(db, 'cancel', req.chargeOperationId, req.key, (held) => held, req.reason ?? null);
}

function requested(db: Queryable, kind: 'capture' | 'cancel', charge: string, key: string, amountOf: (held: number) => number, reason: string | null) {
  const attributes = { [ATTR.kind]: kind, 'outboxd.charge_operation_id': charge };
  return withSpan(`outboxd.request_${kind}`, attributes, async (span) => {
    const done = await requestInTransaction(db, kind, charge, key, amountOf, reason);
    span.setAttributes({ [ATTR.operationId]: done.operationId, 'outboxd.created': done.created });
    return done;
  });
}

/** The charge a capture or a cancel is decided from (CHARGE_COLUMNS in src/sql/hold.ts). */
interface ChargeRow {
  id: string;
  kind: string;
  status: string;
  order_id: string;
  amount: number | string;
  currency: string;
  /** Known once it succeeded. */
  external_id: string | null;
  payload: { capture_method?: string; stripe_account?: string } | null;
  result: Hold | null;
  now: Date;
}

interface ChangeRow {
  id: string;
  kind: 'capture' | 'cancel';
  status: string;
  amount: number | string;
  effect_key: string;
  payload: ChangePayload;
}

async function requestInTransaction(
  db: Queryable,
  kind: 'capture' | 'cancel',
  chargeId: string,
  key: string,
  amountOf: (held: number) => number,
  reason: string | null,
): Promise<ChangeRequested> {
  const refuse = (code: AuthorizationRefused['code'], message: string) => new AuthorizationRefused(kind, chargeId, code, message);
  // Concurrent changes of one charge wait here for each other until the caller commits; anything but a
  // succeeded charge is read unlocked, to be refused below (locked after all if it succeeded meanwhile).
  // Any connection's rows: a bigint may come back as a string, and JSON as its text, where the caller's
  // driver parses them so.
  const read = (row: ChargeRow | undefined): ChargeRow | undefined =>
    row && { ...row, payload: jsonObjectOf<ChargeRow['payload'] & object>(row.payload), result: jsonObjectOf<Hold>(row.result) };
  const locked = async () => read((await db.query(db.sql.lockChargeForChange(chargeId))).rows[0]);
  let charge = await locked();
  if (!charge) {
    charge = read((await db.query(db.sql.chargeForChange(chargeId))).rows[0]);
    if (charge?.kind === CHARGE && charge.status === 'succeeded') charge = (await locked()) ?? charge;
  }
  if (!charge) throw new OperationNotFoundError(chargeId);
  if (charge.kind !== CHARGE) throw refuse('not_a_charge', `operation ${chargeId} is a ${charge.kind}, not a charge`);
  if (!isAuthorization(charge)) {
    throw refuse('not_an_authorization', `charge ${chargeId} was captured automatically: it holds nothing to ${kind}${kind === 'cancel' ? '; refund it instead' : ''}`);
  }
  const hold = charge.result as Hold | null;
  const held = hold ? Number(hold.amount_capturable) : Number(charge.amount);
  const amount = amountOf(held);
  const effectKey = `${chargeId}/${key}`;
  /** What the charge's changes so far decide: this key's own change, or a refusal; undefined: go ahead. */
  const decided = (changes: ChangeRow[]): ChangeRequested | undefined => {
    const same = changes.find((c) => c.kind === kind && c.effect_key === effectKey);
    if (same) {
      if (Number(same.amount) === amount && (same.payload.reason ?? null) === reason) return { operationId: same.id, created: false };
      throw refuse('key_conflict', `key ${JSON.stringify(key)} is ${kind} operation ${same.id} of charge ${chargeId} (${same.amount}${same.payload.reason ? `, reason ${same.payload.reason}` : ''}): another amount or reason needs another key`);
    }
    const live = changes.filter((c) => c.status !== 'failed');
    const cancel = live.find((c) => c.kind === 'cancel');
    if (cancel) throw refuse('canceled', `charge ${chargeId} is cancelled, or its cancel ${cancel.id} is ${cancel.status}: it holds nothing`);
    const capture = live.find((c) => c.kind === 'capture');
    if (capture) {
      throw refuse('already_captured', `charge ${chargeId} is captured, or its capture ${capture.id} is ${capture.status}: ${kind === 'cancel' ? 'refund it instead' : 'an authorization is captured once'}`);
    }
    return undefined;
  };
  const changesNow = async (): Promise<ChangeRow[]> =>
    (await db.query(db.sql.changesOfCharge(chargeId, charge.order_id))).rows.map((c: ChangeRow) => ({ ...c, payload: jsonObjectOf<ChangePayload>(c.payload)! }));
  const earlier = decided(await changesNow());
  if (earlier) return earlier;
  if (charge.status !== 'succeeded') throw refuse('no_funds_held', `charge ${chargeId} is ${charge.status}: it holds no funds (only a succeeded authorization does)`);
  // Settled from a PaymentIntent already captured (in the dashboard, by a connected account): nothing held.
  if (hold?.status === 'succeeded' || held <= 0) {
    throw refuse('already_captured', `charge ${chargeId} was captured outside outboxd before it settled: ${kind === 'cancel' ? 'refund it instead' : 'nothing is held'}`);
  }
  if (hold?.capture_before && new Date(hold.capture_before) <= new Date(charge.now)) {
    throw refuse('expired', `charge ${chargeId}'s authorization expired at ${hold.capture_before}: it holds nothing`);
  }
  if (amount > held) throw refuse('exceeds_capturable', `a capture of ${amount} exceeds what charge ${chargeId} holds: ${held} ${charge.currency}`);
  const payload: ChangePayload = {
    payment_intent: charge.external_id!, // a succeeded charge's
    ...(charge.payload?.stripe_account ? { stripe_account: charge.payload.stripe_account } : {}),
    key,
    ...(reason ? { reason } : {}),
  };
  const { rows } = await db.query(
    db.sql.insertChangeOperation(kind, charge.order_id, amount, charge.currency, chargeId, effectKey, JSON.stringify(payload), activeTraceparent()),
  );
  if (!rows[0]) {
    // Not in one transaction (an autocommitting client), a concurrent request committed its change between
    // the read and the insert: the one-live-change index refused this one, which is decided as it would
    // have been had it come after.
    const later = decided(await changesNow());
    if (later) return later;
    throw new Error(`${kind} ${effectKey}: another change of charge ${chargeId} was being made; try again`);
  }
  return { operationId: rows[0].id, created: true };
}
