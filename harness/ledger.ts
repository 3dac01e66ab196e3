// The agreement check shared by the demo and chaos: the emulator's ledger is the truth about money,
// PaymentIntents for the charges (and their authorizations' captures and cancels) and Refunds for the
// refunds; its request log shows which key and which account every request carried.
import type { Pool } from '../src/db/pool.ts';
import { accountOf, cancelIdempotencyKeyFor, captureIdempotencyKeyFor, idempotencyKeyFor, refundIdempotencyKeyFor, type StripeAccount } from '../src/stripe/gateway.ts';
import type { Operation } from '../src/engine/operation.ts';
import type { LedgerEntry, PaymentIntent, RefundEntry, RequestLogEntry, StripeEmulator } from '../src/emulator/index.ts';

/** The key prefix of the captures and cancels chaos makes from outside outboxd, as a dashboard would. */
export const OUTSIDE_KEY_PREFIX = 'dashboard:';

export interface Violation {
  kind:
    | 'double_charge'
    | 'failed_but_charged'
    | 'succeeded_without_charge'
    | 'amount_mismatch'
    | 'orphan_charge'
    | 'create_without_our_key'
    | 'double_refund'
    | 'failed_but_refunded'
    | 'succeeded_without_refund'
    | 'refund_without_operation'
    | 'over_refund'
    | 'double_capture'
    | 'over_capture'
    | 'capture_mismatch'
    | 'cancel_mismatch'
    | 'double_change'
    | 'unrecorded_change'
    | 'change_without_our_key'
    | 'wrong_account';
  operationId: string | null;
  detail: string;
}

export interface Agreement {
  operations: Operation[];
  violations: Violation[];
  /** Succeeded charges (and authorizations) per operation id. */
  paid: Map<string, number>;
}

export async function checkAgainstLedger(pool: Pool, emulator: StripeEmulator): Promise<Agreement> {
  const operations: Operation[] = (await pool.query(`select * from outboxd.payment_operations order by created_at, id`)).rows;
  const byId = new Map(operations.map((o) => [o.id, o]));
  const violations: Violation[] = [];
  const paid = new Map<string, number>();
  const ledger = emulator.ledger();
  for (const { paymentIntent: pi } of ledger) {
    const opId = pi.metadata.operation_id ?? null;
    const op = opId ? byId.get(opId) : undefined;
    if (op?.kind !== 'charge') {
      violations.push({ kind: 'orphan_charge', operationId: opId, detail: `${pi.id} (${pi.status}) names no charge operation` });
      continue;
    }
    if (!charged(pi)) continue;
    paid.set(op.id, (paid.get(op.id) ?? 0) + 1);
    if (pi.amount !== op.amount || pi.currency !== op.currency) {
      violations.push({ kind: 'amount_mismatch', operationId: op.id, detail: `${pi.id} is ${pi.amount} ${pi.currency}, operation ${op.amount} ${op.currency}` });
    }
  }
  for (const op of operations.filter((o) => o.kind === 'charge')) {
    const n = paid.get(op.id) ?? 0;
    if (n > 1) violations.push({ kind: 'double_charge', operationId: op.id, detail: `${n} succeeded charges or authorizations` });
    if (op.status === 'failed' && n > 0) violations.push({ kind: 'failed_but_charged', operationId: op.id, detail: `failed, but ${n} succeeded charge(s) or authorization(s)` });
    if (op.status === 'succeeded') {
      const charge = ledger.find((l) => l.paymentIntent.id === op.external_id)?.paymentIntent;
      const hold = isHold(op);
      if (!charge || !charged(charge) || (charge.capture_method === 'manual') !== hold) {
        violations.push({ kind: 'succeeded_without_charge', operationId: op.id, detail: `external_id ${op.external_id} is ${charge ? `${charge.status} (${charge.capture_method})` : 'not in the ledger'}; the operation asked for ${hold ? 'an authorization' : 'a charge'}` });
      }
    }
  }
  const requests = emulator.requests();
  violations.push(...refundViolations(emulator, byId));
  violations.push(...changeViolations(ledger, requests, operations));
  violations.push(...accountViolations(ledger, emulator.refundLedger(), requests, byId));
  for (const r of requests) {
    const expected = r.endpoint === 'create' ? idempotencyKeyFor : r.endpoint === 'create_refund' ? refundIdempotencyKeyFor : undefined;
    if (expected && r.operationId && r.idempotencyKey !== expected(r.operationId)) {
      violations.push({ kind: 'create_without_our_key', operationId: r.operationId, detail: `${r.endpoint} ${r.requestId} with key ${r.idempotencyKey}` });
    }
  }
  return { operations, violations, paid };
}

const isHold = (op: Operation): boolean => (op.payload as { capture_method?: string } | null)?.capture_method === 'manual';

/** Whether a PaymentIntent took the customer's money: an automatic charge that succeeded, or an
 * authorization that was held (whatever happened to it after: captured, cancelled, expired). */
const charged = (pi: PaymentIntent): boolean =>
  pi.capture_method === 'manual' ? ['requires_capture', 'succeeded', 'canceled'].includes(pi.status) : pi.status === 'succeeded';

/** A capture or cancel request that Stripe carried out: not refused, not a replay, not answered before
 * the change (faults before commit answer 503 or 429; a 500 is an error_after_commit's). */
const changed = (r: RequestLogEntry): boolean =>
  (r.endpoint === 'capture' || r.endpoint === 'cancel') && !r.replayed && (r.status === 200 || r.status === 500 || typeof r.status === 'string');

/**
 * Authorizations against their captures and cancels: each PaymentIntent changed at most once (captured
 * or cancelled, by outboxd or from outside), never captured for more than it held, under a key that
 * names one of its charge's operations (or the outside's); a succeeded capture ⇔ its PaymentIntent
 * captured for exactly that amount, a failed one ⇔ cancelled or expired, captured from outside for
 * another amount ⇔ in review; a succeeded cancel ⇔ cancelled, a failed one ⇔ captured; at most one
 * change of a charge is not failed; and once its changes settled, a hold captured or released (by anyone)
 * is recorded by a succeeded capture or cancel of its charge (the webhook's or the reconcile sweep's
 * record of one made outside), or a capture a person decides: the application hears of it, and a refund
 * may return what a capture took.
 */
function changeViolations(ledger: LedgerEntry[], requests: RequestLogEntry[], operations: Operation[]): Violation[] {
  const violations: Violation[] = [];
  const changes = operations.filter((o) => o.kind === 'capture' || o.kind === 'cancel');
  /** The charge operation of a PaymentIntent that settled as a hold (not one found captured already). */
  const chargeOp = (id: string | null) => {
    const op = operations.find((o) => o.id === id && o.kind === 'charge' && o.status === 'succeeded');
    return op && ((op.result as { status?: string } | null)?.status ?? 'requires_capture') === 'requires_capture' ? op : undefined;
  };
  const intentOf = (op: Operation) => (op.payload as { payment_intent: string }).payment_intent;
  const changeRequests = new Map<string, RequestLogEntry[]>();
  for (const r of requests) {
    const pi = /^\/v1\/payment_intents\/(pi_\w+)\/(capture|cancel)$/.exec(r.path)?.[1];
    if (pi) changeRequests.set(pi, [...(changeRequests.get(pi) ?? []), r]);
  }
  for (const { paymentIntent: pi } of ledger) {
    if (pi.capture_method !== 'manual') continue;
    const charge = pi.metadata.operation_id ?? null;
    const mine = changes.filter((c) => intentOf(c) === pi.id);
    const sent = changeRequests.get(pi.id) ?? [];
    for (const r of sent) {
      const ours = mine.some((c) => r.idempotencyKey === (r.endpoint === 'capture' && c.kind === 'capture' ? captureIdempotencyKeyFor(c.id) : r.endpoint === 'cancel' && c.kind === 'cancel' ? cancelIdempotencyKeyFor(c.id) : undefined));
      if (!ours && !r.idempotencyKey?.startsWith(OUTSIDE_KEY_PREFIX)) {
        violations.push({ kind: 'change_without_our_key', operationId: charge, detail: `${r.endpoint} ${r.requestId} of ${pi.id} with key ${r.idempotencyKey}` });
      }
    }
    const done = sent.filter(changed);
    const expected = pi.status === 'succeeded' || (pi.status === 'canceled' && pi.cancellation_reason !== 'expired') ? 1 : 0;
    if (done.length !== expected) {
      violations.push({ kind: 'double_capture', operationId: charge, detail: `${pi.id} is ${pi.status}, changed by ${done.length} request(s): ${done.map((r) => `${r.endpoint} ${r.idempotencyKey}`).join(', ')}` });
    }
    if (pi.amount_received > pi.amount) violations.push({ kind: 'over_capture', operationId: charge, detail: `${pi.id} captured ${pi.amount_received} of the ${pi.amount} it held` });
    const by = done.length === 1 ? done[0]!.idempotencyKey : null;
    const held = chargeOp(charge);
    const open = mine.some((c) => (c.status === 'pending' || c.status === 'unknown') && !c.review_reason);
    if (held && !open && (pi.status === 'succeeded' || pi.status === 'canceled')) {
      const recorded = mine.some((c) =>
        pi.status === 'succeeded'
          ? c.kind === 'capture' && ((c.status === 'succeeded' && c.amount === pi.amount_received) || (c.review_reason !== null && c.status !== 'failed'))
          : c.kind === 'cancel' && c.status === 'succeeded',
      );
      if (!recorded) {
        violations.push({ kind: 'unrecorded_change', operationId: charge, detail: `${pi.id} is ${pi.status} (received ${pi.amount_received}, ${pi.cancellation_reason ?? 'not cancelled'}, changed by ${by ?? 'Stripe'}); the charge's changes: ${mine.map((c) => `${c.kind} ${c.status}`).join(', ') || 'none'}` });
      }
    }
    const live = mine.filter((c) => c.status !== 'failed');
    if (live.length > 1) violations.push({ kind: 'double_change', operationId: charge, detail: `${live.length} changes not failed: ${live.map((c) => `${c.kind} ${c.id} ${c.status}`).join(', ')}` });
    for (const op of mine) {
      const outside = by?.startsWith(OUTSIDE_KEY_PREFIX) ?? false;
      const own = by === (op.kind === 'capture' ? captureIdempotencyKeyFor(op.id) : cancelIdempotencyKeyFor(op.id));
      const want = op.kind === 'capture' ? captureShould(op, pi, own, outside) : cancelShould(pi);
      const is = op.status === 'succeeded' || op.status === 'failed' ? op.status : op.review_reason ? 'in review' : 'open';
      if (own && pi.status === 'succeeded' && pi.amount_received !== op.amount) {
        violations.push({ kind: 'over_capture', operationId: op.id, detail: `${pi.id} captured ${pi.amount_received} under this capture's key; it asked for ${op.amount}` });
      }
      if (is === 'open') continue; // the run's unsettled check judges it
      if (is !== want || (is === 'succeeded' && op.external_id !== pi.id)) {
        violations.push({
          kind: op.kind === 'capture' ? 'capture_mismatch' : 'cancel_mismatch',
          operationId: op.id,
          detail: `${op.kind} of ${op.amount} is ${is}${op.review_reason ? ` (${op.review_reason})` : ''}, external_id ${op.external_id}; ${pi.id} is ${pi.status} (received ${pi.amount_received}, ${pi.cancellation_reason ?? 'not cancelled'}, changed by ${by ?? 'no request'}): it should be ${want === 'open' ? 'unsettled (nothing changed the authorization)' : want}`,
        });
      }
    }
  }
  return violations;
}

/** What a capture operation should be, given its PaymentIntent and whose request changed it. */
function captureShould(op: Operation, pi: PaymentIntent, own: boolean, outside: boolean): 'succeeded' | 'failed' | 'in review' | 'open' {
  if (pi.status === 'canceled') return 'failed';
  if (pi.status !== 'succeeded') return 'open';
  // Captured by this capture or from outside: for this capture's amount it happened, for another a person
  // decides; captured by anything else (another capture of the charge: a double_change), it did not.
  if (own || outside) return pi.amount_received === op.amount ? 'succeeded' : 'in review';
  return 'failed';
}

/** What a cancel operation should be: released ⇔ succeeded; captured (by anyone) ⇔ failed. */
const cancelShould = (pi: PaymentIntent): 'succeeded' | 'failed' | 'open' => (pi.status === 'canceled' ? 'succeeded' : pi.status === 'succeeded' ? 'failed' : 'open');

/** The account an operation's requests must carry: its charge's (a refund's, capture's or cancel's parent). */
function accountFor(op: Operation, byId: Map<string, Operation>): StripeAccount {
  const charge = op.kind === 'charge' ? op : op.parent_operation_id ? byId.get(op.parent_operation_id) : undefined;
  return charge ? accountOf(charge) : accountOf(op);
}

/**
 * Connect: every PaymentIntent was made on its charge's account (a destination charge on the platform,
 * with the destination and the fee it asked), every refund on its PaymentIntent's, and every request
 * that names a PaymentIntent, a refund or an operation carried that account.
 */
function accountViolations(ledger: LedgerEntry[], refunds: RefundEntry[], requests: RequestLogEntry[], byId: Map<string, Operation>): Violation[] {
  const violations: Violation[] = [];
  const where = (a: StripeAccount) => a ?? 'the platform';
  const intentAccount = new Map(ledger.map((e) => [e.paymentIntent.id, e.account]));
  const refundAccount = new Map(refunds.map((e) => [e.refund.id, e.account]));
  for (const { paymentIntent: pi, account } of ledger) {
    const op = byId.get(pi.metadata.operation_id ?? '');
    if (op?.kind !== 'charge') continue;
    const asked = op.payload as { transfer_destination?: string; application_fee_amount?: number } | null;
    const problems = [
      account !== accountOf(op) && `made on ${where(account)}, the charge is on ${where(accountOf(op))}`,
      (pi.transfer_data?.destination ?? null) !== (asked?.transfer_destination ?? null) && `transfers to ${pi.transfer_data?.destination ?? 'nobody'}, the charge asked ${asked?.transfer_destination ?? 'none'}`,
      (pi.application_fee_amount ?? null) !== (asked?.application_fee_amount ?? null) && `takes a fee of ${pi.application_fee_amount}, the charge asked ${asked?.application_fee_amount ?? 'none'}`,
    ].filter(Boolean);
    for (const p of problems) violations.push({ kind: 'wrong_account', operationId: op.id, detail: `${pi.id} ${p}` });
  }
  for (const { refund, account } of refunds) {
    if (intentAccount.has(refund.payment_intent) && account !== intentAccount.get(refund.payment_intent)) {
      violations.push({ kind: 'wrong_account', operationId: refund.metadata.operation_id ?? null, detail: `${refund.id} made on ${where(account)}, ${refund.payment_intent} is on ${where(intentAccount.get(refund.payment_intent)!)}` });
    }
  }
  for (const r of requests) {
    const pi = /\/(pi_\w+)/.exec(r.path)?.[1];
    const re = /\/(re_\w+)/.exec(r.path)?.[1];
    const op = r.operationId ? byId.get(r.operationId) : undefined;
    const expected = pi && intentAccount.has(pi) ? intentAccount.get(pi)! : re && refundAccount.has(re) ? refundAccount.get(re)! : op ? accountFor(op, byId) : undefined;
    if (expected !== undefined && r.account !== expected) {
      violations.push({ kind: 'wrong_account', operationId: r.operationId, detail: `${r.method} ${r.path} (${r.requestId}, ${r.endpoint}) on ${where(r.account)}, not ${where(expected)}` });
    }
  }
  return violations;
}

/** No refund without its operation, no operation refunded twice, a succeeded refund operation ⇔ a
 * succeeded refund, and never more refunded than charged. */
function refundViolations(emulator: StripeEmulator, byId: Map<string, Operation>): Violation[] {
  const violations: Violation[] = [];
  const refunds = emulator.refundLedger().map((e) => e.refund);
  const held = new Map<string, number>();
  const refunded = new Map<string, number>();
  for (const r of refunds) {
    const opId = r.metadata.operation_id ?? null;
    const op = opId ? byId.get(opId) : undefined;
    if (op?.kind !== 'refund') {
      violations.push({ kind: 'refund_without_operation', operationId: opId, detail: `${r.id} (${r.status}, ${r.amount} of ${r.payment_intent}) names no refund operation` });
      continue;
    }
    if (r.status !== 'failed' && r.status !== 'canceled') held.set(op.id, (held.get(op.id) ?? 0) + 1);
    if (r.status === 'succeeded') refunded.set(r.payment_intent, (refunded.get(r.payment_intent) ?? 0) + r.amount);
    if (r.amount !== op.amount || r.currency !== op.currency) {
      violations.push({ kind: 'amount_mismatch', operationId: op.id, detail: `${r.id} is ${r.amount} ${r.currency}, operation ${op.amount} ${op.currency}` });
    }
    if (r.status === 'succeeded' && op.status === 'failed') violations.push({ kind: 'failed_but_refunded', operationId: op.id, detail: `failed, but ${r.id} succeeded` });
  }
  for (const [opId, n] of held) if (n > 1) violations.push({ kind: 'double_refund', operationId: opId, detail: `${n} refunds that have not failed` });
  for (const op of byId.values()) {
    if (op.kind !== 'refund' || op.status !== 'succeeded') continue;
    const refund = refunds.find((r) => r.id === op.external_id);
    if (refund?.status !== 'succeeded' || refund.metadata.operation_id !== op.id) {
      violations.push({ kind: 'succeeded_without_refund', operationId: op.id, detail: `external_id ${op.external_id} is ${refund?.status ?? 'not in the ledger'}` });
    }
  }
  for (const { paymentIntent: pi } of emulator.ledger()) {
    const n = refunded.get(pi.id) ?? 0;
    if (n > pi.amount_received) violations.push({ kind: 'over_refund', operationId: pi.metadata.operation_id ?? null, detail: `${n} refunded of ${pi.id}'s ${pi.amount_received}` });
  }
  return violations;
}

/** What the emulator saw for one operation, e.g. "create:truncated create:200↺". */
export function pathOf(emulator: StripeEmulator, operationId: string): string {
  return emulator
    .requests()
    .filter((r) => r.operationId === operationId)
    .map((r) => `${r.endpoint}:${r.status}${r.replayed ? '↺' : ''}`)
    .join(' ');
}
