// Stripe's objects as the emulator makes them: PaymentIntents (with their charge, when expanded) and
// Refunds, their validation, Stripe's test payment methods, captures and cancels, and how an object
// changes status later (settled through the control API, by itself after processingSettleMs, or an
// authorization that expires).
import { clock, type Core } from './core.ts';
import type { FormValue } from './form.ts';
import { error, isRecord, json, newId, str } from './http.ts';
import { REFUND_STATUSES, type IntentChange, type LedgerEntry, type PaymentIntent, type Refund, type RefundEntry, type RefundStatus } from './state.ts';
import { emit, emitIntent } from './webhooks.ts';

/** Stripe's test payment methods, and what a confirmed off-session charge with each does. */
export const DECLINES: Record<string, { code: string; decline_code?: string; message: string }> = {
  pm_card_chargeDeclined: { code: 'card_declined', decline_code: 'generic_decline', message: 'Your card was declined.' },
  pm_card_chargeDeclinedInsufficientFunds: {
    code: 'card_declined',
    decline_code: 'insufficient_funds',
    message: 'Your card has insufficient funds.',
  },
  pm_card_authenticationRequired: {
    code: 'authentication_required',
    message: 'Your card was declined. This transaction requires authentication.',
  },
};
const PROCESSING = 'pm_card_processing';
/** A wallet (PayPal, say): it succeeds, and an authorization on it says no capture_before (only a card's does). */
const WALLET = 'pm_paypal';
/** Stripe's test cards that succeed; any other payment method is unknown, as at Stripe. */
const SUCCEEDING = [
  'pm_card_visa', 'pm_card_visa_debit', 'pm_card_mastercard', 'pm_card_mastercard_debit', 'pm_card_mastercard_prepaid',
  'pm_card_amex', 'pm_card_discover', 'pm_card_diners', 'pm_card_jcb', 'pm_card_unionpay',
];
const PAYMENT_METHODS = new Set([...SUCCEEDING, ...Object.keys(DECLINES), PROCESSING, WALLET]);

export const SETTLE_STATUSES = ['succeeded', 'canceled', 'requires_payment_method', 'requires_capture'] as const;
export type SettleStatus = (typeof SETTLE_STATUSES)[number];
const REFUND_REASONS = new Set(['duplicate', 'fraudulent', 'requested_by_customer']);
const CANCELLATION_REASONS = new Set(['duplicate', 'fraudulent', 'requested_by_customer', 'abandoned']);
/** The statuses a cancel accepts (Stripe also cancels `processing` "in rare cases"; the emulator never does). */
const CANCELABLE = ['requires_payment_method', 'requires_capture', 'requires_confirmation', 'requires_action'];
/** How long a card authorization holds (Stripe: 7 days for most card-not-present payments). */
const AUTHORIZATION_MS = 7 * 24 * 60 * 60 * 1000;
const ACCOUNT = /^acct_[A-Za-z0-9]+$/;

export type Invalid = { param: string; message: string; code?: string };

export function newPaymentIntent(params: Record<string, FormValue>, metadata: Record<string, string>, now: number): PaymentIntent {
  const pm = str(params.payment_method);
  const confirmed = params.confirm === 'true';
  const manual = params.capture_method === 'manual';
  const decline = DECLINES[pm ?? ''];
  const status = !confirmed ? 'requires_confirmation' : decline ? 'requires_payment_method' : pm === PROCESSING ? 'processing' : manual ? 'requires_capture' : 'succeeded';
  const transfer = isRecord(params.transfer_data) ? params.transfer_data : undefined;
  return {
    id: newId('pi'),
    object: 'payment_intent',
    amount: Number(params.amount),
    amount_capturable: status === 'requires_capture' ? Number(params.amount) : 0,
    amount_received: status === 'succeeded' ? Number(params.amount) : 0,
    currency: String(params.currency).toLowerCase(),
    customer: str(params.customer),
    payment_method: pm,
    status,
    confirmation_method: 'automatic',
    capture_method: manual ? 'manual' : 'automatic',
    canceled_at: null,
    cancellation_reason: null,
    created: Math.floor(now / 1000),
    livemode: false,
    metadata,
    last_payment_error: decline ? { type: 'card_error', ...decline } : null,
    latest_charge: confirmed ? newId('ch') : null,
    transfer_data: transfer ? { destination: String(transfer.destination), ...(transfer.amount !== undefined ? { amount: Number(transfer.amount) } : {}) } : null,
    application_fee_amount: params.application_fee_amount === undefined ? null : Number(params.application_fee_amount),
  };
}

/** When an authorization (a manual-capture PaymentIntent's charge) expires, in ms: Stripe's
 * payment_method_details.card.capture_before. */
export const captureBeforeMs = (pi: PaymentIntent): number => pi.created * 1000 + AUTHORIZATION_MS;

/** The PaymentIntent's charge, as `expand[]=latest_charge` shows it: derived from the PaymentIntent. */
export function chargeOf(pi: PaymentIntent) {
  return {
    id: pi.latest_charge,
    object: 'charge',
    amount: pi.amount,
    amount_captured: pi.amount_received,
    captured: pi.status === 'succeeded',
    currency: pi.currency,
    customer: pi.customer,
    created: pi.created,
    metadata: pi.metadata,
    payment_intent: pi.id,
    payment_method: pi.payment_method,
    payment_method_details:
      pi.payment_method === WALLET
        ? { type: 'paypal', paypal: {} }
        : { type: 'card', card: { capture_before: pi.capture_method === 'manual' ? Math.floor(captureBeforeMs(pi) / 1000) : null } },
    status: pi.status === 'requires_payment_method' ? 'failed' : pi.status === 'processing' ? 'pending' : 'succeeded',
    transfer_data: pi.transfer_data ?? null,
    application_fee_amount: pi.application_fee_amount ?? null,
  };
}

/** The PaymentIntent as a response shows it: its charge expanded when the request asked (`expand[]=latest_charge`). */
export function present(pi: PaymentIntent, expand: string[]): object {
  return expand.includes('latest_charge') && pi.latest_charge ? { ...pi, latest_charge: chargeOf(pi) } : pi;
}

/** The `expand[]` of a form-encoded request. */
export const expandOf = (params: Record<string, FormValue>): string[] => (Array.isArray(params.expand) ? params.expand.filter((x): x is string => typeof x === 'string') : []);

/** A Stripe-Account header: absent, or a connected account's id. */
export const validAccount = (account: string | null): boolean => account === null || ACCOUNT.test(account);

export function newRefund(params: Record<string, FormValue>, pi: PaymentIntent, metadata: Record<string, string>, status: RefundStatus, remaining: number, now: number): Refund {
  const reverses = params.reverse_transfer === 'true' && pi.transfer_data != null;
  return {
    // A bank debit's refund (pm_card_processing stands for one) is a pyr_, as Stripe names those.
    id: newId(pi.payment_method === PROCESSING ? 'pyr' : 're'),
    object: 'refund',
    // Without an amount, Stripe refunds what remains.
    amount: params.amount === undefined ? remaining : Number(params.amount),
    currency: pi.currency,
    payment_intent: pi.id,
    status,
    reason: str(params.reason),
    created: Math.floor(now / 1000),
    metadata,
    charge: null,
    balance_transaction: null,
    transfer_reversal: reverses ? newId('trr') : null,
  };
}

export function validateCreate(p: Record<string, FormValue>, account: string | null): Invalid | undefined {
  const amount = Number(p.amount);
  if (typeof p.amount !== 'string' || !Number.isSafeInteger(amount) || amount < 1)
    return { param: 'amount', message: 'Invalid positive integer' };
  if (amount > 99_999_999) return { param: 'amount', message: 'Amount must be no more than 99999999' };
  if (typeof p.currency !== 'string' || !/^[a-zA-Z]{3}$/.test(p.currency)) return { param: 'currency', message: 'Invalid currency' };
  if (p.payment_method !== undefined && !(typeof p.payment_method === 'string' && PAYMENT_METHODS.has(p.payment_method)))
    return { param: 'payment_method', message: `No such PaymentMethod: '${String(p.payment_method)}'`, code: 'resource_missing' };
  if (p.confirm === 'true' && typeof p.payment_method !== 'string')
    return { param: 'payment_method', message: 'You must provide a payment_method to confirm this PaymentIntent.' };
  if (p.capture_method !== undefined && p.capture_method !== 'automatic' && p.capture_method !== 'manual')
    return { param: 'capture_method', message: 'Invalid capture_method: must be one of automatic, manual' };
  if (p.transfer_data !== undefined) {
    const destination = isRecord(p.transfer_data) ? p.transfer_data.destination : undefined;
    if (typeof destination !== 'string' || !ACCOUNT.test(destination)) return { param: 'transfer_data[destination]', message: `No such destination: '${String(destination)}'` };
    const transferAmount = (p.transfer_data as Record<string, FormValue>).amount;
    if (transferAmount !== undefined && !(typeof transferAmount === 'string' && Number.isSafeInteger(Number(transferAmount)) && Number(transferAmount) >= 0 && Number(transferAmount) <= amount))
      return { param: 'transfer_data[amount]', message: 'Invalid non-negative integer, at most the amount' };
  }
  if (p.application_fee_amount !== undefined) {
    const fee = Number(p.application_fee_amount);
    if (typeof p.application_fee_amount !== 'string' || !Number.isSafeInteger(fee) || fee < 0) return { param: 'application_fee_amount', message: 'Invalid non-negative integer' };
    if (fee > amount) return { param: 'application_fee_amount', message: 'The application fee amount must be less than or equal to the amount.' };
    if (account === null && p.transfer_data === undefined)
      return {
        param: 'application_fee_amount',
        message: 'Can only apply an application_fee_amount when the PaymentIntent is attempting a direct payment (using an OAuth key or Stripe-Account header) or destination payment (using `transfer_data[destination]`).',
      };
  }
  return undefined;
}

const BOOLEAN_PARAMS = ['reverse_transfer', 'refund_application_fee'];

/** POST /v1/payment_intents/:id/capture's parameters. */
export function validateCapture(p: Record<string, FormValue>): Invalid | undefined {
  for (const param of ['amount_to_capture', 'application_fee_amount']) {
    const v = p[param];
    if (v !== undefined && !(typeof v === 'string' && Number.isSafeInteger(Number(v)) && Number(v) >= (param === 'amount_to_capture' ? 1 : 0)))
      return { param, message: param === 'amount_to_capture' ? 'Invalid positive integer' : 'Invalid non-negative integer' };
  }
  return undefined;
}

/** POST /v1/payment_intents/:id/cancel's parameters. */
export function validateCancel(p: Record<string, FormValue>): Invalid | undefined {
  if (p.cancellation_reason !== undefined && !(typeof p.cancellation_reason === 'string' && CANCELLATION_REASONS.has(p.cancellation_reason)))
    return { param: 'cancellation_reason', message: `Invalid cancellation_reason: must be one of ${[...CANCELLATION_REASONS].join(', ')}` };
  return undefined;
}

/** Stripe's 400 for an action the PaymentIntent's status does not allow; the error carries the PaymentIntent. */
function unexpectedState(pi: PaymentIntent, message: string) {
  return { refused: { status: 400, body: json(error('invalid_request_error', message, { code: 'payment_intent_unexpected_state', payment_intent: pi })) } };
}

/** A capture, decided on the PaymentIntent as stored: all of what it holds, or `amount_to_capture` of
 * it (the rest is released). `respond` makes the response stored under the key. */
export function capture(pi: PaymentIntent, p: Record<string, FormValue>, respond: (pi: PaymentIntent) => { status: number; body: string }): IntentChange {
  if (pi.status !== 'requires_capture') {
    return unexpectedState(pi, pi.status === 'succeeded'
      ? 'This PaymentIntent could not be captured because it has already been captured.'
      : `This PaymentIntent could not be captured because it has a status of ${pi.status}. Only a PaymentIntent with one of the following statuses may be captured: requires_capture.`);
  }
  const capturable = pi.amount_capturable ?? 0;
  const amount = p.amount_to_capture === undefined ? capturable : Number(p.amount_to_capture);
  if (amount > capturable) {
    return { refused: { status: 400, body: json(error('invalid_request_error', 'The payment could not be captured because the requested capture amount is greater than the amount you can capture for this charge.', { code: 'amount_too_large', param: 'amount_to_capture' })) } };
  }
  const captured: PaymentIntent = {
    ...pi,
    status: 'succeeded',
    amount_received: amount,
    amount_capturable: 0,
    ...(p.application_fee_amount !== undefined ? { application_fee_amount: Number(p.application_fee_amount) } : {}),
  };
  return { paymentIntent: captured, response: respond(captured) };
}

/** A cancel, decided on the PaymentIntent as stored: what it holds is released. */
export function cancel(pi: PaymentIntent, p: Record<string, FormValue>, now: number, respond: (pi: PaymentIntent) => { status: number; body: string }): IntentChange {
  if (!CANCELABLE.includes(pi.status)) {
    return unexpectedState(pi, `You cannot cancel this PaymentIntent because it has a status of ${pi.status}. Only a PaymentIntent with one of the following statuses may be canceled: ${CANCELABLE.join(', ')}.`);
  }
  const canceled: PaymentIntent = { ...pi, status: 'canceled', amount_capturable: 0, canceled_at: Math.floor(now / 1000), cancellation_reason: str(p.cancellation_reason) };
  return { paymentIntent: canceled, response: respond(canceled) };
}

/** An authorization that expired: canceled by Stripe (`expired`, as since API version 2025-03-31.basil),
 * what it held released. Refused when it no longer requires capture. */
export function expire(pi: PaymentIntent, now: number): IntentChange {
  if (pi.status !== 'requires_capture') return unexpectedState(pi, `This PaymentIntent has a status of ${pi.status}: only an authorization (requires_capture) expires.`);
  const expired: PaymentIntent = { ...pi, status: 'canceled', amount_capturable: 0, canceled_at: Math.floor(now / 1000), cancellation_reason: 'expired' };
  return { paymentIntent: expired, response: { status: 200, body: json(expired) } };
}

export function validateRefund(p: Record<string, FormValue>, pi: PaymentIntent | undefined): Invalid | undefined {
  if (typeof p.payment_intent !== 'string') return { param: 'payment_intent', message: 'You must provide a payment_intent to refund.' };
  if (!pi) return { param: 'payment_intent', message: `No such payment_intent: '${p.payment_intent}'`, code: 'resource_missing' };
  for (const param of BOOLEAN_PARAMS) {
    if (p[param] !== undefined && p[param] !== 'true' && p[param] !== 'false') return { param, message: 'Invalid boolean' };
  }
  if (p.amount !== undefined) {
    const amount = Number(p.amount);
    if (typeof p.amount !== 'string' || !Number.isSafeInteger(amount) || amount < 1) return { param: 'amount', message: 'Invalid positive integer' };
  }
  if (p.reason !== undefined && !(typeof p.reason === 'string' && REFUND_REASONS.has(p.reason))) {
    return { param: 'reason', message: `Invalid reason: must be one of ${[...REFUND_REASONS].join(', ')}` };
  }
  if (pi.status !== 'succeeded') {
    return { param: 'payment_intent', message: `This PaymentIntent (${pi.id}) does not have a successful charge to refund.`, code: 'charge_not_refundable' };
  }
  return undefined;
}

/** Moves a PaymentIntent to a final status, as Stripe does when `processing` finishes. */
export async function settleIntent(core: Core, paymentIntentId: string, status: SettleStatus): Promise<PaymentIntent> {
  if (!SETTLE_STATUSES.includes(status)) throw new Error(`status must be one of ${SETTLE_STATUSES.join(', ')}`);
  const pi = await core.state.setStatus(paymentIntentId, status);
  if (!pi) throw new Error(`no payment intent ${paymentIntentId}`);
  await emitIntent(core, pi, (await core.state.intent(paymentIntentId))?.account ?? null);
  return pi;
}

/** Expires an authorization now (the control API's expire, or its capture_before passed), with its
 * payment_intent.canceled event. Throws when it is not an authorization. */
export async function expireIntent(core: Core, paymentIntentId: string): Promise<PaymentIntent> {
  const now = await clock(core);
  const result = await core.state.changeIntent(paymentIntentId, (pi) => expire(pi, now), null);
  if (!result) throw new Error(`no payment intent ${paymentIntentId}`);
  if ('refused' in result) throw new Error(`${paymentIntentId} is not an authorization (requires_capture)`);
  await emitIntent(core, result.paymentIntent, (await core.state.intent(paymentIntentId))?.account ?? null);
  return result.paymentIntent;
}

/** What a payment that was processing becomes once its bank says yes: an authorization holds the funds. */
export const processed = (pi: PaymentIntent): SettleStatus => (pi.capture_method === 'manual' ? 'requires_capture' : 'succeeded');

/** The PaymentIntent as of now: a processing one may have finished (processingSettleMs), an
 * authorization may have expired (capture_before, on the emulator clock). */
export async function currentIntent(core: Core, entry: LedgerEntry): Promise<PaymentIntent> {
  const pi = entry.paymentIntent;
  const settleMs = core.opts.processingSettleMs;
  if (pi.status === 'processing' && settleMs !== undefined && (await clock(core)) - entry.createdAtMs >= settleMs) {
    return settleIntent(core, pi.id, processed(pi));
  }
  if (pi.status === 'requires_capture' && (await clock(core)) >= captureBeforeMs(pi)) {
    return expireIntent(core, pi.id).catch(async () => (await core.state.intent(pi.id))!.paymentIntent);
  }
  return pi;
}

export async function currentIntents(core: Core, entries: LedgerEntry[]): Promise<PaymentIntent[]> {
  const out: PaymentIntent[] = [];
  for (const e of entries) out.push(await currentIntent(core, e));
  return out;
}

/** Moves a refund to a status, as Stripe does when a pending refund finishes (or fails). */
export async function settleRefund(core: Core, refundId: string, status: RefundStatus): Promise<Refund> {
  if (!REFUND_STATUSES.includes(status)) throw new Error(`status must be one of ${REFUND_STATUSES.join(', ')}`);
  const refund = await core.state.setRefundStatus(refundId, status);
  if (!refund) throw new Error(`no refund ${refundId}`);
  await emit(core, status === 'failed' ? 'refund.failed' : 'refund.updated', refund, (await core.state.refund(refundId))?.account ?? null);
  return refund;
}

/** The refund as of now: a pending one may have finished (processingSettleMs). */
export async function currentRefund(core: Core, entry: RefundEntry): Promise<Refund> {
  const settleMs = core.opts.processingSettleMs;
  if (entry.refund.status === 'pending' && settleMs !== undefined && (await clock(core)) - entry.createdAtMs >= settleMs) {
    return settleRefund(core, entry.refund.id, 'succeeded');
  }
  return entry.refund;
}

/** A Stripe list page: newest first, `created[gte]`, `limit` (1–100, default 10), `starting_after`. */
export function listPage<T extends { id: string; created: number }>(items: T[], url: URL, path: string) {
  const limit = Math.min(Math.max(Number(url.searchParams.get('limit') ?? 10) || 10, 1), 100);
  const gte = Number(url.searchParams.get('created[gte]') ?? 0);
  const all = items.filter((x) => x.created >= gte).sort((a, b) => b.created - a.created || (a.id < b.id ? -1 : 1));
  const after = url.searchParams.get('starting_after');
  const start = after ? all.findIndex((x) => x.id === after) + 1 : 0;
  return { object: 'list', data: all.slice(start, start + limit), has_more: start + limit < all.length, url: path };
}
