// Authorizations (issue 24): a charge requested with captureMethod manual succeeds when Stripe holds the
// funds; a capture takes them and a cancel releases them, each an operation of its own under its own key,
// refused before anything is written when nothing is held; a lost answer is resent under the same key and
// never moves money twice; a capture after expiry fails without a person; refunds take back only what was
// captured; Connect's Stripe-Account travels with every request of the charge. Through the real stripe
// SDK over HTTP against the emulator.
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { inTransaction } from '../../src/db/pool.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { requestCancel, requestCapture } from '../../src/kinds/hold/request.ts';
import { requestRefund } from '../../src/kinds/refund/request.ts';
import { requestEffect } from '../../src/kinds/application/request.ts';
import { cancelIdempotencyKeyFor, captureIdempotencyKeyFor } from '../../src/stripe/gateway.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { SETTLED_EVENT } from '../../src/outbox/settlements.ts';
import { driftReport } from '../../src/reconcile/drift.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { resolveOperation } from '../../src/admin/resolve.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { operationRecord } from '../../src/console/queries.ts';
import { timeline } from '../../src/console/timeline.ts';
import { operationPage } from '../../src/console/views/operation.ts';
import type Stripe from 'stripe';
import type pg from 'pg';
import { waitUntil } from '../../harness/replica.ts';
import { Outboxd } from '../../src/outboxd.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { claim, confirm, operation } from '../support/fixtures.ts';

let t: TestDb;
let e: RunningEmulator;
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.clearFaults());

const kinds = () => kindsFor(e.gateway({ timeoutMs: 5_000 }));
const run = async (op: string) => executeOperation(t.pool, kinds(), op, await claim(t, op));
const capture = (input: Record<string, unknown>) => inTransaction(t.pool, (tx) => requestCapture(tx, input));
const cancel = (input: Record<string, unknown>) => inTransaction(t.pool, (tx) => requestCancel(tx, input));
const refund = (input: Record<string, unknown>) => inTransaction(t.pool, (tx) => requestRefund(tx, input));
const intentOf = (pi: string) => e.emulator.ledger().find((l) => l.paymentIntent.id === pi)!;
const sent = (endpoint: string, key: string) => e.emulator.requests().filter((r) => r.endpoint === endpoint && r.idempotencyKey === key);
const counts = async () =>
  (await t.pool.query(`select (select count(*)::int from outboxd.payment_operations) as ops, (select count(*)::int from outboxd.charge_outbox) as outbox`)).rows[0];

/** A charge operation that Stripe holds the funds of: its id and its PaymentIntent. */
async function held(overrides: Record<string, unknown> = {}): Promise<{ charge: string; pi: string }> {
  const charge = await confirm(t, { captureMethod: 'manual', ...overrides });
  const done = await run(charge);
  expect(done.operation.status).toBe('succeeded');
  return { charge, pi: done.operation.external_id! };
}

describe('an authorization', () => {
  it('is created with capture_method=manual and succeeds when Stripe holds the funds; its event says it is a hold', async () => {
    const { charge, pi } = await held();
    expect(intentOf(pi).paymentIntent).toMatchObject({ status: 'requires_capture', capture_method: 'manual', amount_capturable: 2599, amount_received: 0 });
    const op = await operation(t, charge);
    expect(op.payload).toEqual({ capture_method: 'manual' });
    expect(op.result).toMatchObject({ amount_capturable: 2599 });
    expect(new Date((op.result as { capture_before: string }).capture_before).getTime()).toBeGreaterThan(Date.now() + 6 * 86_400_000);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(events.find((r) => r.operation_id === charge)).toMatchObject({ kind: 'charge', status: 'succeeded', hold: { captureBefore: (op.result as { capture_before: string }).capture_before } });
    const automatic = await confirm(t);
    await run(automatic);
    const later = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(later.find((r) => r.operation_id === automatic)).toMatchObject({ hold: null });
  });

  it('the console shows what it holds, until when, and on which account; once expired, says so', async () => {
    const { charge } = await held({ stripeAccount: 'acct_1ConsoleShop' });
    const page = async (now: Date) => {
      const op = await operation(t, charge);
      const record = await operationRecord(t.pool, op);
      return String(operationPage(op, record, timeline(op, record), {}, { csrfToken: 'x', now, dashboard: 'https://dashboard.stripe.com/test' }));
    };
    const captureBefore = new Date(((await operation(t, charge)).result as { capture_before: string }).capture_before);
    const now = await page(new Date(captureBefore.getTime() - (3 * 86_400 + 3_600) * 1000));
    expect(now).toMatch(/<dt>Authorization<\/dt><dd>holds <span class="amount"[^>]*>25\.99 EUR<\/span> until [^<]+ \(3 d 1 h left to capture\)/);
    expect(now).toContain('href="https://dashboard.stripe.com/test/connect/accounts/acct_1ConsoleShop"');
    expect(await page(new Date(Date.now() + 8 * 86_400_000))).toMatch(/<strong>expired<\/strong>/);
  });

  it('an order asked again with another capture method is a conflict, not a second charge', async () => {
    const orderId = `ord_hold_${Math.random()}`;
    await confirm(t, { orderId, captureMethod: 'manual' });
    await expect(confirm(t, { orderId })).rejects.toMatchObject({ name: 'OrderConflictError', field: 'captureMethod' });
  });
});

describe('requesting a capture or a cancel: refused before anything is written', () => {
  it('refuses an automatic charge, one that holds nothing yet, more than it holds, and one that is no charge', async () => {
    const automatic = await confirm(t);
    await run(automatic);
    const pending = await confirm(t, { captureMethod: 'manual' });
    const { charge } = await held();
    const before = await counts();
    await expect(capture({ chargeOperationId: automatic, key: 'c' })).rejects.toMatchObject({ name: 'AuthorizationRefused', code: 'not_an_authorization' });
    await expect(cancel({ chargeOperationId: automatic, key: 'c' })).rejects.toMatchObject({ code: 'not_an_authorization' });
    await expect(capture({ chargeOperationId: pending, key: 'c' })).rejects.toMatchObject({ code: 'no_funds_held' });
    await expect(capture({ chargeOperationId: charge, key: 'c', amount: 2600 })).rejects.toMatchObject({ code: 'exceeds_capturable' });
    const { operationId: refundOp } = await refund({ chargeOperationId: automatic, amount: 1, key: 'r' });
    const afterRefund = await counts();
    await expect(capture({ chargeOperationId: refundOp, key: 'c' })).rejects.toMatchObject({ code: 'not_a_charge' });
    await expect(capture({ chargeOperationId: '00000000-0000-4000-8000-000000000000', key: 'c' })).rejects.toMatchObject({ name: 'OperationNotFoundError' });
    await expect(capture({ chargeOperationId: charge, key: '' })).rejects.toMatchObject({ name: 'ValidationError', field: 'key' });
    expect(afterRefund.ops).toBe(before.ops + 1);
    expect(await counts()).toEqual(afterRefund);
  });

  it("a refusal of an unsettled charge holds no lock on it in the caller's transaction: its worker's writes never wait on it", async () => {
    const pending = await confirm(t, { captureMethod: 'manual' });
    await inTransaction(t.pool, async (caller) => {
      await expect(requestCapture(caller, { chargeOperationId: pending, key: 'c' })).rejects.toMatchObject({ code: 'no_funds_held' });
      await expect(requestCancel(caller, { chargeOperationId: pending, key: 'c' })).rejects.toMatchObject({ code: 'no_funds_held' });
      // While the caller's transaction goes on, the charge's row is free (nowait: 55P03 were it locked).
      const free = await t.pool.query(`select id from outboxd.payment_operations where id = $1 for update nowait`, [pending]);
      expect(free.rows).toHaveLength(1);
      expect((await run(pending)).operation.status).toBe('succeeded');
    });
  });

  it('the same key is the same capture; another key, another amount, or a cancel after it is refused; so is a capture after a cancel', async () => {
    const { charge } = await held();
    const first = await capture({ chargeOperationId: charge, key: 'ship-1', amount: 2000 });
    expect(first.created).toBe(true);
    expect(await operation(t, first.operationId)).toMatchObject({ kind: 'capture', amount: 2000, currency: 'eur', parent_operation_id: charge, effect_key: `${charge}/ship-1`, status: 'pending' });
    expect(await capture({ chargeOperationId: charge, key: 'ship-1', amount: 2000 })).toEqual({ operationId: first.operationId, created: false });
    const before = await counts();
    await expect(capture({ chargeOperationId: charge, key: 'ship-1', amount: 1999 })).rejects.toMatchObject({ code: 'key_conflict' });
    await expect(capture({ chargeOperationId: charge, key: 'ship-2' })).rejects.toMatchObject({ code: 'already_captured' });
    await expect(cancel({ chargeOperationId: charge, key: 'oops' })).rejects.toMatchObject({ code: 'already_captured' });
    expect(await counts()).toEqual(before);

    const other = await held();
    const { operationId: cancelOp } = await cancel({ chargeOperationId: other.charge, key: 'c-1', reason: 'requested_by_customer' });
    await expect(capture({ chargeOperationId: other.charge, key: 'late' })).rejects.toMatchObject({ code: 'canceled' });
    // A key is a charge's own: the same key of another charge is another capture.
    const third = await held();
    expect((await capture({ chargeOperationId: third.charge, key: 'ship-1' })).created).toBe(true);
    expect((await operation(t, cancelOp)).payload).toMatchObject({ key: 'c-1', reason: 'requested_by_customer' });
    // The application reads its own key back, as its settlement event says it.
    const o = new Outboxd({ connectionString: t.url, schema: t.schema });
    try {
      expect(await o.getOperation(first.operationId)).toMatchObject({ kind: 'capture', key: 'ship-1' });
      expect(await o.getOperation(cancelOp)).toMatchObject({ kind: 'cancel', key: 'c-1' });
    } finally {
      await o.stop();
    }
  });

  it('a capture and a cancel racing: the later waits for the earlier’s transaction, then is refused; one change is made', async () => {
    const { charge } = await held();
    const a = await t.pool.connect();
    const b = await t.pool.connect();
    const tx = (c: pg.PoolClient) => ({ query: c.query.bind(c), sql: t.pool.sql }) as Parameters<typeof requestCapture>[0];
    try {
      await a.query('begin');
      await b.query('begin');
      const bPid = (await b.query('select pg_backend_pid() as pid')).rows[0].pid;
      expect(await requestCapture(tx(a), { chargeOperationId: charge, key: 'ship' })).toMatchObject({ created: true });
      const racing = requestCancel(tx(b), { chargeOperationId: charge, key: 'abandon' }).catch((x: unknown) => x);
      await waitUntil(async () => (await t.pool.query(`select wait_event_type from pg_stat_activity where pid = $1`, [bPid])).rows[0]?.wait_event_type === 'Lock', 10_000, 'the cancel to wait for the capture');
      await a.query('commit');
      expect(await racing).toMatchObject({ name: 'AuthorizationRefused', code: 'already_captured' });
      await b.query('rollback');
    } finally {
      a.release();
      b.release();
    }
    const { rows } = await t.pool.query(`select kind from outboxd.payment_operations where parent_operation_id = $1`, [charge]);
    expect(rows).toEqual([{ kind: 'capture' }]);
  });

  it('refuses an authorization past its capture_before without asking Stripe', async () => {
    const { charge } = await held();
    await t.pool.query(`update outboxd.payment_operations set result = jsonb_set(result, '{capture_before}', to_jsonb((now() - interval '1 minute')::text)) where id = $1`, [charge]);
    const before = await counts();
    await expect(capture({ chargeOperationId: charge, key: 'k' })).rejects.toMatchObject({ code: 'expired' });
    await expect(cancel({ chargeOperationId: charge, key: 'k' })).rejects.toMatchObject({ code: 'expired' });
    expect(await counts()).toEqual(before);
  });
});

describe('carrying out a capture or a cancel', () => {
  it('captures part of a hold under capture-op:<id>; the rest is released; a refund takes back only what was captured', async () => {
    const { charge, pi } = await held();
    await expect(refund({ chargeOperationId: charge, amount: 100, key: 'r-early' })).rejects.toMatchObject({ name: 'RefundRefused', code: 'charge_not_captured' });
    const { operationId } = await capture({ chargeOperationId: charge, key: 'ship', amount: 1500 });
    const done = await run(operationId);
    expect(done.operation).toMatchObject({ status: 'succeeded', external_id: pi });
    expect(intentOf(pi).paymentIntent).toMatchObject({ status: 'succeeded', amount_received: 1500, amount_capturable: 0 });
    expect(sent('capture', captureIdempotencyKeyFor(operationId))).toHaveLength(1);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(events.find((r) => r.operation_id === operationId)).toMatchObject({ kind: 'capture', effect_key: 'ship', amount: 1500, hold: null });
    await expect(refund({ chargeOperationId: charge, amount: 1501, key: 'r-1' })).rejects.toMatchObject({ code: 'exceeds_remaining' });
    const r = await refund({ chargeOperationId: charge, amount: 1500, key: 'r-1' });
    expect((await run(r.operationId)).operation.status).toBe('succeeded');
  });

  it('a capture whose answer is lost is resent under the same key: captured once', async () => {
    const { charge, pi } = await held();
    const { operationId } = await capture({ chargeOperationId: charge, key: 'lost' });
    e.emulator.addFault({ endpoint: 'capture', match: { operationId: charge }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    const first = await run(operationId);
    expect(first.operation.status).toBe('unknown');
    expect(first.operation.external_id).toBeNull(); // the next attempt sends the capture again, not a read
    expect(intentOf(pi).paymentIntent.status).toBe('succeeded'); // it did happen
    const second = await run(operationId);
    expect(second.operation.status).toBe('succeeded');
    // Every capture of this PaymentIntent carried the operation's one key.
    const captures = e.emulator.requests().filter((r) => r.endpoint === 'capture' && r.path.includes(pi));
    expect(captures.length).toBeGreaterThanOrEqual(2);
    expect(captures.map((r) => r.idempotencyKey)).toEqual(captures.map(() => captureIdempotencyKeyFor(operationId)));
    expect(intentOf(pi).paymentIntent.amount_received).toBe(2599);
  });

  it('a resend’s replayed answer is how the key was first answered: a hold released since, or a payment settled since, is read again before it settles', async () => {
    const charge = await confirm(t, { captureMethod: 'manual' });
    const slow = await confirm(t, { paymentMethod: 'pm_card_processing' });
    for (const op of [charge, slow]) {
      e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
      expect((await run(op)).operation.status).toBe('unknown');
    }
    const piOf = (op: string) => e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === op)!.paymentIntent.id;
    await e.client().paymentIntents.cancel(piOf(charge), { cancellation_reason: 'fraudulent' }); // Radar, or the dashboard
    e.emulator.settle(piOf(slow), 'requires_payment_method'); // the bank said no
    for (const op of [charge, slow]) {
      const done = await run(op);
      expect(done.call).toBe('create');
      expect(e.emulator.requests().filter((r) => r.operationId === op && r.endpoint === 'create').at(-1)!.replayed).toBe(true);
      expect(done.operation).toMatchObject({ status: 'failed', external_id: piOf(op), last_error: expect.stringMatching(/payment intent (canceled|requires_payment_method)/) });
    }
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(events.find((r) => r.operation_id === charge)).toMatchObject({ status: 'failed', hold: null });
  });

  it("a 500 whose error names the charge's PaymentIntent → unknown with no external id: the capture is sent again under its key", async () => {
    const { charge, pi } = await held();
    const { operationId } = await capture({ chargeOperationId: charge, key: 'named' });
    e.emulator.addFault({ endpoint: 'capture', match: { operationId: charge }, fault: { kind: 'error_before_commit', status: 500, paymentIntent: pi }, count: 1 });
    expect((await run(operationId)).operation).toMatchObject({ status: 'unknown', external_id: null });
    const again = await run(operationId);
    expect(again).toMatchObject({ call: 'create', operation: { status: 'succeeded', external_id: pi } });
    expect(intentOf(pi).paymentIntent.amount_received).toBe(2599);
  });

  it('past the key window, a read decides: still held → sent again (pending), captured → succeeded; never a second capture', async () => {
    const { charge, pi } = await held();
    const { operationId } = await capture({ chargeOperationId: charge, key: 'window' });
    e.emulator.addFault({ endpoint: 'capture', match: { operationId: charge }, fault: { kind: 'error_before_commit', status: 500 } });
    expect((await run(operationId)).operation.status).toBe('unknown');
    await t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - interval '24 hours', last_attempted_at = now() - interval '24 hours' where id = $1`, [operationId]);
    const read = await run(operationId);
    expect(read.call).toBe('search');
    expect(read.operation).toMatchObject({ status: 'pending', first_attempted_at: null });
    const again = await run(operationId);
    expect(again.call).toBe('create');
    expect(again.operation.status).toBe('succeeded');
    expect(intentOf(pi).paymentIntent.amount_received).toBe(2599);
  });

  it('a read that finds the hold still held leaves --failed refused for an hour after the capture was last sent: Stripe may still be running it', async () => {
    const { charge } = await held();
    const { operationId } = await capture({ chargeOperationId: charge, key: 'horizon' });
    e.emulator.addFault({ endpoint: 'capture', match: { operationId: charge }, fault: { kind: 'error_before_commit', status: 500 } });
    expect((await run(operationId)).operation.status).toBe('unknown');
    // Held for a person (its job dead-lettered), nothing drives it.
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'retries exhausted (dead-lettered)' where id = $1`, [operationId]);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [operationId]);
    const resolve = () =>
      resolveOperation(t.pool, e.gateway(), operationId, { outcome: 'failed', reason: 'not in the dashboard' }, 'alice', { leaseTtlMs: 10_000, searchFreshnessSeconds: 3_600 });
    await expect(resolve()).rejects.toThrow(/try again in/);
    const report = await reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect(report.decisions.find((d) => d.operationId === operationId)).toMatchObject({ to: 'pending' });
    expect(await operation(t, operationId)).toMatchObject({ status: 'pending', first_attempted_at: null });
    await expect(resolve()).rejects.toThrow(/try again in/);
  });

  it('a capture after the authorization expired fails, definitively and without a person', async () => {
    const { charge, pi } = await held();
    const { operationId } = await capture({ chargeOperationId: charge, key: 'too-late' });
    e.emulator.expire(pi);
    const done = await run(operationId);
    expect(done.operation).toMatchObject({ status: 'failed', review_reason: null, external_id: pi });
    expect(done.operation.last_error).toMatch(/expired/);
  });

  it('a cancel releases the hold under cancel-op:<id>; a cancel that finds the charge captured fails (refund it instead)', async () => {
    const { charge, pi } = await held();
    const { operationId } = await cancel({ chargeOperationId: charge, key: 'c', reason: 'abandoned' });
    expect((await run(operationId)).operation.status).toBe('succeeded');
    expect(intentOf(pi).paymentIntent).toMatchObject({ status: 'canceled', cancellation_reason: 'abandoned', amount_capturable: 0 });
    expect(sent('cancel', cancelIdempotencyKeyFor(operationId))).toHaveLength(1);

    // Captured outside outboxd (the dashboard) while the cancel waited to be sent.
    const other = await held();
    const racing = await cancel({ chargeOperationId: other.charge, key: 'c' });
    await e.client().paymentIntents.capture(other.pi);
    const lost = await run(racing.operationId);
    expect(lost.operation.status).toBe('failed');
    expect(lost.operation.last_error).toMatch(/captured.*refund it instead/);
  });
});

describe('an authorization released in Stripe', () => {
  const canceledEvent = (pi: string) => ({ id: `evt_${Math.random().toString(36).slice(2)}`, type: 'payment_intent.canceled', data: { object: { id: pi } } }) as unknown as Stripe.Event;
  const inbox = () => ({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') });

  it('an expiry is recorded as a cancel of the charge, settled, with its settlement event: once, however often Stripe tells', async () => {
    const { charge, pi } = await held();
    e.emulator.expire(pi);
    expect(await receiveStripeEvent(inbox(), canceledEvent(pi))).toBe('recorded');
    expect(await receiveStripeEvent(inbox(), canceledEvent(pi))).toBe('already_settled');
    const { rows } = await t.pool.query(`select id from outboxd.payment_operations where parent_operation_id = $1`, [charge]);
    expect(rows).toHaveLength(1);
    const released = await operation(t, rows[0].id);
    expect(released).toMatchObject({ kind: 'cancel', status: 'succeeded', external_id: pi, effect_key: `${charge}/outboxd:expired`, amount: 2599, payload: { key: 'outboxd:expired', reason: 'the authorization expired' } });
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(events.find((r) => r.operation_id === released.id)).toMatchObject({ kind: 'cancel', status: 'succeeded', effect_key: 'outboxd:expired', source: 'webhook' });
    await expect(capture({ chargeOperationId: charge, key: 'after' })).rejects.toMatchObject({ code: 'canceled' });
    expect(await operation(t, charge)).toMatchObject({ status: 'succeeded' }); // settled is final
  });

  it('without a webhook, the reconcile sweep finds a hold past its capture_before that Stripe released, and records it once', async () => {
    const pastExpiry = (charge: string) =>
      t.pool.query(`update outboxd.payment_operations set result = jsonb_set(result, '{capture_before}', to_jsonb(to_char((now() - interval '1 minute') at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))) where id = $1`, [charge]);
    const released = await held();
    const lateInStripe = await held(); // past its time, and Stripe has not released it yet
    const captured = await held();
    expect((await run((await capture({ chargeOperationId: captured.charge, key: 'c' })).operationId)).operation.status).toBe('succeeded');
    for (const h of [released, lateInStripe, captured]) await pastExpiry(h.charge);
    e.emulator.expire(released.pi);
    const sweep = () => reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    // Of these three (the earlier cases' authorizations are followed up too).
    const ours = [released, lateInStripe, captured].map((h) => h.charge);
    const followedUp = async () => (await sweep()).followedUp.filter((id) => ours.includes(id));
    expect(await followedUp()).toEqual([released.charge]);
    expect(await followedUp()).toEqual([]);
    const { rows } = await t.pool.query(`select kind, status, effect_key from outboxd.payment_operations where parent_operation_id = any($1::uuid[]) order by kind`, [[released.charge, lateInStripe.charge]]);
    expect(rows).toEqual([{ kind: 'cancel', status: 'succeeded', effect_key: `${released.charge}/outboxd:expired` }]);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(events.filter((r) => r.kind === 'cancel' && r.effect_key === 'outboxd:expired').map((r) => r.source)).toContain('reconcile');
  });

  it('a wallet’s hold, which Stripe gives no capture_before, is followed up once the shortest card window since it settled has passed: its release is recorded without a webhook', async () => {
    const wallet = await held({ paymentMethod: 'pm_paypal' });
    expect((await operation(t, wallet.charge)).result).toMatchObject({ status: 'requires_capture', capture_before: null });
    e.emulator.expire(wallet.pi); // released in Stripe; its webhook never arrives
    const sweep = () => reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect((await sweep()).followedUp).not.toContain(wallet.charge); // settled just now: not looked at yet
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '5 days' where id = $1`, [wallet.charge]);
    expect((await sweep()).followedUp).toContain(wallet.charge);
    const { rows } = await t.pool.query(`select kind, status, effect_key from outboxd.payment_operations where parent_operation_id = $1`, [wallet.charge]);
    expect(rows).toEqual([{ kind: 'cancel', status: 'succeeded', effect_key: `${wallet.charge}/outboxd:expired` }]);
    expect((await sweep()).followedUp).not.toContain(wallet.charge);
  });

  it('more wallet holds than a sweep reads: each sweep draws anew which it reads, so none released is left out for good', async () => {
    const wallets = [await held({ paymentMethod: 'pm_paypal' }), await held({ paymentMethod: 'pm_paypal' }), await held({ paymentMethod: 'pm_paypal' })];
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '5 days' where id = any($1::uuid[])`, [wallets.map((w) => w.charge)]);
    // A sweep reading 2 (of these and the earlier cases' holds still followed up): the one the first would
    // leave out is released. In a fixed order, every sweep would leave it out.
    const first = (await t.pool.query(t.pool.sql.authorizationsToFollowUp(new Date().toISOString(), new Date(Date.now() - 30 * 86_400_000).toISOString(), 2, 4 * 86_400))).rows.map((r: { id: string }) => r.id);
    const released = wallets.find((w) => !first.includes(w.charge))!;
    e.emulator.expire(released.pi);
    const sweep = () => reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent'), limit: 2 });
    let recorded = false;
    for (let i = 0; i < 30 && !recorded; i++) recorded = (await sweep()).followedUp.includes(released.charge);
    expect(recorded).toBe(true);
  });

  it('captured in the dashboard: its webhook records a capture of what Stripe took, which can be refunded; no second capture or cancel is taken', async () => {
    const { charge, pi } = await held();
    await e.client().paymentIntents.capture(pi, { amount_to_capture: 1000 });
    // As Stripe signs it: the PaymentIntent, succeeded, naming the operation that settled as a hold.
    const succeeded = (id: string) =>
      ({ id, type: 'payment_intent.succeeded', data: { object: { id: pi, status: 'succeeded', metadata: { operation_id: charge } } } }) as unknown as Stripe.Event;
    expect(await receiveStripeEvent(inbox(), succeeded(`evt_${charge}_1`))).toBe('recorded');
    const changes = async () =>
      (await t.pool.query(`select kind, status, amount::int, effect_key, result from outboxd.payment_operations where parent_operation_id = $1 order by created_at`, [charge])).rows;
    expect(await changes()).toEqual([
      { kind: 'capture', status: 'succeeded', amount: 1000, effect_key: `${charge}/outboxd:captured-in-stripe`, result: { status: 'succeeded', amount_received: 1000 } },
    ]);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    const [recorded] = (await t.pool.query(`select id from outboxd.payment_operations where parent_operation_id = $1`, [charge])).rows;
    expect(events.find((r) => r.operation_id === recorded.id)).toMatchObject({ kind: 'capture', effect_key: 'outboxd:captured-in-stripe', status: 'succeeded', source: 'webhook' });
    // The event again: nothing more.
    expect(await receiveStripeEvent(inbox(), succeeded(`evt_${charge}_2`))).toBe('already_settled');
    expect(await changes()).toHaveLength(1);
    await expect(capture({ chargeOperationId: charge, key: 'ship' })).rejects.toMatchObject({ code: 'already_captured' });
    await expect(cancel({ chargeOperationId: charge, key: 'oops' })).rejects.toMatchObject({ code: 'already_captured' });
    await expect(refund({ chargeOperationId: charge, amount: 1001, key: 'r-too-much' })).rejects.toMatchObject({ code: 'exceeds_remaining' });
    const { operationId } = await refund({ chargeOperationId: charge, amount: 1000, key: 'r' });
    expect((await run(operationId)).operation.status).toBe('succeeded');
  });

  it('captured in the dashboard while a cancel was live: the webhook records nothing, the cancel fails, and the sweep then records the capture, which can be refunded', async () => {
    const { charge, pi } = await held();
    const { operationId: cancelOp } = await cancel({ chargeOperationId: charge, key: 'oops' });
    await e.client().paymentIntents.capture(pi, { amount_to_capture: 1000 });
    const event = { id: `evt_${charge}`, type: 'payment_intent.succeeded', data: { object: { id: pi, status: 'succeeded', metadata: { operation_id: charge } } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent(inbox(), event)).toBe('already_settled'); // the live cancel stands in the way
    expect((await run(cancelOp)).operation).toMatchObject({ status: 'failed', last_error: expect.stringMatching(/was captured \(1000 eur\)/) });
    const sweep = () => reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect((await sweep()).followedUp).toContain(charge);
    expect((await sweep()).followedUp).not.toContain(charge);
    const { rows } = await t.pool.query(`select kind, status, amount::int, effect_key from outboxd.payment_operations where parent_operation_id = $1 order by created_at`, [charge]);
    expect(rows).toEqual([
      { kind: 'cancel', status: 'failed', amount: 2599, effect_key: `${charge}/oops` },
      { kind: 'capture', status: 'succeeded', amount: 1000, effect_key: `${charge}/outboxd:captured-in-stripe` },
    ]);
    expect((await run((await refund({ chargeOperationId: charge, amount: 1000, key: 'r' })).operationId)).operation.status).toBe('succeeded');
  });

  it("a declined authorization's webhook confirms its failure without a retrieve, as an automatic charge's; so does the webhook of outboxd's own capture", async () => {
    const retrieves = () => e.emulator.requests().filter((r) => r.endpoint === 'retrieve').length;
    const { charge: heldCharge, pi } = await held();
    expect((await run((await capture({ chargeOperationId: heldCharge, key: 'own' })).operationId)).operation.status).toBe('succeeded');
    const captured = retrieves();
    const own = { id: `evt_${heldCharge}`, type: 'payment_intent.succeeded', data: { object: { id: pi, status: 'succeeded', metadata: { operation_id: heldCharge } } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent(inbox(), own)).toBe('already_settled');
    expect(retrieves(), 'own capture').toBe(captured);
    for (const captureMethod of ['manual', 'automatic'] as const) {
      const charge = await confirm(t, { captureMethod, paymentMethod: 'pm_card_chargeDeclined' });
      const { operation: declined } = await run(charge);
      expect(declined).toMatchObject({ status: 'failed', external_id: expect.stringMatching(/^pi_/) });
      const before = retrieves();
      const event = {
        id: `evt_${charge}`,
        type: 'payment_intent.payment_failed',
        data: { object: { id: declined.external_id, status: 'requires_payment_method', metadata: { operation_id: charge } } },
      } as unknown as Stripe.Event;
      expect(await receiveStripeEvent(inbox(), event)).toBe('already_settled');
      expect(retrieves(), captureMethod).toBe(before);
    }
  });

  it('a hold settled from its webhook keeps what it holds and until when, as one the worker settled', async () => {
    const charge = await confirm(t, { captureMethod: 'manual' });
    e.emulator.addFault({ match: { operationId: charge }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    expect((await run(charge)).operation.status).toBe('unknown');
    const pi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === charge)!.paymentIntent.id;
    const event = { id: `evt_${Math.random().toString(36).slice(2)}`, type: 'payment_intent.amount_capturable_updated', data: { object: { id: pi } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent(inbox(), event)).toBe('settled');
    const op = await operation(t, charge);
    expect(op).toMatchObject({ status: 'succeeded', external_id: pi, result: { amount_capturable: 2599, capture_before: expect.any(String) } });
  });

  it('a cancel of outboxd’s own settles by itself: the event records nothing beside it', async () => {
    const { charge, pi } = await held();
    const { operationId } = await cancel({ chargeOperationId: charge, key: 'mine' });
    expect((await run(operationId)).operation.status).toBe('succeeded');
    expect(await receiveStripeEvent(inbox(), canceledEvent(pi))).toBe('already_settled');
    const { rows } = await t.pool.query(`select id from outboxd.payment_operations where parent_operation_id = $1`, [charge]);
    expect(rows.map((r) => r.id)).toEqual([operationId]);
  });
});

describe('Connect', () => {
  const account = 'acct_1ConnectedShop';

  it('every request of a connected account’s charge carries Stripe-Account: the charge, its capture and its refund', async () => {
    const { charge, pi } = await held({ stripeAccount: account, applicationFeeAmount: 100 });
    expect(intentOf(pi).account).toBe(account);
    const { operationId } = await capture({ chargeOperationId: charge, key: 'ship' });
    expect((await operation(t, operationId)).payload).toMatchObject({ stripe_account: account });
    expect((await run(operationId)).operation.status).toBe('succeeded');
    const r = await refund({ chargeOperationId: charge, amount: 500, key: 'r' });
    expect((await run(r.operationId)).operation.status).toBe('succeeded');
    const ours = new Set([charge, operationId, r.operationId]);
    const mine = e.emulator.requests().filter((q) => (q.operationId !== null && ours.has(q.operationId)) || q.path.includes(pi));
    expect(new Set(mine.map((q) => q.endpoint))).toEqual(new Set(['create', 'capture', 'create_refund']));
    for (const q of mine) expect(q.account, `${q.method} ${q.path}`).toBe(account);
  });

  it('a destination charge is made on the platform with transfer_data; its refund can reverse the transfer, and its key asked again without doing so is refused', async () => {
    const charge = await confirm(t, { transferData: { destination: account }, applicationFeeAmount: 200 });
    const done = await run(charge);
    expect(done.operation.status).toBe('succeeded');
    const entry = intentOf(done.operation.external_id!);
    expect(entry.account).toBeNull();
    expect(entry.paymentIntent).toMatchObject({ transfer_data: { destination: account }, application_fee_amount: 200 });
    const asked = { chargeOperationId: charge, amount: 2599, key: 'all', reverseTransfer: true, refundApplicationFee: true } as const;
    const r = await refund(asked);
    expect((await operation(t, r.operationId)).payload).toMatchObject({ reverse_transfer: true, refund_application_fee: true });
    // The key asked again is the same refund only if it takes back the same: not another one quietly.
    expect(await refund(asked)).toEqual({ operationId: r.operationId, created: false });
    for (const other of [{ reverseTransfer: false }, { refundApplicationFee: false }, { reverseTransfer: undefined, refundApplicationFee: undefined }]) {
      await expect(refund({ ...asked, ...other })).rejects.toMatchObject({ code: 'key_conflict', message: expect.stringMatching(/reverses the transfer and refunds the application fee/) });
    }
    expect((await run(r.operationId)).operation.status).toBe('succeeded');
  });

  it('reconciled on its account: past the key window, Search and retrieve carry Stripe-Account; its own webhook settles it', async () => {
    const viaSearch = await confirm(t, { stripeAccount: account });
    e.emulator.addFault({ match: { operationId: viaSearch }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    expect((await run(viaSearch)).operation.status).toBe('unknown');
    await t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - interval '24 hours' where id = $1`, [viaSearch]);
    e.emulator.configureSearch({ lagMs: 0 });
    const before = e.emulator.requests().length;
    const searched = await run(viaSearch);
    expect(searched.call).toBe('search');
    expect(searched.operation.status).toBe('succeeded');
    const reads = e.emulator.requests().slice(before);
    expect(new Set(reads.map((q) => q.endpoint))).toEqual(new Set(['search', 'retrieve']));
    for (const q of reads) expect(q.account).toBe(account);

    const viaWebhook = await confirm(t, { stripeAccount: account });
    e.emulator.addFault({ match: { operationId: viaWebhook }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    expect((await run(viaWebhook)).operation.status).toBe('unknown');
    const pi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === viaWebhook)!.paymentIntent.id;
    const event = { id: `evt_${Math.random().toString(36).slice(2)}`, type: 'payment_intent.succeeded', account, data: { object: { id: pi } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') }, event)).toBe('settled');
    expect(await operation(t, viaWebhook)).toMatchObject({ status: 'succeeded', external_id: pi });
  });

  it('an account that disconnected the platform: a first charge or refund on it fails; one whose earlier send may have charged goes to a person, not round a loop of refusals', async () => {
    const gone = 'acct_1DisconnectedShop';
    const paid = await confirm(t, { stripeAccount: gone });
    expect((await run(paid)).operation.status).toBe('succeeded');
    const r = await refund({ chargeOperationId: paid, amount: 100, key: 'r' });
    const first = await confirm(t, { stripeAccount: gone });
    const unsure = await confirm(t, { stripeAccount: gone });
    e.emulator.addFault({ match: { operationId: unsure }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    expect((await run(unsure)).operation.status).toBe('unknown');
    e.emulator.revokeAccess(gone);
    try {
      // Nothing ran: failed, with the refusal as its reason, and settled (no job is retried).
      for (const id of [first, r.operationId]) {
        const done = (await run(id)).operation;
        expect(done).toMatchObject({ status: 'failed', needs_review: false, last_error: expect.stringMatching(/AccessRevoked 403: account_invalid/) });
      }
      // Its earlier send charged; the retry under its key is refused before Stripe's idempotency layer,
      // so it says nothing of that send: held for a person, the job dead-lettered, nothing failed.
      const held = await run(unsure);
      expect(held.outcome).toMatchObject({ kind: 'needs_review', retry: false });
      expect(held.operation).toMatchObject({ status: 'unknown', needs_review: true, review_reason: expect.stringMatching(/create refused by the connected account: .*account_invalid/) });
      // A person cannot settle it from what the platform cannot read, and is told what will help.
      await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [unsure]);
      const pi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === unsure)!.paymentIntent.id;
      for (const resolution of [{ outcome: 'succeeded', externalId: pi }, { outcome: 'failed', reason: 'the shop says no charge' }] as const) {
        await expect(resolveOperation(t.pool, e.gateway(), unsure, resolution, 'alice', { leaseTtlMs: 10_000, searchFreshnessSeconds: 0 })).rejects.toThrow(
          /no longer lets the platform read it .*once it connects the platform again, requeue the operation/,
        );
      }
    } finally {
      e.emulator.revokeAccess(gone, false);
    }
    // Connected again (the person's requeue): the same key replays the charge it made, once.
    expect((await run(unsure)).operation).toMatchObject({ status: 'succeeded', external_id: e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === unsure)!.paymentIntent.id });
    expect(e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === unsure)).toHaveLength(1);
  });

  it('an event from another account naming our operation settles nothing: the account decides, not the metadata', async () => {
    const charge = await confirm(t, { stripeAccount: account });
    // Another connected account writes its own PaymentIntent's metadata: here, our operation's id.
    const forged = await e.client().paymentIntents.create(
      { amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, off_session: true, metadata: { operation_id: charge } },
      { stripeAccount: 'acct_1SomeoneElse' },
    );
    const event = { id: `evt_${Math.random().toString(36).slice(2)}`, type: 'payment_intent.succeeded', account: 'acct_1SomeoneElse', data: { object: { id: forged.id } } } as unknown as Stripe.Event;
    const result = await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') }, event);
    expect(result).toBe('mismatch');
    expect(await operation(t, charge)).toMatchObject({ status: 'pending', external_id: null });
  });

  it('a PaymentIntent the connected account made itself, naming our operation with its amount, settles nothing: it carries no platform fee', async () => {
    const charge = await confirm(t, { stripeAccount: account, applicationFeeAmount: 100 });
    const own = await e.client().paymentIntents.create(
      { amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, off_session: true, metadata: { operation_id: charge } },
      { stripeAccount: account },
    );
    const event = { id: `evt_${Math.random().toString(36).slice(2)}`, type: 'payment_intent.succeeded', account, data: { object: { id: own.id } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') }, event)).toBe('mismatch');
    expect(await operation(t, charge)).toMatchObject({ status: 'pending', external_id: null, needs_review: true });
    // Its own charge, with the fee, still settles it.
    const settled = (await run(charge)).operation;
    expect(settled).toMatchObject({ status: 'succeeded', external_id: expect.not.stringMatching(own.id) });
  });
});

describe('what Stripe shows outside outboxd', () => {
  const resolve = (op: string, resolution: Parameters<typeof resolveOperation>[3]) =>
    resolveOperation(t.pool, e.gateway(), op, resolution, 'alice', { leaseTtlMs: 10_000, searchFreshnessSeconds: 0 });
  const outOfOutbox = (op: string) => t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);

  it('an authorization first seen captured (the dashboard) holds nothing: capture and cancel are refused, the caller’s transaction goes on, what Stripe took can be refunded, its event is no hold and tells what Stripe took', async () => {
    const charge = await confirm(t, { captureMethod: 'manual' });
    e.emulator.addFault({ match: { operationId: charge }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    expect((await run(charge)).operation.status).toBe('unknown');
    const pi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === charge)!.paymentIntent.id;
    await e.client().paymentIntents.capture(pi, { amount_to_capture: 2000 });
    await t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - interval '24 hours' where id = $1`, [charge]);
    expect((await run(charge)).operation).toMatchObject({ status: 'succeeded', result: { status: 'succeeded', amount_capturable: 0, amount_received: 2000 } });
    // What Stripe took can be refunded, and no more.
    await expect(refund({ chargeOperationId: charge, amount: 2001, key: 'r-too-much' })).rejects.toMatchObject({ code: 'exceeds_remaining' });
    expect((await run((await refund({ chargeOperationId: charge, amount: 2000, key: 'r' })).operationId)).operation.status).toBe('succeeded');
    // Its settlement told what Stripe took: nothing records that capture again, past its capture_before either.
    await t.pool.query(
      `update outboxd.payment_operations set result = jsonb_set(result, '{capture_before}', to_jsonb(to_char((now() - interval '1 minute') at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))) where id = $1`,
      [charge],
    );
    const succeeded = { id: `evt_${charge}`, type: 'payment_intent.succeeded', data: { object: { id: pi, status: 'succeeded', metadata: { operation_id: charge } } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') }, succeeded)).toBe('already_settled');
    expect((await reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') })).followedUp).not.toContain(charge);
    const { rows: changes } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where parent_operation_id = $1 and kind in ('capture', 'cancel')`, [charge]);
    expect(changes[0].n).toBe(0);
    const after = await inTransaction(t.pool, async (tx) => {
      await expect(requestCapture(tx, { chargeOperationId: charge, key: 'k' })).rejects.toMatchObject({ code: 'already_captured' });
      await expect(requestCancel(tx, { chargeOperationId: charge, key: 'k' })).rejects.toMatchObject({ code: 'already_captured' });
      return (await tx.query('select 1 as ok')).rows[0].ok; // the caller's transaction is not aborted
    });
    expect(after).toBe(1);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    // It charged what Stripe took, not what the hold asked for.
    expect(events.find((r) => r.operation_id === charge)).toMatchObject({ status: 'succeeded', hold: null, amount: 2000 });
  });

  it('an application’s effect whose payload and result read like an authorization found captured has no amount in its event, holds up no event behind it, and is no authorization on the console', async () => {
    const effects = new Map([['lookalike', { policy: 'at-least-once' as const, execute: (ctx: { payload: unknown }) => ({ status: 'succeeded', amount_received: (ctx.payload as { n: number }).n }) }]]);
    const ops: string[] = [];
    for (const n of [12.5, 1234]) {
      const { operationId } = await inTransaction(t.pool, (tx) => requestEffect(tx, effects, 'lookalike', { key: `lookalike-${n}`, payload: { capture_method: 'manual', stripe_account: 'acct_1Warehouse', n } }));
      expect((await executeOperation(t.pool, kindsFor(e.gateway(), effects), operationId, await claim(t, operationId))).operation.status).toBe('succeeded');
      ops.push(operationId);
    }
    const charge = await confirm(t);
    await run(charge);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(ops.map((op) => events.find((r) => r.operation_id === op)?.amount)).toEqual([null, null]);
    expect(events.find((r) => r.operation_id === charge)).toMatchObject({ amount: 2599 });
    const effect = await operation(t, ops[0]!);
    const record = await operationRecord(t.pool, effect);
    const page = String(operationPage(effect, record, timeline(effect, record), {}, { csrfToken: 'x', now: new Date(), dashboard: 'https://dashboard.stripe.com/test' }));
    expect(page).not.toMatch(/<dt>Authorization<\/dt>|<dt>Connected account<\/dt>/);
  });

  it('outside one transaction (a client in autocommit), two captures racing: the one-live-change index refuses the second', async () => {
    for (let round = 0; round < 5; round++) {
      const { charge } = await held();
      const results = await Promise.all(['k1', 'k2'].map((key) => requestCapture(t.pool, { chargeOperationId: charge, key }).catch((x: unknown) => x)));
      expect(results.filter((r) => (r as { created?: boolean }).created === true)).toHaveLength(1);
      expect(results.filter((r) => (r as { code?: string }).code === 'already_captured')).toHaveLength(1);
      const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where parent_operation_id = $1`, [charge]);
      expect(rows[0].n).toBe(1);
    }
  });

  it('a capture whose PaymentIntent was captured for another amount (the dashboard) did not happen: a person fails it, and the sweep records what Stripe took, which can be refunded; a hold resolved as succeeded keeps what it holds', async () => {
    const { charge, pi } = await held();
    const { operationId } = await capture({ chargeOperationId: charge, key: 'all' });
    await e.client().paymentIntents.capture(pi, { amount_to_capture: 1000 });
    const done = await run(operationId);
    expect(done.operation).toMatchObject({ status: 'unknown', needs_review: true });
    await outOfOutbox(operationId);
    await expect(resolve(operationId, { outcome: 'succeeded', externalId: pi })).rejects.toMatchObject({ name: 'ResolutionRefused' });
    // Resolved weeks after it was requested: it waited in the review queue.
    await t.pool.query(`update outboxd.payment_operations set created_at = now() - interval '40 days' where id = $1`, [operationId]);
    expect(await resolve(operationId, { outcome: 'failed', reason: 'captured for 1000 in the dashboard' })).toMatchObject({ status: 'failed' });
    const { rows: audit } = await t.pool.query(`select details->'evidence' as evidence from outboxd.admin_audit where operation_id = $1 and action = 'resolve'`, [operationId]);
    expect(audit[0].evidence).toMatchObject({ paymentIntent: { id: pi, status: 'succeeded', amount_received: 1000 }, changedOtherwise: expect.stringMatching(/captured for 1000/) });
    const report = await reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect(report.followedUp).toContain(charge);
    expect((await run((await refund({ chargeOperationId: charge, amount: 1000, key: 'r' })).operationId)).operation.status).toBe('succeeded');

    const unknown = await confirm(t, { captureMethod: 'manual' });
    e.emulator.addFault({ match: { operationId: unknown }, fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 2 });
    expect((await run(unknown)).operation.status).toBe('unknown');
    const heldPi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === unknown)!.paymentIntent.id;
    await outOfOutbox(unknown);
    const resolved = await resolve(unknown, { outcome: 'succeeded', externalId: heldPi });
    expect(resolved).toMatchObject({ status: 'succeeded', result: { status: 'requires_capture', amount_capturable: 2599, capture_before: expect.any(String) } });
  });

  it('a refund whose own key looks like a change’s keeps it in its event', async () => {
    const automatic = await confirm(t);
    await run(automatic);
    const { operationId } = await refund({ chargeOperationId: automatic, amount: 10, key: `${automatic}/abc` });
    await run(operationId);
    const events = await inTransaction(t.pool, async (tx) => (await tx.query(tx.sql.takeSettlementBatch(1000, SETTLED_EVENT))).rows);
    expect(events.find((r) => r.operation_id === operationId)).toMatchObject({ kind: 'refund', effect_key: `${automatic}/abc` });
  });
});

describe('the drift report', () => {
  it('a hold, a capture, a cancel and a connected account’s charge add up; a hold released or captured in Stripe with nothing to record it is drift', async () => {
    const since = new Date(Date.now() - 60_000);
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '1 hour' where settled_at is not null`);
    const kept = await held();
    const captured = await held();
    expect((await run((await capture({ chargeOperationId: captured.charge, key: 'd' })).operationId)).operation.status).toBe('succeeded');
    const canceled = await held();
    expect((await run((await cancel({ chargeOperationId: canceled.charge, key: 'd' })).operationId)).operation.status).toBe('succeeded');
    const connected = await held({ stripeAccount: 'acct_1DriftShop' });
    const lost = await held();
    e.emulator.expire(lost.pi); // its webhook never arrived
    // Captured in the dashboard: one whose webhook recorded it, one whose webhook never arrived (refunds
    // of it are refused until the sweep looks at it past its capture_before, days later).
    const recorded = await held();
    await e.client().paymentIntents.capture(recorded.pi, { amount_to_capture: 1500 });
    const succeeded = { id: `evt_${recorded.charge}`, type: 'payment_intent.succeeded', data: { object: { id: recorded.pi } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') }, succeeded)).toBe('recorded');
    const unrecorded = await held();
    await e.client().paymentIntents.capture(unrecorded.pi, { amount_to_capture: 1500 });
    const report = await driftReport(t.pool, e.gateway(), since);
    const ours = new Set([kept, captured, canceled, connected, lost, recorded, unrecorded].map((h) => h.charge));
    expect(report.drift.filter((d) => d.operationId !== null && ours.has(d.operationId))).toEqual([
      expect.objectContaining({ kind: 'released_hold', operationId: lost.charge, chargeIds: [lost.pi] }),
      expect.objectContaining({ kind: 'captured_hold', operationId: unrecorded.charge, chargeIds: [unrecorded.pi] }),
    ]);
  });

  it('a second hold for one authorization (a resend whose key Stripe forgot) is a duplicate charge; a hold for an operation recorded failed is money taken', async () => {
    const since = new Date(Date.now() - 1_000);
    const hold = (op: string) =>
      e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, off_session: true, capture_method: 'manual', metadata: { operation_id: op } });
    const twice = await held();
    const second = await hold(twice.charge);
    const failed = await confirm(t, { captureMethod: 'manual' });
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = $1`, [failed]);
    const stray = await hold(failed);
    const report = await driftReport(t.pool, e.gateway(), since);
    const ours = report.drift.filter((d) => d.operationId === twice.charge || d.operationId === failed);
    expect(ours).toHaveLength(2);
    expect(ours).toContainEqual({ kind: 'duplicate_charge', operationId: twice.charge, chargeIds: expect.arrayContaining([twice.pi, second.id]), detail: '2 charges that took or hold money for one operation' });
    expect(ours).toContainEqual({ kind: 'charged_not_succeeded', operationId: failed, chargeIds: [stray.id], detail: 'operation is failed' });
  });

  it('a connected account that disconnected the platform: its charge, capture and refund are listed unreadable, and the rest of the report is made', async () => {
    const since = new Date(Date.now() - 1_000);
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '1 hour' where settled_at is not null`);
    const gone = 'acct_1DriftGone';
    const captured = await held({ stripeAccount: gone });
    const { operationId: captureId } = await capture({ chargeOperationId: captured.charge, key: 'd' });
    expect((await run(captureId)).operation.status).toBe('succeeded');
    const r = await refund({ chargeOperationId: captured.charge, amount: 100, key: 'd' });
    const refunded = (await run(r.operationId)).operation;
    const lost = await held();
    e.emulator.expire(lost.pi);
    e.emulator.revokeAccess(gone);
    try {
      const report = await driftReport(t.pool, e.gateway(), since);
      const ours = new Set([captured.charge, captureId, r.operationId, lost.charge]);
      expect(report.drift.filter((d) => d.operationId !== null && ours.has(d.operationId))).toEqual([
        { kind: 'unreadable_account', operationId: captured.charge, chargeIds: [captured.pi], detail: expect.stringMatching(/^not checked: account_invalid: .*acct_1DriftGone/) },
        { kind: 'released_hold', operationId: lost.charge, chargeIds: [lost.pi], detail: expect.any(String) },
        { kind: 'unreadable_account', operationId: r.operationId, chargeIds: [refunded.external_id], detail: expect.stringMatching(/account_invalid/) },
        { kind: 'unreadable_account', operationId: captureId, chargeIds: [captured.pi], detail: expect.stringMatching(/account_invalid/) },
      ]);
    } finally {
      e.emulator.revokeAccess(gone, false);
    }
  });

  it("a capture's PaymentIntent Stripe does not answer for (a 5xx) fails the report instead of calling the capture missing", async () => {
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '1 hour' where settled_at is not null`);
    const since = new Date(Date.now() - 1_000);
    const captured = await held();
    const { operationId } = await capture({ chargeOperationId: captured.charge, key: 'five-hundred' });
    expect((await run(operationId)).operation.status).toBe('succeeded');
    // The charge's own settlement predates the window: only the capture is compared, by a retrieve.
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '1 hour' where id = $1`, [captured.charge]);
    e.emulator.addFault({ endpoint: 'retrieve', fault: { kind: 'error_before_commit', status: 500 }, count: Infinity });
    try {
      await expect(driftReport(t.pool, e.gateway(), since)).rejects.toThrow();
    } finally {
      e.emulator.clearFaults();
    }
    expect((await driftReport(t.pool, e.gateway(), since)).drift.filter((d) => d.operationId === operationId)).toEqual([]);
  });
});
