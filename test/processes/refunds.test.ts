// Refunds (issue 13): requested in the caller's transaction and refused before anything is written when
// they must not happen; carried out under `refund-op:<id>` over the real SDK and the emulator; settled by
// the same lease, fence, review, resolution, webhooks and drift report as charges.
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import type Stripe from 'stripe';
import pg from 'pg';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { requeueOperation } from '../../src/admin/requeue.ts';
import { operationRecord } from '../../src/console/queries.ts';
import { timeline } from '../../src/console/timeline.ts';
import { operationPage } from '../../src/console/views/operation.ts';
import { opHref } from '../../src/console/views/parts.ts';
import { ResolutionRefused, resolveOperation } from '../../src/admin/resolve.ts';
import { inTransaction } from '../../src/db/pool.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { ValidationError } from '../../src/types/errors.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { refundIdempotencyKeyFor } from '../../src/stripe/gateway.ts';
import { OperationNotFoundError, shortOperationId } from '../../src/engine/operation.ts';
import { RefundRefused, requestRefund } from '../../src/kinds/refund/request.ts';
import { driftReport } from '../../src/reconcile/drift.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { claim, confirm, operation } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';
import { Outboxd } from '../../src/outboxd.ts';

let t: TestDb;
let e: RunningEmulator;
const log = createLogger('silent');
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.clearFaults());

/** A charge operation that succeeded through the executor: its id and its PaymentIntent. */
async function paidCharge(amount = 2599): Promise<{ charge: string; pi: string }> {
  const charge = await confirm(t, { amount });
  const run = await executeOperation(t.pool, kindsFor(e.gateway()), charge, await claim(t, charge));
  expect(run.operation.status).toBe('succeeded');
  await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [charge]);
  return { charge, pi: run.operation.external_id! };
}

const refund = (input: Record<string, unknown>) => inTransaction(t.pool, (tx) => requestRefund(tx, input));
/** A refund operation requested and taken out of the outbox (as if relayed): its id. */
async function requested(charge: string, amount: number, key = `k-${Math.random()}`, reason?: string): Promise<string> {
  const { operationId } = await refund({ chargeOperationId: charge, amount, key, ...(reason ? { reason } : {}) });
  await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [operationId]);
  return operationId;
}
const counts = async () =>
  (await t.pool.query(`select (select count(*)::int from outboxd.payment_operations) as ops, (select count(*)::int from outboxd.charge_outbox) as outbox`)).rows[0];
const refundsOf = (op: string) => e.emulator.refundLedger().filter((r) => r.refund.metadata.operation_id === op);
const refundCreates = (op: string) => e.emulator.requests().filter((r) => r.endpoint === 'create_refund' && r.operationId === op);
/** `timeoutMs`: 1 s only for an answer that hangs; otherwise 5 s, so that a loaded machine's stall is not taken for a lost answer. */
const run = async (op: string, fence?: number, timeoutMs = 5_000) => executeOperation(t.pool, kindsFor(e.gateway({ timeoutMs })), op, fence ?? (await claim(t, op)));

describe('requesting a refund: refused before anything is written', () => {
  it('a refund operation and its outbox row, linked to the charge, with the charge’s order and currency', async () => {
    const { charge, pi } = await paidCharge();
    const { operationId, created } = await refund({ chargeOperationId: charge, amount: 1000, key: 'r-1', reason: 'requested_by_customer' });
    expect(created).toBe(true);
    const chargeOp = await operation(t, charge);
    expect(await operation(t, operationId)).toMatchObject({
      kind: 'refund', status: 'pending', amount: 1000, currency: 'eur', order_id: chargeOp.order_id, parent_operation_id: charge,
      effect_key: 'r-1', payload: { payment_intent: pi, reason: 'requested_by_customer' }, customer_id: null, payment_method: null,
    });
    const { rows } = await t.pool.query(`select kind from outboxd.charge_outbox where operation_id = $1`, [operationId]);
    expect(rows).toEqual([{ kind: 'refund' }]);
  });

  it('the same key again is the same refund; the same key with another amount or reason is refused', async () => {
    const { charge } = await paidCharge();
    const first = await refund({ chargeOperationId: charge, amount: 500, key: 'once' });
    expect(await refund({ chargeOperationId: charge, amount: 500, key: 'once' })).toEqual({ operationId: first.operationId, created: false });
    const before = await counts();
    await expect(refund({ chargeOperationId: charge, amount: 501, key: 'once' })).rejects.toMatchObject({ name: 'RefundRefused', code: 'key_conflict' });
    await expect(refund({ chargeOperationId: charge, amount: 500, key: 'once', reason: 'fraudulent' })).rejects.toMatchObject({ code: 'key_conflict' });
    expect(await counts()).toEqual(before);
  });

  it('a charge that has not succeeded (pending, failed) or is no charge is refused', async () => {
    const pending = await confirm(t);
    const declined = await confirm(t, { paymentMethod: 'pm_card_chargeDeclined' });
    await executeOperation(t.pool, kindsFor(e.gateway()), declined, await claim(t, declined));
    const { charge } = await paidCharge();
    const aRefund = await requested(charge, 1);
    const before = await counts();
    for (const [op, code] of [[pending, 'charge_not_succeeded'], [declined, 'charge_not_succeeded'], [aRefund, 'not_a_charge']] as const) {
      const err = await refund({ chargeOperationId: op, amount: 100, key: 'x' }).catch((x: unknown) => x);
      expect(err).toBeInstanceOf(RefundRefused);
      expect(err).toMatchObject({ code, chargeOperationId: op });
    }
    await expect(refund({ chargeOperationId: '00000000-0000-4000-8000-000000000000', amount: 1, key: 'x' })).rejects.toBeInstanceOf(OperationNotFoundError);
    expect(await counts()).toEqual(before);
  });

  it('a transfer to reverse, or an application fee to refund, that the charge does not have is refused', async () => {
    const { charge } = await paidCharge();
    const before = await counts();
    await expect(refund({ chargeOperationId: charge, amount: 100, key: 'rt', reverseTransfer: true })).rejects.toMatchObject({ name: 'RefundRefused', code: 'no_transfer' });
    await expect(refund({ chargeOperationId: charge, amount: 100, key: 'rf', refundApplicationFee: true })).rejects.toMatchObject({ name: 'RefundRefused', code: 'no_application_fee' });
    expect(await counts()).toEqual(before);
    // A connected account's own charge with the platform's fee: the fee can be refunded, there is no transfer.
    const direct = await confirm(t, { stripeAccount: 'acct_1DirectShop', applicationFeeAmount: 100 });
    await executeOperation(t.pool, kindsFor(e.gateway()), direct, await claim(t, direct));
    expect(await refund({ chargeOperationId: direct, amount: 100, key: 'fee', refundApplicationFee: true })).toMatchObject({ created: true });
    await expect(refund({ chargeOperationId: direct, amount: 100, key: 'rt', reverseTransfer: true })).rejects.toMatchObject({ code: 'no_transfer' });
  });

  it.each([
    ['zero', { amount: 0 }, 'amount'],
    ['negative', { amount: -5 }, 'amount'],
    ['not an integer', { amount: 1.5 }, 'amount'],
    ['a string', { amount: '100' }, 'amount'],
    ['an empty key', { key: '' }, 'key'],
    ['an unknown reason', { reason: 'changed_my_mind' }, 'reason'],
    ['not an operation id', { chargeOperationId: 'pi_123' }, 'chargeOperationId'],
  ])('bad input (%s) names the field', async (_name, change, field) => {
    const { charge } = await paidCharge();
    const before = await counts();
    const err = await refund({ chargeOperationId: charge, amount: 100, key: 'k', ...change }).catch((x: unknown) => x);
    expect(err).toBeInstanceOf(ValidationError);
    expect((err as ValidationError).field).toBe(field);
    expect(await counts()).toEqual(before);
  });

  it('over-refund: refunds pending, unknown or succeeded count as spent; a failed one gives its amount back', async () => {
    const { charge } = await paidCharge(2599);
    const a = await requested(charge, 1000); // pending
    const b = await requested(charge, 1000);
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown' where id = $1`, [b]);
    const before = await counts();
    const err = await refund({ chargeOperationId: charge, amount: 600, key: 'too-much' }).catch((x: unknown) => x);
    expect(err).toMatchObject({ name: 'RefundRefused', code: 'exceeds_remaining' });
    expect((err as Error).message).toMatch(/599 of 2599/);
    expect(await counts()).toEqual(before);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = $1`, [a]);
    expect((await refund({ chargeOperationId: charge, amount: 1599, key: 'after-a-failed' })).created).toBe(true);
  });

  /**
   * Two requests of 1500 each against `charge`, in two sessions' transactions at `isolation`: b's snapshot
   * is taken before a's refund commits, and b's request waits on the charge until a commits. What each
   * request came to, and how many refunds of the charge exist afterwards.
   */
  async function raceTwoRefunds(charge: string, isolation: string): Promise<{ first: unknown; second: unknown; made: number }> {
    const a = await t.pool.connect();
    const b = await t.pool.connect();
    const tx = (c: pg.PoolClient) => ({ query: c.query.bind(c), sql: t.pool.sql }) as Parameters<typeof requestRefund>[0];
    let first: unknown;
    let second: unknown;
    try {
      await a.query(`begin isolation level ${isolation}`);
      await b.query(`begin isolation level ${isolation}`);
      await b.query('select 1');
      first = await requestRefund(tx(a), { chargeOperationId: charge, amount: 1500, key: 'a' });
      const waiting = requestRefund(tx(b), { chargeOperationId: charge, amount: 1500, key: 'b' }).catch((x: unknown) => x);
      await new Promise((r) => setTimeout(r, 200));
      await a.query('commit');
      second = await waiting;
      await b.query('rollback');
    } finally {
      a.release();
      b.release();
    }
    const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where parent_operation_id = $1`, [charge]);
    return { first, second, made: rows[0].n };
  }

  it('two concurrent requests that each fit but not together: exactly one is made, the other refused', async () => {
    const { charge } = await paidCharge(2000);
    // b waits for a's transaction on the charge, then sees a's refund.
    const { first, second, made } = await raceTwoRefunds(charge, 'read committed');
    expect(first).toMatchObject({ created: true });
    expect(second).toMatchObject({ name: 'RefundRefused', code: 'exceeds_remaining' });
    expect(made).toBe(1);
  });

  it('under REPEATABLE READ too: the request that waited fails instead of reading refunds from before', async () => {
    const { charge } = await paidCharge(2000);
    const { second, made } = await raceTwoRefunds(charge, 'repeatable read');
    expect(second).toMatchObject({ code: '40001' }); // could not serialize: the application retries
    expect(made).toBe(1);
  });

  it('a bare query function in autocommit is refused before it writes: its lock on the charge ends with each statement, so two refunds that fit only apart could both be made', async () => {
    const { charge } = await paidCharge(2000);
    const o = new Outboxd({ connectionString: t.url, schema: t.schema });
    const before = await counts();
    try {
      // Each statement on the pool is a transaction of its own, as a driver's query without BEGIN.
      const autocommit = { query: (text: string, values?: unknown[]) => t.pool.query(text, values) };
      const asked = ['k0', 'k1'].map((key) => o.requestRefund(autocommit, { chargeOperationId: charge, amount: 1500, key }).catch((err: unknown) => err));
      for (const refused of await Promise.all(asked)) expect(refused).toMatchObject({ name: 'TransactionTypeError', message: expect.stringMatching(/autocommit.*BEGIN first/) });
      expect(await counts()).toEqual(before);
      // Inside BEGIN, the same function is the caller's transaction.
      const client = await t.pool.connect();
      try {
        await client.query('begin');
        const inTx = { query: (text: string, values?: unknown[]) => client.query(text, values) };
        expect(await o.requestRefund(inTx, { chargeOperationId: charge, amount: 1500, key: 'k0' })).toMatchObject({ created: true });
        await client.query('commit');
      } finally {
        client.release();
      }
    } finally {
      await o.stop();
    }
  });

  it('rolled back with the caller’s transaction', async () => {
    const { charge } = await paidCharge();
    const before = await counts();
    await expect(
      inTransaction(t.pool, async (tx) => {
        await requestRefund(tx, { chargeOperationId: charge, amount: 10, key: 'rolled-back' });
        throw new Error('the order service failed');
      }),
    ).rejects.toThrow('the order service failed');
    expect(await counts()).toEqual(before);
  });
});

describe('carrying a refund out (POST /v1/refunds under refund-op:<id>)', () => {
  it('sends payment_intent, amount, reason and metadata[operation_id] under its key; succeeded → succeeded with the re_', async () => {
    const { charge, pi } = await paidCharge();
    const op = await requested(charge, 700, 'r', 'duplicate');
    const done = await run(op);
    expect(done.operation).toMatchObject({ status: 'succeeded', external_id: expect.stringMatching(/^re_/) });
    expect(refundsOf(op)).toHaveLength(1);
    expect(refundsOf(op)[0]).toMatchObject({
      idempotencyKey: refundIdempotencyKeyFor(op),
      refund: { id: done.operation.external_id, payment_intent: pi, amount: 700, currency: 'eur', reason: 'duplicate', metadata: { operation_id: op } },
    });
    expect(refundCreates(op).map((r) => r.idempotencyKey)).toEqual([`refund-op:${op}`]);
  });

  it.each(['truncate', 'reset', 'hang'] as const)('response lost (%s) → unknown; the retry with the same key converges to one refund', async (mode) => {
    const { charge } = await paidCharge();
    const op = await requested(charge, 900);
    const fence = await claim(t, op);
    // a reset is resent once by the SDK itself, so that answer must be lost too
    e.emulator.addFault({ endpoint: 'create_refund', match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode }, count: mode === 'reset' ? 2 : 1 });
    const first = await run(op, fence, 1_000);
    expect(first.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous', external_id: null });
    expect(refundsOf(op)).toHaveLength(1); // it did happen
    const second = await run(op, fence);
    expect(second.operation).toMatchObject({ status: 'succeeded', external_id: refundsOf(op)[0]!.refund.id });
    expect(refundsOf(op)).toHaveLength(1);
    expect(new Set(refundCreates(op).map((r) => r.idempotencyKey))).toEqual(new Set([refundIdempotencyKeyFor(op)]));
    expect(refundCreates(op).at(-1)!.replayed).toBe(true);
  });

  it("a 500 whose error names the charge's PaymentIntent → unknown with no external id (the refund's is a re_): sent again, not retrieved by the pi_", async () => {
    const { charge, pi } = await paidCharge();
    const op = await requested(charge, 300);
    const fence = await claim(t, op);
    e.emulator.addFault({ endpoint: 'create_refund', match: { operationId: op }, fault: { kind: 'error_before_commit', status: 500, paymentIntent: pi }, count: 1 });
    const first = await run(op, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous', external_id: null });
    const second = await run(op, fence);
    expect(second).toMatchObject({ call: 'create', operation: { status: 'succeeded', external_id: expect.stringMatching(/^re_/) } });
    expect(refundsOf(op)).toHaveLength(1);

    // A refund pending, known by its re_: a retrieve answered so keeps it.
    const pending = await requested(charge, 200);
    e.emulator.addFault({ match: { operationId: pending }, fault: { kind: 'refund_status', status: 'pending' } });
    const known = (await run(pending)).operation.external_id;
    expect(known).toMatch(/^re_/);
    e.emulator.addFault({ endpoint: 'retrieve_refund', fault: { kind: 'error_before_commit', status: 500, paymentIntent: pi }, count: 1 });
    expect(await run(pending)).toMatchObject({ call: 'retrieve', operation: { status: 'unknown', external_id: known } });
  });

  it('pending is not success: unknown with the re_, then settled by retrieve (never a second create); failed → failed', async () => {
    const { charge } = await paidCharge();
    const op = await requested(charge, 100);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'refund_status', status: 'pending' } });
    const first = await run(op, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', external_id: expect.stringMatching(/^re_/) });
    expect((await run(op, fence)).operation.status).toBe('unknown');
    e.emulator.settleRefund(first.operation.external_id!, 'succeeded');
    const settled = await run(op, fence);
    expect(settled).toMatchObject({ call: 'retrieve', operation: { status: 'succeeded' } });
    expect(refundCreates(op)).toHaveLength(1);

    const failing = await requested(charge, 100);
    e.emulator.addFault({ match: { operationId: failing }, fault: { kind: 'refund_status', status: 'requires_action' } });
    const pending = await run(failing);
    expect(pending.operation.status).toBe('unknown');
    e.emulator.settleRefund(pending.operation.external_id!, 'failed');
    expect((await run(failing)).operation).toMatchObject({ status: 'failed', last_error: 'refund failed' });
    // its amount is free again
    expect((await refund({ chargeOperationId: charge, amount: 2499, key: 'the-rest' })).created).toBe(true);
  });

  it('Stripe refusing the refund (refunded outside outboxd meanwhile) → failed, nothing refunded', async () => {
    const { charge, pi } = await paidCharge(1000);
    const op = await requested(charge, 800);
    await e.client().refunds.create({ payment_intent: pi, amount: 500 }); // in the dashboard
    const done = await run(op);
    expect(done.operation).toMatchObject({ status: 'failed', last_error: expect.stringMatching(/amount_too_large/) });
    expect(refundsOf(op)).toHaveLength(0);
  });

  describe('past the key window: never created again, found in the PaymentIntent’s refunds', () => {
    const passWindow = (op: string) =>
      t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - interval '23 hours 1 minute' where id = $1`, [op]);

    it('one refund with the operation’s id settles it', async () => {
      const { charge } = await paidCharge();
      const op = await requested(charge, 300);
      const fence = await claim(t, op);
      e.emulator.addFault({ endpoint: 'create_refund', match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
      await run(op, fence);
      e.emulator.advanceClock(24 * 3600_000);
      e.emulator.pruneKeys();
      await passWindow(op);
      const reconciled = await run(op, fence);
      expect(reconciled).toMatchObject({ call: 'search', operation: { status: 'succeeded', external_id: refundsOf(op)[0]!.refund.id } });
      expect(refundCreates(op)).toHaveLength(1);
      expect(e.emulator.requests().filter((r) => r.endpoint === 'list_refunds')).not.toHaveLength(0);
    });

    it('none → review, not failed and not created; two → review naming both, kept when one of them settles it', async () => {
      const { charge, pi } = await paidCharge();
      const none = await requested(charge, 300);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1 where id = $1`, [none]);
      await passWindow(none);
      expect((await run(none)).operation).toMatchObject({ status: 'unknown', needs_review: true, review_reason: expect.stringMatching(/list none/) });
      expect(refundCreates(none)).toHaveLength(0);

      const two = await requested(charge, 300);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1 where id = $1`, [two]);
      await passWindow(two);
      const made = [await e.client().refunds.create({ payment_intent: pi, amount: 300, metadata: { operation_id: two } }), await e.client().refunds.create({ payment_intent: pi, amount: 300, metadata: { operation_id: two } })];
      const held = (await run(two)).operation;
      expect(held).toMatchObject({ status: 'unknown', needs_review: true, external_id: null });
      for (const r of made) expect(held.review_reason).toContain(r.id);
      // One of them settling the operation later (its webhook) answers neither: the person still has both.
      const event = { id: `evt_${two}`, type: 'refund.updated', data: { object: { id: made[0]!.id } } } as unknown as Stripe.Event;
      expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, event)).toBe('settled');
      expect(await operation(t, two)).toMatchObject({ status: 'succeeded', external_id: made[0]!.id, needs_review: true, review_reason: held.review_reason });
    });

    it('the reconcile sweep settles a refund past its window, read-only', async () => {
      const { charge } = await paidCharge();
      const op = await requested(charge, 250);
      await run(op, await claim(t, op));
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', settled_at = null, external_id = null, first_attempted_at = now() - interval '2 days' where id = $1`, [op]);
      await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where status in ('pending', 'unknown') and id <> $1`, [op]);
      const creates = refundCreates(op).length;
      const report = await reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log });
      expect(report.decisions).toContainEqual(expect.objectContaining({ operationId: op, call: 'search', to: 'succeeded' }));
      expect(refundCreates(op)).toHaveLength(creates);
    });
  });
});

describe('requeue', () => {
  it('re-drives the same refund operation from its own queue: the same key, one refund', async () => {
    const { charge } = await paidCharge();
    const op = await requested(charge, 123);
    const fence = await claim(t, op);
    e.emulator.addFault({ endpoint: 'create_refund', match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    expect((await run(op, fence)).operation.status).toBe('unknown');
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'retries exhausted' where id = $1`, [op]);
    expect(await requeueOperation(t.pool, t.boss, op, { actor: 'alice' })).toMatchObject({ result: 'requeued' });
    const { rows } = await t.pool.query(`select name from pgboss.job where data->>'operationId' = $1`, [op]);
    expect(rows).toEqual([{ name: 'refund' }]);
    expect(await requeueOperation(t.pool, t.boss, op, { actor: 'bob' })).toMatchObject({ result: 'skipped', reason: expect.stringMatching(/is created/) });
    const replica = await startDispatcher(t, e.gateway(), 'refund-replica');
    try {
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'settled');
    } finally {
      await replica.stop();
    }
    expect(refundsOf(op)).toHaveLength(1);
    expect(new Set(refundCreates(op).map((r) => r.idempotencyKey))).toEqual(new Set([refundIdempotencyKeyFor(op)]));
  });
});

describe('a person’s resolution, webhooks and the drift report', () => {
  const RESOLVE = { leaseTtlMs: 10_000, searchFreshnessSeconds: 3_600 };
  /** A refund operation whose create went out and whose answer was lost: held for review. */
  async function heldRefund(charge: string, amount: number): Promise<string> {
    const op = await requested(charge, amount);
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, review_reason = 'retries exhausted',
      first_attempted_at = now() - interval '2 hours', last_attempted_at = now() - interval '2 hours' where id = $1`, [op]);
    return op;
  }

  it('--succeeded must name a refund of this operation, amount and currency; --failed is refused while one has not failed', async () => {
    const { charge, pi } = await paidCharge();
    const op = await heldRefund(charge, 400);
    const other = await e.client().refunds.create({ payment_intent: pi, amount: 400, metadata: { operation_id: '00000000-0000-4000-8000-000000000001' } });
    const gw = e.gateway();
    const resolve = (resolution: Parameters<typeof resolveOperation>[3]) => resolveOperation(t.pool, gw, op, resolution, 'alice', RESOLVE);
    await expect(resolve({ outcome: 'succeeded', externalId: charge })).rejects.toThrow(/Refund id \(re_… or pyr_…\)/);
    await expect(resolve({ outcome: 'succeeded', externalId: other.id })).rejects.toThrow(/belongs to operation 00000000/);
    const pending = await e.client().refunds.create({ payment_intent: pi, amount: 400, metadata: { operation_id: op } });
    e.emulator.settleRefund(pending.id, 'pending');
    await expect(resolve({ outcome: 'failed', reason: 'nothing in the dashboard' })).rejects.toThrow(/have not failed: re_\w+ \(pending\)/);
    await expect(resolve({ outcome: 'succeeded', externalId: pending.id })).rejects.toThrow(/is pending, not succeeded/);
    e.emulator.settleRefund(pending.id, 'succeeded');
    expect(await resolve({ outcome: 'succeeded', externalId: pending.id })).toMatchObject({ status: 'succeeded', external_id: pending.id });

    const failed = await heldRefund(charge, 100);
    const gone = await e.client().refunds.create({ payment_intent: pi, amount: 100, metadata: { operation_id: failed } });
    e.emulator.settleRefund(gone.id, 'failed');
    const resolved = await resolveOperation(t.pool, gw, failed, { outcome: 'failed', reason: 'the bank returned it' }, 'bob', RESOLVE);
    expect(resolved).toMatchObject({ status: 'failed' });
    await expect(resolveOperation(t.pool, gw, failed, { outcome: 'failed', reason: 'again' }, 'bob', RESOLVE)).rejects.toBeInstanceOf(ResolutionRefused);
  });

  it('--failed waits out a recent create: a refund request Stripe is still running shows in no list, and would be paid again', async () => {
    const { charge, pi } = await paidCharge(1000);
    const op = await heldRefund(charge, 400);
    await t.pool.query(`update outboxd.payment_operations set last_attempted_at = now() - interval '1 second' where id = $1`, [op]);
    const resolve = () => resolveOperation(t.pool, e.gateway(), op, { outcome: 'failed', reason: 'nothing in the dashboard' }, 'alice', RESOLVE);
    await expect(resolve()).rejects.toThrow(/the last attempt to refund was \d s ago: .*try again in 3\d{3} s/);
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', lease_owner: null });
    // The request that was still running lands: the application was not told the refund failed, so it
    // asks for no second one, and the operation still settles by what Stripe did.
    await e.client().refunds.create({ payment_intent: pi, amount: 400, metadata: { operation_id: op } }, { idempotencyKey: refundIdempotencyKeyFor(op) });
    await t.pool.query(`update outboxd.payment_operations set last_attempted_at = now() - interval '2 hours' where id = $1`, [op]);
    await expect(resolve()).rejects.toThrow(/have not failed: re_\w+ \(succeeded\)/);
  });

  it('a refund.updated event is a hint: the retrieved refund settles the pending operation; one naming a charge operation is a mismatch', async () => {
    const { charge } = await paidCharge();
    const op = await requested(charge, 150);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'refund_status', status: 'pending' } });
    const pending = (await run(op)).operation;
    expect(pending.status).toBe('unknown');
    const event = (type: string, id: string) => ({ id: `evt_${Math.random().toString(36).slice(2)}`, type, data: { object: { id } } }) as unknown as Stripe.Event;
    const receive = (ev: Stripe.Event) => receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, ev);
    expect(await receive(event('refund.updated', pending.external_id!))).toBe('not_final');
    e.emulator.settleRefund(pending.external_id!, 'succeeded');
    expect(await receive(event('refund.updated', pending.external_id!))).toBe('settled');
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', external_id: pending.external_id });
    // The console shows the refund Stripe was asked about, and the charge operation it refunds.
    const settled = await operation(t, op);
    const record = await operationRecord(t.pool, settled);
    const hooks = timeline(settled, record).filter((x) => x.kind === 'webhook');
    expect(hooks.map((x) => x.facts)).toContainEqual(expect.arrayContaining([['Stripe object', pending.external_id], ['its status', 'succeeded']]));
    const page = String(operationPage(settled, record, timeline(settled, record), {}, { csrfToken: 'x', now: new Date(), dashboard: undefined }));
    expect(page).toMatch(new RegExp(`<dt>Of charge</dt><dd><a [^>]*href="${opHref(charge)}"`));

    const unsettled = await requested(charge, 10);
    const { pi } = await paidCharge();
    const wrong = await e.client().refunds.create({ payment_intent: pi, amount: 10, metadata: { operation_id: charge } });
    expect(await receive(event('charge.refund.updated', wrong.id))).toBe('contradiction'); // names a settled charge operation
    const aimed = await e.client().refunds.create({ payment_intent: pi, amount: 11, metadata: { operation_id: unsettled } });
    expect(await receive(event('refund.created', aimed.id))).toBe('mismatch');
    expect(await operation(t, unsettled)).toMatchObject({ status: 'pending', needs_review: true });
  });

  it('a refund Stripe fails after it succeeded (a closed card): the operation stays succeeded, held for a person, and no longer counts as refunded, so the refund still owed can be made', async () => {
    const { charge } = await paidCharge(1000);
    const op = await requested(charge, 1000);
    const done = (await run(op)).operation;
    expect(done.status).toBe('succeeded');
    await expect(refund({ chargeOperationId: charge, amount: 1000, key: 'again' })).rejects.toThrow(/0 of 1000/);
    e.emulator.settleRefund(done.external_id!, 'failed');
    const event = () => ({ id: `evt_${Math.random().toString(36).slice(2)}`, type: 'charge.refund.updated', data: { object: { id: done.external_id } } }) as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, event())).toBe('recorded');
    const recorded = await operation(t, op);
    expect(recorded).toMatchObject({ status: 'succeeded', external_id: done.external_id, result: { failed_in_stripe: { status: 'failed', source: 'webhook' } } });
    expect(recorded.review_reason).toMatch(/is failed although the operation settled succeeded: the money did not reach the customer/);
    // Recorded once: its other events (refund.failed) change nothing.
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, event())).toBe('already_settled');
    // Stripe lets the money be refunded again, and so does outboxd: once.
    const again = await requested(charge, 1000, 'again');
    expect((await run(again)).operation).toMatchObject({ status: 'succeeded' });
    await expect(refund({ chargeOperationId: charge, amount: 1, key: 'more' })).rejects.toThrow(/0 of 1000/);
    // Nothing left for the drift report: the failure is recorded, the second refund returned the money.
    const report = await driftReport(t.pool, e.gateway(), new Date(Date.now() - 60_000));
    expect(report.drift.filter((d) => d.operationId === op || d.operationId === again)).toEqual([]);
  });

  it('a bank debit’s refund is a pyr_: its webhooks are heard (a pending one settles, a failure after success is recorded) and a person may resolve with it', async () => {
    const charge = await confirm(t, { paymentMethod: 'pm_card_processing' });
    expect((await run(charge)).operation.status).toBe('unknown'); // processing
    const pi = (await operation(t, charge)).external_id!;
    e.emulator.settle(pi, 'succeeded');
    expect((await run(charge)).operation.status).toBe('succeeded');
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [charge]);
    const event = (type: string, id: string) => ({ id: `evt_${Math.random().toString(36).slice(2)}`, type, data: { object: { id } } }) as unknown as Stripe.Event;
    const receive = (ev: Stripe.Event) => receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, ev);

    const returned = await requested(charge, 300);
    const done = (await run(returned)).operation;
    expect(done).toMatchObject({ status: 'succeeded', external_id: expect.stringMatching(/^pyr_/) });
    e.emulator.settleRefund(done.external_id!, 'failed'); // the bank sent it back
    expect(await receive(event('refund.failed', done.external_id!))).toBe('recorded');

    const slow = await requested(charge, 200);
    e.emulator.addFault({ match: { operationId: slow }, fault: { kind: 'refund_status', status: 'pending' } });
    const pending = (await run(slow)).operation;
    expect(pending).toMatchObject({ status: 'unknown', external_id: expect.stringMatching(/^pyr_/) });
    e.emulator.settleRefund(pending.external_id!, 'succeeded');
    expect(await receive(event('refund.updated', pending.external_id!))).toBe('settled');

    const byHand = await requested(charge, 100);
    e.emulator.addFault({ match: { operationId: byHand }, fault: { kind: 'refund_status', status: 'pending' } });
    const held = (await run(byHand)).operation;
    e.emulator.settleRefund(held.external_id!, 'succeeded');
    const resolved = await resolveOperation(t.pool, e.gateway(), byHand, { outcome: 'succeeded', externalId: held.external_id! }, 'alice', { leaseTtlMs: 10_000, searchFreshnessSeconds: 3_600 });
    expect(resolved).toMatchObject({ status: 'succeeded', external_id: held.external_id });
  });

  it('drift: a refund without an operation, an operation with two refunds, a succeeded refund operation without its refund', async () => {
    const since = new Date(Date.now() - 60_000);
    const { charge, pi } = await paidCharge();
    const outside = await e.client().refunds.create({ payment_intent: pi, amount: 50 }); // the dashboard
    const stray = await e.client().refunds.create({ payment_intent: pi, amount: 60, metadata: { operation_id: '00000000-0000-4000-8000-0000000000aa' } });
    const twice = await requested(charge, 70);
    await run(twice);
    await e.client().refunds.create({ payment_intent: pi, amount: 70, metadata: { operation_id: twice } }); // a resend whose key was forgotten
    const missing = await requested(charge, 80);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), external_id = 're_doesnotexist' where id = $1`, [missing]);

    const report = await driftReport(t.pool, e.gateway(), since);
    const kinds = report.drift.map((d) => [d.kind, d.operationId]);
    expect(kinds).toContainEqual(['orphan_refund', null]);
    expect(report.drift.find((d) => d.kind === 'orphan_refund' && d.operationId === null)!.chargeIds).toEqual([outside.id]);
    expect(kinds).toContainEqual(['orphan_refund', '00000000-0000-4000-8000-0000000000aa']);
    expect(report.drift.find((d) => d.operationId === '00000000-0000-4000-8000-0000000000aa')!.chargeIds).toEqual([stray.id]);
    expect(kinds).toContainEqual(['duplicate_refund', twice]);
    expect(kinds).toContainEqual(['missing_refund', missing]);
  });

  it('drift: one refund recorded by two succeeded refund operations (its metadata edited from one to the other between a lost answer and its resend)', async () => {
    const since = new Date(Date.now() - 60_000);
    const { charge } = await paidCharge(1000);
    const [first, second] = [await requested(charge, 300), await requested(charge, 300)];
    const done = (await run(first)).operation;
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), external_id = $2 where id = $1`, [second, done.external_id]);
    const report = await driftReport(t.pool, e.gateway(), since);
    const shared = report.drift.filter((d) => d.kind === 'shared_refund');
    expect(shared).toHaveLength(1);
    expect(shared[0]).toMatchObject({ chargeIds: [done.external_id] });
    expect([first, second]).toContain(shared[0]!.operationId);
  });
});

describe('outboxd refund', () => {
  const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
  const cli = (...args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> =>
    new Promise((resolve) => {
      const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, DATABASE_URL: t.url, STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: '', LOG_LEVEL: 'silent' } });
      let stdout = '';
      let stderr = '';
      child.stdout.on('data', (d) => (stdout += d));
      child.stderr.on('data', (d) => (stderr += d));
      child.on('exit', (code) => resolve({ code, stdout, stderr }));
    });

  it('prints the refund operation (--json: operationId, created); the same key again is the same one; refusals exit 2', async () => {
    const { charge } = await paidCharge(1000);
    const first = await cli('refund', charge, '--amount', '600', '--key', 'cli-1', '--reason', 'requested_by_customer');
    expect(first.code).toBe(0);
    const id = first.stdout.trim();
    expect(await operation(t, id)).toMatchObject({ kind: 'refund', amount: 600, parent_operation_id: charge });
    const again = await cli('refund', shortOperationId(charge), '--amount', '600', '--key', 'cli-1', '--reason', 'requested_by_customer', '--json');
    expect(again.code).toBe(0);
    expect(JSON.parse(again.stdout)).toEqual({ operationId: id, created: false });

    const before = await counts();
    const over = await cli('refund', charge, '--amount', '401', '--key', 'cli-2');
    expect(over.code).toBe(2);
    expect(over.stderr).toMatch(/exceeds what remains unrefunded of charge .*: 400 of 1000/);
    const pending = await confirm(t);
    const notPaid = await cli('refund', pending, '--amount', '1', '--key', 'cli-3');
    expect(notPaid.code).toBe(2);
    expect(notPaid.stderr).toMatch(/is pending: only a succeeded charge can be refunded/);
    const zero = await cli('refund', charge, '--amount', '0', '--key', 'cli-4');
    expect(zero.code).toBe(2);
    expect(zero.stderr).toMatch(/--amount: amount must be positive/);
    expect((await cli('refund', charge, '--amount', '1', '--key', 'cli-5', '--reason', 'whim')).code).toBe(2);
    expect(await counts()).toEqual({ ...before, ops: before.ops + 1, outbox: before.outbox + 1 }); // only the pending charge
  });
});
