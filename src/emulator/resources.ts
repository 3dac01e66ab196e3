// Stripe's objects as the emulator makes them: PaymentIntents and Refunds, their validation, Stripe's
// test payment methods, and how an object changes status later (settled through the control API, or by
// itself after processingSettleMs).
import { clock, type Core } from './core.ts';
import type { FormValue } from './form.ts';
import { newId, str } from './http.ts';
import { REFUND_STATUSES, type LedgerEntry, type PaymentIntent, type Refund, type RefundEntry, type RefundStatus } from './state.ts';
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
/** Stripe's test cards that succeed; any other payment method is unknown, as at Stripe. */
const SUCCEEDING = [
  'pm_card_visa', 'pm_card_visa_debit', 'pm_card_mastercard', 'pm_card_mastercard_debit', 'pm_card_mastercard_prepaid',
  'pm_card_amex', 'pm_card_discover', 'pm_card_diners', 'pm_card_jcb', 'pm_card_unionpay',
];
const PAYMENT_METHODS = new Set([...SUCCEEDING, ...Object.keys(DECLINES), PROCESSING]);

export const SETTLE_STATUSES = ['succeeded', 'canceled', 'requires_payment_method'] as const;
export type SettleStatus = (typeof SETTLE_STATUSES)[number];
const REFUND_REASONS = new Set(['duplicate', 'fraudulent', 'requested_by_customer']);

export type Invalid = { param: string; message: string; code?: string };

export function newPaymentIntent(params: Record<string, FormValue>, metadata: Record<string, string>, now: number): PaymentIntent {
  const pm = str(params.payment_method);
  const confirmed = params.confirm === 'true';
  const decline = DECLINES[pm ?? ''];
  const status = !confirmed ? 'requires_confirmation' : decline ? 'requires_payment_method' : pm === PROCESSING ? 'processing' : 'succeeded';
  return {
    id: newId('pi'),
    object: 'payment_intent',
    amount: Number(params.amount),
    amount_received: status === 'succeeded' ? Number(params.amount) : 0,
    currency: String(params.currency).toLowerCase(),
    customer: str(params.customer),
    payment_method: pm,
    status,
    confirmation_method: 'automatic',
    capture_method: 'automatic',
    created: Math.floor(now / 1000),
    livemode: false,
    metadata,
    last_payment_error: decline ? { type: 'card_error', ...decline } : null,
  };
}

export function newRefund(params: Record<string, FormValue>, pi: PaymentIntent, metadata: Record<string, string>, status: RefundStatus, remaining: number, now: number): Refund {
  return {
    id: newId('re'),
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
  };
}

export function validateCreate(p: Record<string, FormValue>): Invalid | undefined {
  const amount = Number(p.amount);
  if (typeof p.amount !== 'string' || !Number.isSafeInteger(amount) || amount < 1)
    return { param: 'amount', message: 'Invalid positive integer' };
  if (amount > 99_999_999) return { param: 'amount', message: 'Amount must be no more than 99999999' };
  if (typeof p.currency !== 'string' || !/^[a-zA-Z]{3}$/.test(p.currency)) return { param: 'currency', message: 'Invalid currency' };
  if (p.payment_method !== undefined && !(typeof p.payment_method === 'string' && PAYMENT_METHODS.has(p.payment_method)))
    return { param: 'payment_method', message: `No such PaymentMethod: '${String(p.payment_method)}'`, code: 'resource_missing' };
  if (p.confirm === 'true' && typeof p.payment_method !== 'string')
    return { param: 'payment_method', message: 'You must provide a payment_method to confirm this PaymentIntent.' };
  return undefined;
}

export function validateRefund(p: Record<string, FormValue>, pi: PaymentIntent | undefined): Invalid | undefined {
  if (typeof p.payment_intent !== 'string') return { param: 'payment_intent', message: 'You must provide a payment_intent to refund.' };
  if (!pi) return { param: 'payment_intent', message: `No such payment_intent: '${p.payment_intent}'`, code: 'resource_missing' };
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
  await emitIntent(core, pi);
  return pi;
}

/** The PaymentIntent as of now: a processing one may have finished (processingSettleMs). */
export async function currentIntent(core: Core, entry: LedgerEntry): Promise<PaymentIntent> {
  const settleMs = core.opts.processingSettleMs;
  if (entry.paymentIntent.status === 'processing' && settleMs !== undefined && (await clock(core)) - entry.createdAtMs >= settleMs) {
    return settleIntent(core, entry.paymentIntent.id, 'succeeded');
  }
  return entry.paymentIntent;
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
  await emit(core, status === 'failed' ? 'refund.failed' : 'refund.updated', refund);
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
