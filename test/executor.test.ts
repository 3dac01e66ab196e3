// The seed's table, with the in-process fake Stripe over a real PostgreSQL.
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { executeOperation } from '../src/payments/executor.ts';
import { AmbiguousOutcome, idempotencyKeyFor, IdempotencyKeyMisuse, type PaymentGateway } from '../src/payments/gateway.ts';
import { StaleFenceError } from '../src/payments/operation.ts';
import { createTestDatabase, type TestDb } from './support/db.ts';
import { FakeStripe } from './support/fakeStripe.ts';
import { claim, confirm, operation } from './support/fixtures.ts';
import { waitUntil } from '../scripts/lib/replica.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

const creates = (s: FakeStripe) => s.calls.filter((c) => c.method === 'create');
const ageFirstAttempt = (id: string, hours: number) =>
  t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - $2 * interval '1 hour' where id = $1`, [id, hours]);

describe('executeOperation (a charge)', () => {
  it('charges once and settles succeeded, with the key derived from the operation id (invariant 2)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    const run = await executeOperation(t.pool, stripe, id, await claim(t, id));
    expect(run.operation.status).toBe('succeeded');
    expect(run.operation.external_id).toBe(stripe.charges[0]!.id);
    expect(run.operation.first_attempted_at).toBeInstanceOf(Date);
    expect(creates(stripe).map((c) => c.key)).toEqual([`payment-op:${id}`]);
  });

  it('response lost → unknown; the retry with the same key settles succeeded with one charge', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    const fence = await claim(t, id);
    stripe.loseResponseOnce = true;
    const first = await executeOperation(t.pool, stripe, id, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous', external_id: null });
    const second = await executeOperation(t.pool, stripe, id, fence);
    expect(second.operation.status).toBe('succeeded');
    expect(stripe.charges).toHaveLength(1);
    expect(new Set(creates(stripe).map((c) => c.key))).toEqual(new Set([idempotencyKeyFor(id)]));
  });

  it('negative control: a new key per retry after a lost response charges twice', async () => {
    const stripe = new FakeStripe();
    const req = { operationId: 'op', amount: 100, currency: 'eur', customer: 'c', paymentMethod: 'pm_card_visa', metadata: {} };
    stripe.loseResponseOnce = true;
    await expect(stripe.createCharge({ ...req, idempotencyKey: 'random-1' })).rejects.toBeInstanceOf(AmbiguousOutcome);
    await stripe.createCharge({ ...req, idempotencyKey: 'random-2' });
    expect(stripe.charges).toHaveLength(2);
  });

  it('decline → failed, and a settled operation is never called again (invariant 5)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t, { paymentMethod: 'pm_card_chargeDeclined' });
    const fence = await claim(t, id);
    const run = await executeOperation(t.pool, stripe, id, fence);
    expect(run.operation).toMatchObject({ status: 'failed', last_outcome: 'failed' });
    expect(run.operation.settled_at).toBeInstanceOf(Date);
    const again = await executeOperation(t.pool, stripe, id, fence);
    expect(again.call).toBeNull();
    expect(stripe.calls).toHaveLength(1);
  });

  it('processing → unknown with the charge id; the next run retrieves (never creates) and settles (invariant 6)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t, { paymentMethod: 'pm_card_processing' });
    const fence = await claim(t, id);
    const first = await executeOperation(t.pool, stripe, id, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', external_id: stripe.charges[0]!.id });
    stripe.settle(stripe.charges[0]!.id, 'succeeded');
    const second = await executeOperation(t.pool, stripe, id, fence);
    expect(second.call).toBe('retrieve');
    expect(second.operation.status).toBe('succeeded');
    expect(creates(stripe)).toHaveLength(1);
  });

  it('429 → status unchanged, retried later with the same key', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    const fence = await claim(t, id);
    stripe.rateLimitNext = 1;
    const first = await executeOperation(t.pool, stripe, id, fence);
    expect(first.operation).toMatchObject({ status: 'pending', last_outcome: 'rate_limited' });
    const second = await executeOperation(t.pool, stripe, id, fence);
    expect(second.operation.status).toBe('succeeded');
    expect(creates(stripe).map((c) => c.key)).toEqual([idempotencyKeyFor(id), idempotencyKeyFor(id)]);
  });

  it('an idempotency key misuse is held for review, loudly, not retried as if normal', async () => {
    const misuse: PaymentGateway = {
      createCharge: async () => {
        throw new IdempotencyKeyMisuse('Keys for idempotent requests can only be used with the same parameters', 400);
      },
      retrieveCharge: async () => {
        throw new Error('unused');
      },
      findCharges: async () => [],
      listCharges: async () => [],
      createRefund: async () => {
        throw new Error('unused');
      },
      retrieveRefund: async () => {
        throw new Error('unused');
      },
      findRefunds: async () => [],
      listRefunds: async () => [],
    };
    const id = await confirm(t);
    const run = await executeOperation(t.pool, misuse, id, await claim(t, id));
    expect(run.operation.status).toBe('unknown');
    expect(run.operation.needs_review).toBe(true);
    expect(run.operation.review_reason).toMatch(/idempotency key misuse/);
  });

  describe('the key window (invariant 7)', () => {
    it('past the window: reconciles through search and never creates', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      stripe.loseResponseOnce = true;
      await executeOperation(t.pool, stripe, id, fence);
      stripe.pruneKeys();
      await ageFirstAttempt(id, 24);
      const run = await executeOperation(t.pool, stripe, id, fence);
      expect(run.call).toBe('search');
      expect(run.operation).toMatchObject({ status: 'succeeded', external_id: stripe.charges[0]!.id });
      expect(creates(stripe)).toHaveLength(1);
      expect(stripe.charges).toHaveLength(1);
    });

    it('just inside the window: resends with the same key', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      stripe.loseResponseOnce = true;
      await executeOperation(t.pool, stripe, id, fence);
      await ageFirstAttempt(id, 22.9);
      const run = await executeOperation(t.pool, stripe, id, fence);
      expect(run.call).toBe('create');
      expect(run.operation.status).toBe('succeeded');
      expect(stripe.charges).toHaveLength(1);
    });

    it('reconcile finds requires_payment_method → failed', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t, { paymentMethod: 'pm_card_chargeDeclinedInsufficientFunds' });
      const fence = await claim(t, id);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() - interval '2 days' where id = $1`, [id]);
      stripe.addCharge({ status: 'requires_payment_method', amount: 2599, currency: 'eur', operationId: id });
      const run = await executeOperation(t.pool, stripe, id, fence);
      expect(run.operation.status).toBe('failed');
      expect(creates(stripe)).toHaveLength(0);
    });

    it('reconcile finds nothing (search lag) → stays unknown, flagged for review, not failed', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      stripe.loseResponseOnce = true;
      await executeOperation(t.pool, stripe, id, fence);
      stripe.pruneKeys();
      stripe.searchIndexed = false;
      await ageFirstAttempt(id, 30);
      const run = await executeOperation(t.pool, stripe, id, fence);
      expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true });
      expect(run.operation.review_reason).toMatch(/no charge/);
      expect(creates(stripe)).toHaveLength(1);
      // Once the index catches up, the next pass settles it and clears the review.
      stripe.searchIndexed = true;
      const later = await executeOperation(t.pool, stripe, id, fence);
      expect(later.operation).toMatchObject({ status: 'succeeded', needs_review: false });
    });

    it('reconcile finds two charges → review, never picks one', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() - interval '25 hours' where id = $1`, [id]);
      stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: id });
      stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: id });
      const run = await executeOperation(t.pool, stripe, id, fence);
      expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true, external_id: null });
      expect(run.operation.review_reason).toMatch(/2 charges/);
    });

    it('a match with another amount is not accepted as this operation’s charge', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() - interval '25 hours' where id = $1`, [id]);
      stripe.addCharge({ status: 'succeeded', amount: 1, currency: 'eur', operationId: id });
      const run = await executeOperation(t.pool, stripe, id, fence);
      expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true });
    });

    it('created 3 days ago but never sent → sent normally (the window starts at the first send)', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      await t.pool.query(`update outboxd.payment_operations set created_at = now() - interval '3 days' where id = $1`, [id]);
      const run = await executeOperation(t.pool, stripe, id, await claim(t, id));
      expect(run.call).toBe('create');
      expect(run.operation.status).toBe('succeeded');
    });
  });

  describe('fencing (invariant 8)', () => {
    it('a stale token writes nothing and makes no call', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const stale = await claim(t, id, 'worker-a');
      await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [id]);
      const current = await claim(t, id, 'worker-b');
      expect(current).toBeGreaterThan(stale);
      const before = await operation(t, id);
      await expect(executeOperation(t.pool, stripe, id, stale)).rejects.toBeInstanceOf(StaleFenceError);
      expect(stripe.calls).toHaveLength(0);
      expect(await operation(t, id)).toEqual(before);
    });

    it('a claim taken over during the call: the outcome of the stale call is rejected', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const stale = await claim(t, id, 'worker-a');
      let release!: () => void;
      stripe.hold = new Promise((r) => (release = r));
      const running = executeOperation(t.pool, stripe, id, stale);
      await waitUntil(() => stripe.calls.length === 1, 5_000, 'the gateway call');
      await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [id]);
      await claim(t, id, 'worker-b');
      release();
      const err = await running.catch((e: unknown) => e);
      expect(err).toBeInstanceOf(StaleFenceError);
      expect((await operation(t, id)).status).toBe('pending');
    });
  });

  it('no transaction is open while the gateway is called (invariant 3)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    let release!: () => void;
    stripe.hold = new Promise((r) => (release = r));
    const pool = (await import('../src/db/pool.ts')).createPool(t.url, { schema: t.schema, max: 2, applicationName: 'executor-under-test' });
    try {
      const running = executeOperation(pool, stripe, id, await claim(t, id));
      await waitUntil(() => stripe.calls.length === 1, 5_000, 'the gateway call');
      const observer = new pg.Client({ connectionString: t.url });
      await observer.connect();
      const { rows } = await observer.query(
        `select state from pg_stat_activity where application_name = 'executor-under-test' and datname = current_database()`,
      );
      await observer.end();
      expect(rows.map((r) => r.state)).not.toContain('idle in transaction');
      expect(rows.map((r) => r.state)).not.toContain('active');
      expect(pool.totalCount - pool.idleCount).toBe(0); // no connection checked out for the call
      release();
      expect((await running).operation.status).toBe('succeeded');
    } finally {
      await pool.end();
    }
  });
});
