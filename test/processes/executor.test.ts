// The seed's table, with the in-process fake Stripe over a real PostgreSQL.
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import type Stripe from 'stripe';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { callTable, executeOperation, KEY_WINDOW_SECONDS } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { AmbiguousOutcome, idempotencyKeyFor, IdempotencyKeyMisuse, type PaymentGateway } from '../../src/stripe/gateway.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { claimAttempt, recordOutcome, StaleFenceError, type Lease, type BegunAttempt } from '../../src/engine/operation.ts';
import { counting } from '../support/counting.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { claim, confirm, operation } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

const creates = (s: FakeStripe) => s.calls.filter((c) => c.method === 'create');
const ageFirstAttempt = (id: string, hours: number) =>
  t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - $2 * interval '1 hour' where id = $1`, [id, hours]);
const expireLease = (id: string) => t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [id]);

/** The dispatcher's claim: the lease, the choice of the call and its attempt, in one statement. */
const claimWithAttempt = (id: string, owner = 'worker-a', kind = 'charge') =>
  claimAttempt(t.pool, id, owner, 60_000, KEY_WINDOW_SECONDS, kind, 'idempotent-key', callTable('idempotent-key'));
/** The dispatcher's path: claimWithAttempt, then the executor from the attempt that claim began. */
async function runClaimed(stripe: PaymentGateway, id: string, owner = 'worker-a') {
  const { lease } = await claimWithAttempt(id, owner);
  return executeOperation(t.pool, kindsFor(stripe), id, lease!.fence, { claimed: lease!.operation, begun: lease!.begun });
}

describe('executeOperation (a charge)', () => {
  it('charges once and settles succeeded, with the key derived from the operation id (invariant 2)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    const run = await executeOperation(t.pool, kindsFor(stripe), id, await claim(t, id));
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
    const first = await executeOperation(t.pool, kindsFor(stripe), id, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous', external_id: null });
    const second = await executeOperation(t.pool, kindsFor(stripe), id, fence);
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
    const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
    expect(run.operation).toMatchObject({ status: 'failed', last_outcome: 'failed' });
    expect(run.operation.settled_at).toBeInstanceOf(Date);
    const again = await executeOperation(t.pool, kindsFor(stripe), id, fence);
    expect(again.call).toBeNull();
    expect(stripe.calls).toHaveLength(1);
  });

  it('processing → unknown with the charge id; the next run retrieves (never creates) and settles (invariant 6)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t, { paymentMethod: 'pm_card_processing' });
    const fence = await claim(t, id);
    const first = await executeOperation(t.pool, kindsFor(stripe), id, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', external_id: stripe.charges[0]!.id });
    stripe.settle(stripe.charges[0]!.id, 'succeeded');
    const second = await executeOperation(t.pool, kindsFor(stripe), id, fence);
    expect(second.call).toBe('retrieve');
    expect(second.operation.status).toBe('succeeded');
    expect(creates(stripe)).toHaveLength(1);
  });

  it('429 → status unchanged, retried later with the same key', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    const fence = await claim(t, id);
    stripe.rateLimitNext = 1;
    const first = await executeOperation(t.pool, kindsFor(stripe), id, fence);
    expect(first.operation).toMatchObject({ status: 'pending', last_outcome: 'rate_limited' });
    const second = await executeOperation(t.pool, kindsFor(stripe), id, fence);
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
      capturePaymentIntent: async () => {
        throw new Error('unused');
      },
      cancelPaymentIntent: async () => {
        throw new Error('unused');
      },
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
    const run = await executeOperation(t.pool, kindsFor(misuse), id, await claim(t, id));
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
      await executeOperation(t.pool, kindsFor(stripe), id, fence);
      stripe.pruneKeys();
      await ageFirstAttempt(id, 24);
      const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
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
      await executeOperation(t.pool, kindsFor(stripe), id, fence);
      await ageFirstAttempt(id, 22.9);
      const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
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
      const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
      expect(run.operation.status).toBe('failed');
      expect(creates(stripe)).toHaveLength(0);
    });

    it('reconcile finds nothing (search lag) → stays unknown, flagged for review, not failed', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      stripe.loseResponseOnce = true;
      await executeOperation(t.pool, kindsFor(stripe), id, fence);
      stripe.pruneKeys();
      stripe.searchIndexed = false;
      await ageFirstAttempt(id, 30);
      const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
      expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true });
      expect(run.operation.review_reason).toMatch(/no charge/);
      expect(creates(stripe)).toHaveLength(1);
      // Once the index catches up, the next pass settles it and clears the review.
      stripe.searchIndexed = true;
      const later = await executeOperation(t.pool, kindsFor(stripe), id, fence);
      expect(later.operation).toMatchObject({ status: 'succeeded', needs_review: false });
    });

    it('reconcile finds two charges → review, never picks one', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() - interval '25 hours' where id = $1`, [id]);
      stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: id });
      stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: id });
      const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
      expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true, external_id: null });
      expect(run.operation.review_reason).toMatch(/2 charges/);
    });

    it("two charges found stay for a person when a webhook then settles the operation by one of them: it answers neither charge", async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() - interval '25 hours' where id = $1`, [id]);
      const first = stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: id });
      stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: id });
      const held = (await executeOperation(t.pool, kindsFor(stripe), id, fence)).operation.review_reason;
      expect(held).toMatch(/2 charges/);
      // The sweep searches it again on each run: the same finding is not listed twice.
      expect((await executeOperation(t.pool, kindsFor(stripe), id, await claim(t, id))).operation.review_reason).toBe(held);
      const event = { id: `evt_${id}`, type: 'payment_intent.succeeded', data: { object: { id: first.id } } } as unknown as Stripe.Event;
      expect(await receiveStripeEvent({ pool: t.pool, gateway: stripe, log: createLogger('silent') }, event)).toBe('settled');
      expect(await operation(t, id)).toMatchObject({ status: 'succeeded', external_id: first.id, needs_review: true, review_reason: held });
    });

    it('a match with another amount is not accepted as this operation’s charge', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const fence = await claim(t, id);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() - interval '25 hours' where id = $1`, [id]);
      stripe.addCharge({ status: 'succeeded', amount: 1, currency: 'eur', operationId: id });
      const run = await executeOperation(t.pool, kindsFor(stripe), id, fence);
      expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true });
    });

    it('created 3 days ago but never sent → sent normally (the window starts at the first send)', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      await t.pool.query(`update outboxd.payment_operations set created_at = now() - interval '3 days' where id = $1`, [id]);
      const run = await executeOperation(t.pool, kindsFor(stripe), id, await claim(t, id));
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
      await expect(executeOperation(t.pool, kindsFor(stripe), id, stale)).rejects.toBeInstanceOf(StaleFenceError);
      expect(stripe.calls).toHaveLength(0);
      expect(await operation(t, id)).toEqual(before);
    });

    it('a claim taken over during the call: the outcome of the stale call is rejected', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const stale = await claim(t, id, 'worker-a');
      let release!: () => void;
      stripe.hold = new Promise((r) => (release = r));
      const running = executeOperation(t.pool, kindsFor(stripe), id, stale);
      await waitUntil(() => stripe.calls.length === 1, 5_000, 'the gateway call');
      await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [id]);
      await claim(t, id, 'worker-b');
      release();
      const err = await running.catch((e: unknown) => e);
      expect(err).toBeInstanceOf(StaleFenceError);
      expect((await operation(t, id)).status).toBe('pending');
    });
  });

  describe("the dispatcher's claim: lease, the policy's call and its attempt in one statement", () => {
    it('stamps a create before the call; a 429 puts the stamps back, so the window starts at a send that may have executed (invariant 7)', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      stripe.rateLimitNext = 1;
      const { lease } = await claimWithAttempt(id);
      expect(lease!.begun).toMatchObject({ call: 'create', attempt: { attempts: 1, prev_first_attempted_at: null } });
      expect(await operation(t, id)).toMatchObject({ attempts: 1, first_attempted_at: expect.any(Date), lease_owner: 'worker-a', fence: 1 });
      const limited = await executeOperation(t.pool, kindsFor(stripe), id, lease!.fence, { claimed: lease!.operation, begun: lease!.begun });
      expect(limited.operation).toMatchObject({ status: 'pending', last_outcome: 'rate_limited', first_attempted_at: null, last_attempted_at: null, lease_owner: null });

      const again = await claimWithAttempt(id, 'worker-b');
      const sent = again.lease!.operation.first_attempted_at;
      expect(sent).toBeInstanceOf(Date);
      const run = await executeOperation(t.pool, kindsFor(stripe), id, again.lease!.fence, { claimed: again.lease!.operation, begun: again.lease!.begun });
      expect(run.operation).toMatchObject({ status: 'succeeded', first_attempted_at: sent });
      expect(creates(stripe).map((c) => c.key)).toEqual([idempotencyKeyFor(id), idempotencyKeyFor(id)]);
    });

    it('a known charge is retrieved, never created, and its stamps stay (invariant 6)', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t, { paymentMethod: 'pm_card_processing' });
      expect((await runClaimed(stripe, id)).operation).toMatchObject({ status: 'unknown', external_id: stripe.charges[0]!.id });
      const before = await operation(t, id);
      stripe.settle(stripe.charges[0]!.id, 'succeeded');
      const { lease } = await claimWithAttempt(id, 'worker-b');
      expect(lease!.begun?.call).toBe('retrieve');
      expect(await operation(t, id)).toMatchObject({ attempts: 2, first_attempted_at: before.first_attempted_at, last_attempted_at: before.last_attempted_at });
      const run = await executeOperation(t.pool, kindsFor(stripe), id, lease!.fence, { claimed: lease!.operation, begun: lease!.begun });
      expect(run).toMatchObject({ call: 'retrieve', operation: { status: 'succeeded' } });
      expect(creates(stripe)).toHaveLength(1);
    });

    it('inside the key window it resends with the same key from the first stamp; past it, search and never create (invariant 7)', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      stripe.loseResponseOnce = true;
      expect((await runClaimed(stripe, id)).operation.status).toBe('unknown');
      await ageFirstAttempt(id, 22.9);
      const first = (await operation(t, id)).first_attempted_at;
      const inside = await claimWithAttempt(id, 'worker-b');
      expect(inside.lease!.begun?.call).toBe('create');
      expect(inside.lease!.operation.first_attempted_at).toEqual(first);
      await t.pool.query(t.pool.sql.releaseLease(id, inside.lease!.fence));

      stripe.pruneKeys();
      await ageFirstAttempt(id, 24);
      const past = await claimWithAttempt(id, 'worker-c');
      expect(past.lease!.begun?.call).toBe('search');
      const run = await executeOperation(t.pool, kindsFor(stripe), id, past.lease!.fence, { claimed: past.lease!.operation, begun: past.lease!.begun });
      expect(run.operation).toMatchObject({ status: 'succeeded', external_id: stripe.charges[0]!.id });
      expect(creates(stripe)).toHaveLength(1);
    });

    it('kill -9 between the claim and the call: once the lease expires, the next claim sends with the same key, the window kept from the first stamp', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const died = await claimWithAttempt(id, 'worker-a'); // and never called
      const stamp = died.lease!.operation.first_attempted_at;
      expect((await claimWithAttempt(id, 'worker-b')).lease).toBeUndefined(); // its lease still holds
      await expireLease(id);
      const next = await claimWithAttempt(id, 'worker-b');
      expect(next.lease).toMatchObject({ previousOwner: 'worker-a', fence: 2, begun: { call: 'create' }, operation: { attempts: 2, first_attempted_at: stamp } });
      const run = await executeOperation(t.pool, kindsFor(stripe), id, next.lease!.fence, { claimed: next.lease!.operation, begun: next.lease!.begun });
      expect(run.operation.status).toBe('succeeded');
      expect(stripe.charges).toHaveLength(1);
      expect(creates(stripe).map((c) => c.key)).toEqual([idempotencyKeyFor(id)]);
    });

    it('settled or leased: nothing claimed or counted, and the claim says what the row holds', async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const { lease } = await claimWithAttempt(id, 'worker-a');
      expect(await claimWithAttempt(id, 'worker-b')).toEqual({ current: { status: 'pending', lease_owner: 'worker-a', locked: false } });
      await executeOperation(t.pool, kindsFor(stripe), id, lease!.fence, { claimed: lease!.operation, begun: lease!.begun });
      expect(await claimWithAttempt(id, 'worker-c')).toEqual({ current: { status: 'succeeded', lease_owner: null, locked: false } });
      expect(await operation(t, id)).toMatchObject({ status: 'succeeded', attempts: 1, fence: 1 });
      expect(await claimWithAttempt(randomUUID())).toEqual({ current: undefined });
      expect(stripe.calls).toHaveLength(1);
    });

    it('a row another transaction holds is skipped, not waited for: nothing claimed, and the claim says so', async () => {
      const id = await confirm(t);
      const holder = await t.pool.connect();
      try {
        await holder.query('begin');
        await holder.query(`select id from "${t.schema}".payment_operations where id = $1 for update`, [id]);
        expect(await claimWithAttempt(id, 'worker-a')).toEqual({ current: { status: 'pending', lease_owner: null, locked: true } });
      } finally {
        await holder.query('rollback');
        holder.release();
      }
      expect(await operation(t, id)).toMatchObject({ fence: 0, attempts: 0 });
      expect((await claimWithAttempt(id, 'worker-a')).lease).toMatchObject({ fence: 1 });
    });

    it('claims made together share one statement, each its own; an operation asked twice in it is claimed once', async () => {
      const [a, b, c] = await Promise.all([confirm(t), confirm(t), confirm(t)]);
      const run = counting(t.pool);
      const claimOn = (id: string) => claimAttempt(run.pool, id, 'worker-a', 60_000, KEY_WINDOW_SECONDS, 'charge', 'idempotent-key', callTable('idempotent-key'));
      // Asked in one turn of the event loop: one statement.
      const [forC, forA, again, forB] = await Promise.all([claimOn(c), claimOn(a), claimOn(a), claimOn(b)]);
      expect(run.statements()).toBe(1);
      for (const claimed of [forC, forA, forB]) expect(claimed.lease).toMatchObject({ fence: 1, begun: { call: 'create', attempt: { attempts: 1 } } });
      expect(again).toEqual({ current: { status: 'pending', lease_owner: 'worker-a', locked: false } });
      expect(await operation(t, a)).toMatchObject({ fence: 1, attempts: 1 });
      // A claim that takes over no lease writes no timeline row: the call is recorded with its outcome.
      const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.operation_events where operation_id = $1`, [a]);
      expect(rows).toEqual([{ n: 0 }]);
    });

    it('outcomes recorded together share one statement, each fenced by its own claim (invariant 8)', async () => {
      const [a, b, c] = await Promise.all([confirm(t), confirm(t), confirm(t)]);
      const leases = new Map<string, Lease & { begun: BegunAttempt | undefined }>();
      for (const id of [a, b, c]) leases.set(id, (await claimWithAttempt(id)).lease!);
      await expireLease(a);
      await claimWithAttempt(a, 'worker-b'); // a's first claim is stale now
      const run = counting(t.pool);
      const record = (id: string) => {
        const lease = leases.get(id)!;
        const outcome = { kind: 'succeeded', externalId: `pi_${id.replaceAll('-', '')}` } as const;
        return recordOutcome(run.pool, lease.operation, lease.fence, outcome, 'dispatcher', { call: 'create', attempt: lease.begun!.attempt, durationMs: 1 });
      };
      // Recorded in one turn of the event loop: one statement, a stale outcome among live ones.
      const [forC, forA, forB] = await Promise.allSettled([record(c), record(a), record(b)]);
      expect(run.statements()).toBe(1);
      expect(forA).toMatchObject({ status: 'rejected', reason: { name: 'StaleFenceError', fence: 1, currentFence: 2, currentStatus: 'pending' } });
      for (const recorded of [forB, forC]) expect(recorded).toMatchObject({ status: 'fulfilled', value: { status: 'succeeded', lease_owner: null } });
      expect(await operation(t, a)).toMatchObject({ status: 'pending', fence: 2, lease_owner: 'worker-b', settled_at: null });
      const events = async (type: string) => (await t.pool.query(`select operation_id from outboxd.operation_events where type = $1 and operation_id = any($2)`, [type, [a, b, c]])).rows.map((r) => r.operation_id).sort();
      expect(await events('outcome')).toEqual([b, c].sort());
      const { rows } = await t.pool.query(`select operation_id from outboxd.settlement_outbox where operation_id = any($1)`, [[a, b, c]]);
      expect(rows.map((r) => r.operation_id).sort()).toEqual([b, c].sort());
    });

    it("an operation of another kind than the claim's table is claimed without an attempt: the executor chooses by its own kind", async () => {
      const stripe = new FakeStripe();
      const id = await confirm(t);
      const { lease } = await claimWithAttempt(id, 'worker-a', 'refund');
      expect(lease!.begun).toBeUndefined();
      expect(await operation(t, id)).toMatchObject({ attempts: 0, first_attempted_at: null });
      const run = await executeOperation(t.pool, kindsFor(stripe), id, lease!.fence, { claimed: lease!.operation, begun: lease!.begun });
      expect(run).toMatchObject({ call: 'create', operation: { status: 'succeeded', attempts: 1 } });
    });

    it('an operation requested under another policy than the claim\'s is claimed without an attempt, never counted under it', async () => {
      const id = await confirm(t);
      const { lease } = await claimAttempt(t.pool, id, 'worker-a', 60_000, KEY_WINDOW_SECONDS, 'charge', 'at-least-once', callTable('at-least-once'));
      expect(lease!.begun).toBeUndefined();
      expect(await operation(t, id)).toMatchObject({ attempts: 0, first_attempted_at: null, possible_duplicates: 0, lease_owner: 'worker-a' });
    });
  });

  it('no transaction is open while the gateway is called (invariant 3)', async () => {
    const stripe = new FakeStripe();
    const id = await confirm(t);
    let release!: () => void;
    stripe.hold = new Promise((r) => (release = r));
    const pool = (await import('../../src/db/pool.ts')).createPool(t.url, { schema: t.schema, max: 2, applicationName: 'executor-under-test' });
    try {
      const running = executeOperation(pool, kindsFor(stripe), id, await claim(t, id));
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
