// The seed's table again, over HTTP: executeOperation → StripeGateway → the real stripe SDK → the emulator.
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { createServer } from 'node:net';
import { AmbiguousOutcome, idempotencyKeyFor, NotExecuted, Rejected, RetryLater } from '../../src/stripe/gateway.ts';
import { StaleFenceError } from '../../src/engine/operation.ts';
import { StripeGateway } from '../../src/stripe/sdkGateway.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { claim, confirm, operation } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

let t: TestDb;
let e: RunningEmulator;
let gateway: StripeGateway;
/** Gives up on an answer after a second: for the faults that hang or trickle. Every other call has 5 s,
 * so that a loaded machine's stall is not taken for a lost answer. */
let impatient: StripeGateway;
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  gateway = e.gateway({ timeoutMs: 5_000 });
  impatient = e.gateway({ timeoutMs: 1_000 });
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.reset());

const charges = (op: string) => e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === op);
const creates = (op: string) => e.emulator.requests().filter((r) => r.endpoint === 'create' && r.operationId === op);
const passKeyWindow = (op: string) =>
  t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - interval '23 hours 1 minute' where id = $1`, [op]);

describe('executeOperation over HTTP with the real SDK', () => {
  it('charges once; every create for the operation carries payment-op:<id> and nothing else', async () => {
    const op = await confirm(t);
    const run = await executeOperation(t.pool, kindsFor(gateway), op, await claim(t, op));
    expect(run.operation).toMatchObject({ status: 'succeeded', external_id: charges(op)[0]!.paymentIntent.id });
    expect(creates(op).map((r) => r.idempotencyKey)).toEqual([idempotencyKeyFor(op)]);
  });

  // trickle_*: an answer that never goes idle for the SDK's timeout (a socket idle timeout) ends at it all
  // the same (src/stripe/boundedHttpClient.ts): without that bound the call, its slot and its lease are
  // held for as long as the trickle lasts.
  it.each(['reset', 'truncate', 'hang', 'trickle_headers', 'trickle_body'] as const)(
    'response lost (%s) → unknown; the retry with the same key replays the charge: succeeded, one charge',
    async (mode) => {
      const op = await confirm(t);
      const fence = await claim(t, op);
      // a reset is resent once by the SDK itself, so that answer must be lost too
      const count = mode === 'reset' ? 2 : 1;
      e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode }, count });
      const first = await executeOperation(t.pool, kindsFor(impatient), op, fence);
      expect(first.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous' });
      const second = await executeOperation(t.pool, kindsFor(gateway), op, fence);
      expect(second.operation.status).toBe('succeeded');
      expect(charges(op)).toHaveLength(1);
      expect(new Set(creates(op).map((r) => r.idempotencyKey))).toEqual(new Set([idempotencyKeyFor(op)]));
    },
  );

  it('500 after commit is replayed: unknown inside the window; past it (keys pruned) reconciled by search, no create', async () => {
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_after_commit', status: 500 } });
    for (let i = 0; i < 3; i++) {
      const run = await executeOperation(t.pool, kindsFor(gateway), op, fence);
      expect(run.operation.status).toBe('unknown');
    }
    expect(creates(op).map((r) => r.replayed)).toEqual([false, true, true]);
    e.emulator.advanceClock(24 * 3600_000);
    e.emulator.pruneKeys();
    await passKeyWindow(op);
    const reconciled = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(reconciled.call).toBe('search');
    expect(reconciled.operation).toMatchObject({ status: 'succeeded', external_id: charges(op)[0]!.paymentIntent.id });
    expect(creates(op)).toHaveLength(3);
    expect(charges(op)).toHaveLength(1);
  });

  it('424 (a dependency outside Stripe failed) after the charge was made → unknown, never failed', async () => {
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_after_commit', status: 424 } });
    const run = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(run.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous' });
    expect(charges(op)).toHaveLength(1);
  });

  it('409 while the same key executes (a takeover mid-call) → unknown; the stale writer is fenced; one charge', async () => {
    const op = await confirm(t);
    const staleFence = await claim(t, op, 'replica-a');
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 5_000 } });
    const slow = executeOperation(t.pool, kindsFor(e.gateway({ timeoutMs: 10_000 })), op, staleFence);
    await waitUntil(() => e.emulator.requests().some((r) => r.operationId === op), 10_000, 'the first create');
    await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
    const fence = await claim(t, op, 'replica-b');
    const during = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(during.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous' });
    expect(during.operation.last_error).toMatch(/409.*idempotency_key_in_use/);
    await expect(slow).rejects.toBeInstanceOf(StaleFenceError);
    const after = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(after.operation.status).toBe('succeeded');
    expect(charges(op)).toHaveLength(1);
  });

  it('429 → status unchanged; retried later with the same key', async () => {
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'rate_limit' } });
    expect((await executeOperation(t.pool, kindsFor(gateway), op, fence)).operation).toMatchObject({ status: 'pending', last_outcome: 'rate_limited' });
    expect((await executeOperation(t.pool, kindsFor(gateway), op, fence)).operation.status).toBe('succeeded');
    expect(creates(op).map((r) => [r.idempotencyKey, r.status])).toEqual([
      [idempotencyKeyFor(op), 429],
      [idempotencyKeyFor(op), 200],
    ]);
  });

  it('a day of 429s, then success: the 429s never started the key window, so it is sent normally', async () => {
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'rate_limit' }, count: 3 });
    for (let i = 0; i < 3; i++) {
      const run = await executeOperation(t.pool, kindsFor(gateway), op, fence);
      expect(run.operation).toMatchObject({ status: 'pending', last_outcome: 'rate_limited', first_attempted_at: null, last_attempted_at: null });
    }
    // A day passes: any window the 429s had opened would now be closed.
    await t.pool.query(`update outboxd.payment_operations set first_attempted_at = first_attempted_at - interval '1 day' where id = $1`, [op]);
    const run = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(run).toMatchObject({ call: 'create', operation: { status: 'succeeded' } });
    expect(charges(op)).toHaveLength(1);
  });

  it('401 and a refused connection do not start the key window either', async () => {
    const op = await confirm(t);
    const fence = await claim(t, op);
    const badKey = new StripeGateway({ secretKey: 'sk_live_wrong', apiBase: e.url, timeoutMs: 1_000 });
    expect((await executeOperation(t.pool, kindsFor(badKey), op, fence)).operation).toMatchObject({ status: 'pending', last_outcome: 'not_executed', first_attempted_at: null });
    const nowhere = new StripeGateway({ secretKey: 'sk_test_x', apiBase: 'http://127.0.0.1:1', timeoutMs: 500 });
    expect((await executeOperation(t.pool, kindsFor(nowhere), op, fence)).operation).toMatchObject({ status: 'pending', last_outcome: 'not_executed', first_attempted_at: null });
  });

  it('a 429 after an attempt that may have executed keeps the window from that attempt: past it, search, never create', async () => {
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_after_commit', status: 500 } });
    const first = (await executeOperation(t.pool, kindsFor(gateway), op, fence)).operation;
    expect(first).toMatchObject({ status: 'unknown', first_attempted_at: expect.any(Date) });
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'rate_limit' } });
    const limited = (await executeOperation(t.pool, kindsFor(gateway), op, fence)).operation;
    expect(limited).toMatchObject({ status: 'unknown', last_outcome: 'rate_limited' });
    expect(limited.first_attempted_at).toEqual(first.first_attempted_at);
    expect(limited.last_attempted_at).toEqual(first.last_attempted_at);
    await passKeyWindow(op);
    e.emulator.pruneKeys();
    const after = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(after).toMatchObject({ call: 'search', operation: { status: 'succeeded' } });
    expect(charges(op)).toHaveLength(1);
  });

  it('decline (402) → failed with the PaymentIntent id, never called again', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_chargeDeclinedInsufficientFunds' });
    const fence = await claim(t, op);
    const run = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(run.operation).toMatchObject({ status: 'failed', external_id: charges(op)[0]!.paymentIntent.id });
    expect(run.operation.last_error).toMatch(/card_declined/);
    await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(e.emulator.requests()).toHaveLength(1);
  });

  it('processing → unknown; settled later, found by retrieve', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    const fence = await claim(t, op);
    expect((await executeOperation(t.pool, kindsFor(gateway), op, fence)).operation.status).toBe('unknown');
    e.emulator.settle(charges(op)[0]!.paymentIntent.id, 'succeeded');
    const run = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(run.call).toBe('retrieve');
    expect(run.operation.status).toBe('succeeded');
  });

  it('search lag: reconciled right after the charge, an empty search does not settle it (review, not failed)', async () => {
    e.emulator.configureSearch({ lagMs: 60_000 });
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    await executeOperation(t.pool, kindsFor(gateway), op, fence);
    await passKeyWindow(op);
    const early = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(early.operation).toMatchObject({ status: 'unknown', needs_review: true });
    e.emulator.advanceClock(60_000);
    const late = await executeOperation(t.pool, kindsFor(gateway), op, fence);
    expect(late.operation).toMatchObject({ status: 'succeeded', needs_review: false });
    expect(charges(op)).toHaveLength(1);
  });

  it('whatever the SDK retry settings, every attempt carries our key', async () => {
    const op = await confirm(t);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_before_commit', status: 503 }, count: 2 });
    const run = await executeOperation(t.pool, kindsFor(e.gateway({ maxNetworkRetries: 3 })), op, await claim(t, op));
    expect(run.operation.status).toBe('succeeded');
    expect(creates(op).map((r) => r.idempotencyKey)).toEqual(Array(3).fill(idempotencyKeyFor(op)));
  });

  it('a key reused with other parameters (400 idempotency_error) is held for review', async () => {
    const op = await confirm(t);
    await e.client().paymentIntents.create(
      { amount: 1, currency: 'eur', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } },
      { idempotencyKey: idempotencyKeyFor(op) },
    );
    const run = await executeOperation(t.pool, kindsFor(gateway), op, await claim(t, op));
    expect(run.operation).toMatchObject({ status: 'unknown', needs_review: true });
    expect(run.operation.review_reason).toMatch(/idempotency key misuse/);
  });
});

describe('classification of what the SDK raises', () => {
  it('401 (bad key) → NotExecuted; 429 → RetryLater', async () => {
    const bad = new StripeGateway({ secretKey: 'sk_live_wrong', apiBase: e.url, timeoutMs: 1_000 });
    expect(await bad.retrieveCharge('pi_123').catch((x) => x)).toBeInstanceOf(NotExecuted);
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, endpoint: 'retrieve' });
    expect(await gateway.retrieveCharge('pi_123').catch((x) => x)).toBeInstanceOf(RetryLater);
  });
  it('404 → Rejected; 5xx → AmbiguousOutcome; a connection refused on the only attempt → NotExecuted', async () => {
    expect(await gateway.retrieveCharge('pi_missing').catch((x) => x)).toBeInstanceOf(Rejected);
    e.emulator.addFault({ fault: { kind: 'error_before_commit', status: 502 }, endpoint: 'retrieve' });
    expect(await gateway.retrieveCharge('pi_missing').catch((x) => x)).toBeInstanceOf(AmbiguousOutcome);
    const nowhere = new StripeGateway({ secretKey: 'sk_test_x', apiBase: 'http://127.0.0.1:1', timeoutMs: 500 });
    expect(await nowhere.retrieveCharge('pi_1').catch((x) => x)).toBeInstanceOf(NotExecuted);
  });
  describe('a create the SDK resent after a reset is never "not executed" (the first send may have executed)', () => {
    /** Resets the first request's connection (after reading it, as if Stripe had acted), then answers
     * the SDK's automatic resend with `second`. */
    async function resetThen(second: 'refuse' | 429 | 401) {
      const server = createServer((socket) => {
        socket.once('data', () => {
          if (second === 'refuse') server.close();
          socket.resetAndDestroy();
          if (second === 'refuse') return;
          server.removeAllListeners('connection');
          server.on('connection', (s) =>
            s.once('data', () => {
              const body = JSON.stringify({ error: { type: second === 429 ? 'rate_limit_error' : 'invalid_request_error', message: 'no' } });
              s.end(`HTTP/1.1 ${second} X\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`);
            }),
          );
        });
      });
      await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
      const port = (server.address() as { port: number }).port;
      const flaky = new StripeGateway({ secretKey: 'sk_test_x', apiBase: `http://127.0.0.1:${port}`, timeoutMs: 1_000 });
      try {
        return await flaky
          .createCharge({ operationId: 'op', amount: 100, currency: 'eur', customer: 'c', paymentMethod: 'pm_card_visa', metadata: {}, idempotencyKey: 'payment-op:op' })
          .catch((x) => x);
      } finally {
        server.close();
      }
    }
    it('reset, then the resend refused → AmbiguousOutcome', async () => {
      expect(await resetThen('refuse')).toBeInstanceOf(AmbiguousOutcome);
    });
    it('reset, then the resend answered 429 → AmbiguousOutcome', async () => {
      const err = await resetThen(429);
      expect(err).toBeInstanceOf(AmbiguousOutcome);
      expect(err.message).toMatch(/sent 2 times/);
    });
    it('reset, then the resend answered 401 → AmbiguousOutcome', async () => {
      expect(await resetThen(401)).toBeInstanceOf(AmbiguousOutcome);
    });
  });
  it('findCharges follows next_page across more than 100 results', async () => {
    const op = await confirm(t);
    const stripe = e.client();
    for (let i = 0; i < 205; i++) {
      await stripe.paymentIntents.create({ amount: 10, currency: 'eur', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } });
    }
    expect(await gateway.findCharges(op)).toHaveLength(205);
    expect(e.emulator.requests().filter((r) => r.endpoint === 'search')).toHaveLength(3);
    expect((await operation(t, op)).status).toBe('pending');
  });
});
