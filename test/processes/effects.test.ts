// Effects the application defines (issue 13), each with its declared policy on an ambiguous outcome:
// a receipt (at-least-once: executed again, the duplicate counted) and a stock reservation
// (reconcile-before-retry: checked before anything runs again, a person when the check cannot tell).
import { spawn } from 'node:child_process';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { EffectFailed, type CheckResult, type EffectContext, type EffectDefinition } from '../../src/kinds/application/definition.ts';
import { EffectConflictError } from '../../src/kinds/application/request.ts';
import { resolveOperation, type Resolution } from '../../src/admin/resolve.ts';
import { requeueOperation } from '../../src/admin/requeue.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { Outboxd, ValidationError, type SettlementEvent } from '../../src/index.ts';
import { createTestDatabase, inAppTransaction, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { acquireLease } from '../../src/engine/operation.ts';
import { claim, confirm, operation, relay } from '../support/fixtures.ts';
import { startReplica, waitUntil } from '../../harness/replica.ts';
import { createKindQueues } from '../../src/outbox/outbox.ts';

// startWorker reads the worker's settings from the environment, as `outboxd worker` does.
process.env.LOG_LEVEL = 'silent';

let t: TestDb;
let appPool: pg.Pool;
const apps: Outboxd[] = [];
const log = createLogger('silent');
beforeAll(async () => {
  t = await createTestDatabase();
  appPool = new pg.Pool({ connectionString: t.url, max: 4 });
});
afterAll(async () => {
  for (const o of apps) await o.stop();
  await appPool.end();
  await t.close();
});

const inTx = <T>(fn: (client: pg.PoolClient) => Promise<T>, commit = true) => inAppTransaction(appPool, fn, commit);

/** A receipt e-mail: at least once. `failAfterSending`: the first sends of each operation whose answer is
 * lost (they were sent). */
function receipts(failAfterSending = 0) {
  const sent: { operationId: string; attempt: number }[] = [];
  const def: EffectDefinition = {
    policy: 'at-least-once',
    async execute({ operationId, payload, attempt }) {
      sent.push({ operationId, attempt });
      const sends = sent.filter((s) => s.operationId === operationId).length;
      if (sends <= failAfterSending) throw new Error('socket hang up');
      return { messageId: `msg-${sends}`, to: (payload as { email: string }).email };
    },
  };
  return { sent, def };
}

/** A stock reservation in another system, keyed by the operation: checked before any re-run. */
function reservations(opts: { loseAnswer?: number; failBeforeReserving?: number; checkSays?: CheckResult } = {}) {
  const held = new Map<string, { sku: string; reservation: string }>();
  const calls = { execute: 0, check: 0 };
  let lose = opts.loseAnswer ?? 0;
  let before = opts.failBeforeReserving ?? 0;
  const def: EffectDefinition = {
    policy: 'reconcile-before-retry',
    async execute({ operationId, payload }) {
      calls.execute++;
      if (before-- > 0) throw new Error('connection refused by the stock service');
      const r = { sku: (payload as { sku: string }).sku, reservation: `res-${operationId}` };
      held.set(operationId, r);
      if (lose-- > 0) throw new Error('timeout waiting for the stock service');
      return r;
    },
    async check({ operationId }) {
      calls.check++;
      if (opts.checkSays) return opts.checkSays;
      const r = held.get(operationId);
      return r ? { status: 'done', result: r } : { status: 'not_done' };
    },
  };
  return { held, calls, def };
}

/** A service that answers only once told to: `returned` resolves when `finish` is called. */
function answerWhenTold(): { returned: Promise<void>; finish: () => void } {
  let finish!: () => void;
  const returned = new Promise<void>((resolve) => (finish = resolve));
  return { returned, finish };
}

let n = 0;
/** Requests an effect through the library in the application's transaction, as it would. */
async function request(o: Outboxd, kind: string, payload: unknown, key = `key-${++n}`): Promise<string> {
  return (await inTx((client) => o.requestEffect(client, kind, { key, payload }))).operationId;
}
/** An Outboxd that defines these kinds (an application process does so before requesting). */
function app(defs: Record<string, EffectDefinition>): Outboxd {
  const o = new Outboxd({ connectionString: t.url });
  apps.push(o);
  for (const [kind, def] of Object.entries(defs)) o.defineEffect(kind, def);
  return o;
}
const execute = async (op: string, defs: Record<string, EffectDefinition>, fence?: number) =>
  executeOperation(t.pool, kindsFor(new FakeStripe(), new Map(Object.entries(defs))), op, fence ?? (await claim(t, op)), { log });

describe('defining an effect: its policy is declared, and checked', () => {
  const execute = async () => null;
  it.each([
    ['a kind that is not an identifier', 'Receipt', { policy: 'at-least-once', execute }, /lower-case identifier/],
    ['a built-in kind', 'refund', { policy: 'at-least-once', execute }, /reserved/],
    ['a built-in kind since authorizations', 'capture', { policy: 'at-least-once', execute }, /reserved/],
    ['a queue of outboxd’s', 'settled', { policy: 'at-least-once', execute }, /reserved/],
    ['the reconcile sweep’s queue', 'reconcile', { policy: 'at-least-once', execute }, /reserved/],
    ['the retention job’s queue', 'prune', { policy: 'at-least-once', execute }, /reserved/],
    ['a dead letter’s name', 'receipt_dead', { policy: 'at-least-once', execute }, /reserved/],
    ['Stripe’s policy', 'receipt', { policy: 'idempotent-key', execute }, /at-least-once or reconcile-before-retry/],
    ['no policy', 'receipt', { execute }, /policy must be/],
    ['no execute', 'receipt', { policy: 'at-least-once' }, /execute must be a function/],
    ['reconcile-before-retry without check', 'reservation', { policy: 'reconcile-before-retry', execute }, /needs check/],
    ['at-least-once with a check it would never use', 'receipt', { policy: 'at-least-once', execute, check: async () => ({ status: 'done' }) }, /never checks/],
    ...[0, -1, 1.5, '100', 600_001].map((timeoutMs) => [`timeoutMs ${JSON.stringify(timeoutMs)}`, 'receipt', { policy: 'at-least-once', execute, timeoutMs }, /timeoutMs must be an integer of milliseconds from 1 to 600000/]),
  ] as [string, string, object, RegExp][])('refuses %s', (_name, kind, def, message) => {
    expect(() => new Outboxd({ connectionString: t.url }).defineEffect(kind, def as EffectDefinition)).toThrow(message);
  });

  it('refuses a kind already defined differently; the same definition again is accepted', () => {
    const o = new Outboxd({ connectionString: t.url });
    const def: EffectDefinition = { policy: 'at-least-once', execute };
    o.defineEffect('receipt', def);
    o.defineEffect('receipt', def);
    o.defineEffect('receipt', { policy: 'at-least-once', execute }); // a setup run twice, a literal each time
    expect(() => o.defineEffect('receipt', { policy: 'at-least-once', execute: async () => 'other' })).toThrow(/receipt is already defined here, differently/);
    expect(() => o.defineEffect('receipt', { policy: 'at-least-once', execute, timeoutMs: 5 })).toThrow(/receipt is already defined here, differently/);
  });
});

describe('requestEffect: in the caller’s transaction, unique per kind and key', () => {
  let o: Outboxd;
  beforeAll(() => {
    o = app({ receipt: receipts().def });
  });

  it('an operation of the kind, with its policy, key and payload, and its outbox row; no order, no amount', async () => {
    const op = await request(o, 'receipt', { email: 'a@example.com' }, 'order-1:receipt');
    expect(await operation(t, op)).toMatchObject({
      kind: 'receipt', policy: 'at-least-once', effect_key: 'order-1:receipt', payload: { email: 'a@example.com' },
      status: 'pending', order_id: null, amount: null, currency: null, possible_duplicates: 0,
    });
    const { rows } = await t.pool.query(`select kind from outboxd.charge_outbox where operation_id = $1`, [op]);
    expect(rows).toEqual([{ kind: 'receipt' }]);
    expect(await o.getOperation(op)).toMatchObject({ kind: 'receipt', policy: 'at-least-once', key: 'order-1:receipt', payload: { email: 'a@example.com' }, orderId: null });
  });

  it('a kind whose queue was deleted after the relay saw it (a kind retired while rows waited) is relayed again, its queue made anew, and holds up no other row', async () => {
    const retired = app({ retired_note: receipts().def });
    await request(retired, 'retired_note', {});
    await relay(t); // its queues made, and known to this process's relay
    await t.boss.deleteQueue('retired_note');
    const late = await request(retired, 'retired_note', {});
    const charge = await confirm(t);
    await expect(relay(t)).rejects.toThrow(/retired_note/); // the batch with its row fails once
    expect(await relay(t)).toBe(2); // then both rows go, its queue made again
    const queued = async (queue: string, op: string) => (await t.pool.query(`select 1 from pgboss.job where name = $1 and data->>'operationId' = $2`, [queue, op])).rows.length;
    expect([await queued('retired_note', late), await queued('charge', charge)]).toEqual([1, 1]);
  });

  it('the same key again is the same operation; with another payload it is refused', async () => {
    const first = await inTx((c) => o.requestEffect(c, 'receipt', { key: 'dup', payload: { email: 'b@example.com', n: [1, 2] } }));
    // key order does not matter: the payloads are the same JSON
    expect(await inTx((c) => o.requestEffect(c, 'receipt', { key: 'dup', payload: { n: [1, 2], email: 'b@example.com' } }))).toEqual({ operationId: first.operationId, created: false });
    const err = await inTx((c) => o.requestEffect(c, 'receipt', { key: 'dup', payload: { email: 'c@example.com' } })).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(EffectConflictError);
    expect(err).toMatchObject({ kind: 'receipt', key: 'dup', operationId: first.operationId });
  });

  it('refused before anything is written: an undefined kind, a bad key, a payload that is not JSON; rolled back with the caller', async () => {
    const count = async () => (await t.pool.query(`select count(*)::int as n from outboxd.payment_operations`)).rows[0].n;
    const before = await count();
    const cases: [string, { key: unknown; payload?: unknown }, string][] = [
      ['unknown_kind', { key: 'k' }, 'kind'],
      ['receipt', { key: '' }, 'key'],
      ['receipt', { key: 'k'.repeat(256) }, 'key'],
      ['receipt', { key: 'k', payload: { n: 10n } }, 'payload'],
      ['receipt', { key: 'k', payload: 'x'.repeat(70_000) }, 'payload'],
    ];
    for (const [kind, req, field] of cases) {
      const err = await inTx((c) => o.requestEffect(c, kind, req as never)).catch((e: unknown) => e);
      expect(err, `${kind} ${field}`).toBeInstanceOf(ValidationError);
      expect((err as ValidationError).field).toBe(field);
    }
    const rolledBack = await inTx((c) => o.requestEffect(c, 'receipt', { key: 'rolled-back', payload: {} }), false);
    expect(await o.getOperation(rolledBack.operationId)).toBeUndefined();
    expect(await count()).toBe(before);
  });
});

describe('at-least-once: a receipt whose answer is lost', () => {
  it('runs again, and the duplicate is counted (column, metric) and settled with the result', async () => {
    const { sent, def } = receipts(1);
    const o = app({ lost_receipt: def });
    const events: SettlementEvent[] = [];
    await o.onSettled((event) => void events.push(event));
    const op = await request(o, 'lost_receipt', { email: 'd@example.com' }, 'order-2:receipt');
    const replica = await startDispatcher(t, new FakeStripe(), 'receipt-worker', { effects: new Map([['lost_receipt', def]]) });
    try {
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 30_000, 'settled');
      expect(sent.map((s) => [s.operationId, s.attempt])).toEqual([[op, 1], [op, 2]]); // sent twice: the customer may get two receipts
      expect(await operation(t, op)).toMatchObject({ possible_duplicates: 1, attempts: 2, result: { messageId: 'msg-2', to: 'd@example.com' }, last_outcome: 'succeeded' });
      const duplicates = (await replica.metrics.possibleDuplicates.get()).values;
      expect(duplicates).toEqual([expect.objectContaining({ labels: { kind: 'lost_receipt' }, value: 1 })]);
      const outcomes = (await replica.metrics.gatewayOutcomes.get()).values.map((v) => v.labels);
      expect(outcomes).toEqual(expect.arrayContaining([
        { call: 'create', outcome: 'ambiguous', kind: 'lost_receipt', policy: 'at-least-once' },
        { call: 'create', outcome: 'succeeded', kind: 'lost_receipt', policy: 'at-least-once' },
      ]));
      // settled like any operation: its event reaches onSettled and says which effect and key
      await waitUntil(() => events.some((e) => e.operationId === op), 30_000, 'the settlement event');
      expect(events.find((e) => e.operationId === op)).toMatchObject({ kind: 'lost_receipt', key: 'order-2:receipt', status: 'succeeded', source: 'dispatcher' });
    } finally {
      await replica.stop();
      await o.stop(); // its onSettled would take later tests' events
    }
  });

  it('negative control: a send that did not lose its answer is not counted', async () => {
    const { sent, def } = receipts(0);
    const op = await request(app({ receipt: def }), 'receipt', { email: 'e@example.com' });
    expect((await execute(op, { receipt: def })).operation).toMatchObject({ status: 'succeeded', possible_duplicates: 0 });
    expect(sent).toHaveLength(1);
  });

  it('EffectFailed is definitive: failed, never executed again', async () => {
    let runs = 0;
    const def: EffectDefinition = {
      policy: 'at-least-once',
      async execute() {
        runs++;
        throw new EffectFailed('the address bounced');
      },
    };
    const op = await request(app({ receipt: def }), 'receipt', { email: 'f@example.com' });
    const fence = await claim(t, op);
    expect((await execute(op, { receipt: def }, fence)).operation).toMatchObject({ status: 'failed', last_error: 'EffectFailed: the address bounced' });
    expect((await execute(op, { receipt: def }, fence)).call).toBeNull();
    expect(runs).toBe(1);
  });
});

describe('an outcome JavaScript cannot put into words as given', () => {
  it('a result JSON cannot hold (a cycle: a client response object) says so instead of reading as none; a thrown value String() refuses is still recorded', async () => {
    const response: Record<string, unknown> = { status: 200 };
    response.request = { response };
    const defs: Record<string, EffectDefinition> = {
      cyclic_reply: { policy: 'at-least-once', execute: async () => response },
      odd_throw: { policy: 'at-least-once', execute: async () => { throw Object.create(null); } },
    };
    const o = app(defs);
    const cyclic = (await execute(await request(o, 'cyclic_reply', {}), defs)).operation;
    expect(cyclic).toMatchObject({ status: 'succeeded', result: { unserializable: expect.stringMatching(/circular/i) } });
    const odd = (await execute(await request(o, 'odd_throw', {}), defs)).operation;
    expect(odd).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous', last_error: 'unexpected create error: [object Object]' });
  });
});

describe('an outcome larger than is kept (an application can return or throw anything, once per attempt)', () => {
  it('a result over 64 KiB of JSON is recorded as such, and an error message is cut to 2000 characters on the operation (so its settlement event) and its timeline', async () => {
    const huge = 'x'.repeat(1 << 20);
    const runs = { big: 0, loud: 0, refused: 0 };
    const defs: Record<string, EffectDefinition> = {
      big_reply: { policy: 'at-least-once', execute: async () => (runs.big++, { body: huge }) },
      loud_failure: { policy: 'at-least-once', execute: async () => { runs.loud++; throw new Error(huge); } },
      loud_refusal: { policy: 'at-least-once', execute: async () => { runs.refused++; throw new EffectFailed(huge); } },
    };
    const o = app(defs);
    const big = (await execute(await request(o, 'big_reply', {}), defs)).operation;
    expect(big).toMatchObject({ status: 'succeeded', result: { unstored: `a result of ${(1 << 20) + 11} bytes of JSON, more than the 65536 kept` } });
    const loud = (await execute(await request(o, 'loud_failure', {}), defs)).operation;
    expect(loud).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous' });
    expect(loud.last_error).toBe(`unexpected create error: Error: ${'x'.repeat(2000 - 32)}… (${(1 << 20) - 2000 + 32} more characters)`);
    const refused = (await execute(await request(o, 'loud_refusal', {}), defs)).operation;
    expect(refused).toMatchObject({ status: 'failed' });
    expect(refused.last_error!.length).toBeLessThan(2100);
    // A settlement event says the operation's last_error as its reason.
    const { rows } = await t.pool.query(`select max(length(details::text)) as longest from ${t.schema}.operation_events where operation_id = any($1)`, [[big.id, loud.id, refused.id]]);
    expect(rows[0].longest).toBeLessThan(2500);
    expect(runs).toEqual({ big: 1, loud: 1, refused: 1 });
  });
});

describe('an outcome PostgreSQL cannot store as given (U+0000 or half an emoji in a result or an error)', () => {
  it('is stored with U+FFFD in its place: recorded at the first execution, never executed again', async () => {
    const runs = { result: 0, error: 0 };
    const defs: Record<string, EffectDefinition> = {
      // A string cut through an emoji (slice) keeps a lone surrogate, which jsonb refuses as it does U+0000.
      nul_result: { policy: 'at-least-once', execute: async () => (runs.result++, { note: 'a\u0000b', 'k\u0000': '\\u0000 stays', cut: '😀'.slice(0, 1), whole: '😀' }) },
      nul_error: { policy: 'at-least-once', execute: async () => { runs.error++; throw new EffectFailed('bad\u0000input'); } },
    };
    const o = app(defs);
    const [ok, bad, plain] = [await request(o, 'nul_result', {}), await request(o, 'nul_error', {}), await request(o, 'nul_result', {})];
    const fences = [await claim(t, ok), await claim(t, bad), await claim(t, plain)];
    // Executed together, their outcomes may share one statement: none may fail the others.
    const runsOf = await Promise.all([ok, bad, plain].map((op, i) => execute(op, defs, fences[i])));
    expect(runsOf.map((r) => r.operation)).toEqual([
      expect.objectContaining({ status: 'succeeded', result: { note: 'a\uFFFDb', 'k\uFFFD': '\\u0000 stays', cut: '\uFFFD', whole: '😀' } }),
      expect.objectContaining({ status: 'failed', last_error: 'EffectFailed: bad\uFFFDinput' }),
      expect.objectContaining({ status: 'succeeded' }),
    ]);
    expect(runs).toEqual({ result: 2, error: 1 });
  });
});

describe('reconcile-before-retry: a stock reservation whose answer is lost', () => {
  it('is checked, not run again: the check finds it done and settles it with what it found', async () => {
    const r = reservations({ loseAnswer: 1 });
    const op = await request(app({ reservation: r.def }), 'reservation', { sku: 'sku-1' });
    const fence = await claim(t, op);
    const first = await execute(op, { reservation: r.def }, fence);
    expect(first.operation).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous' });
    const second = await execute(op, { reservation: r.def }, fence);
    expect(second).toMatchObject({ call: 'check', operation: { status: 'succeeded', result: r.held.get(op) } });
    expect(r.calls).toEqual({ execute: 1, check: 1 });
    expect(r.held.size).toBe(1);
  });

  it('a check that finds it not done lets it run again (at once, not counted as a duplicate)', async () => {
    const r = reservations({ failBeforeReserving: 1 });
    const op = await request(app({ reservation: r.def }), 'reservation', { sku: 'sku-2' });
    const fence = await claim(t, op);
    expect((await execute(op, { reservation: r.def }, fence)).operation.status).toBe('unknown');
    const checked = await execute(op, { reservation: r.def }, fence);
    expect(checked).toMatchObject({ call: 'check', outcome: { kind: 'not_done' }, operation: { status: 'pending', first_attempted_at: null } });
    const again = await execute(op, { reservation: r.def }, fence);
    expect(again).toMatchObject({ call: 'create', operation: { status: 'succeeded', possible_duplicates: 0 } });
    expect(r.calls).toEqual({ execute: 2, check: 1 });
  });

  it('one whose execution always fails, checked not done each time, is retried on the job\'s budget and backoff, then held for a person', { timeout: 60_000 }, async () => {
    const calls = { execute: 0, check: 0 };
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      execute: () => {
        calls.execute++;
        throw new TypeError("Cannot read properties of undefined (reading 'sku')");
      },
      check: () => {
        calls.check++;
        return { status: 'not_done' };
      },
    };
    const o = app({ failing_reservation: def });
    // Three retries, a second apart, stand for the kind's 40 with backoff.
    await createKindQueues(t.boss, 'failing_reservation');
    await t.boss.updateQueue('failing_reservation', { retryLimit: 3, retryDelay: 1, retryBackoff: false });
    const op = await request(o, 'failing_reservation', { sku: 'sku-4' });
    const replica = await startDispatcher(t, new FakeStripe(), 'failing-reservation', { effects: new Map([['failing_reservation', def]]) });
    try {
      await waitUntil(async () => (await operation(t, op)).needs_review, 30_000, 'held for a person');
      expect((await operation(t, op)).review_reason).toMatch(/retries exhausted/);
      // The first delivery and its three retries: executions and checks in turn, never more.
      expect(calls).toEqual({ execute: 2, check: 2 });
    } finally {
      await replica.stop();
    }
  });

  // A reason PostgreSQL cannot store as it is (U+0000, half an emoji) once made pg-boss refuse the dead
  // letter: the job was retried instead, and the check ran again at each of its 40 retries.
  it.each(['in maintenance', 'in maintenance\u0000', 'in maintenance \ud83d'])('a check that cannot tell holds it for a person: dead-lettered, never executed again (the service is %j)', async (state) => {
    const r = reservations({ loseAnswer: 1, checkSays: { status: 'unknown', reason: `the stock service is ${state}` } });
    const op = await request(app({ held_reservation: r.def }), 'held_reservation', { sku: 'sku-3' });
    const replica = await startDispatcher(t, new FakeStripe(), 'reservation-worker', { effects: new Map([['held_reservation', r.def]]) });
    try {
      // The dead-letter handler takes the lease for a moment after the flag is set: wait for it to let go.
      await waitUntil(async () => { const o = await operation(t, op); return o.needs_review && o.lease_owner === null; }, 30_000, 'held for review');
      const held = await operation(t, op);
      expect(held).toMatchObject({ status: 'unknown', lease_owner: null });
      expect(held.review_reason).toMatch(/check could not tell whether held_reservation .* happened: the stock service is in maintenance/);
      const jobs = async () => (await t.pool.query(`select name from pgboss.job where data->>'operationId' = $1 order by name`, [op])).rows.map((j) => j.name);
      await waitUntil(async () => (await jobs()).includes('held_reservation_dead'), 10_000, 'dead-lettered');
      await new Promise((resolve) => setTimeout(resolve, 1_500));
      expect(r.calls).toEqual({ execute: 1, check: 1 });
    } finally {
      await replica.stop();
    }
  });
});

describe('every kind keeps the lease, the fence and the review queue', () => {
  it('the signal aborts when the lease is lost; the stale execution writes nothing', async () => {
    let seen: EffectContext | undefined;
    const def: EffectDefinition = {
      policy: 'at-least-once',
      execute: (ctx) =>
        new Promise((_resolve, reject) => {
          seen = ctx;
          ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason));
        }),
    };
    const op = await request(app({ slow_receipt: def }), 'slow_receipt', { email: 'g@example.com' });
    const replica = await startDispatcher(t, new FakeStripe(), 'stalled', { effects: new Map([['slow_receipt', def]]), leaseTtlMs: 3_000 });
    try {
      await waitUntil(() => seen, 20_000, 'the execution starts');
      expect(seen).toMatchObject({ operationId: op, key: expect.any(String), payload: { email: 'g@example.com' }, attempt: 1 });
      // Its lease runs out (the replica stalled): another worker claims the operation.
      const thief = await waitUntil(async () => {
        await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
        return acquireLease(t.pool, op, 'another-worker', 60_000);
      }, 5_000, 'the takeover');
      await waitUntil(() => seen!.signal.aborted, 10_000, 'the signal aborts');
      expect(String(seen!.signal.reason)).toMatch(/lease .* was lost/);
      await waitUntil(async () => (await replica.metrics.fencedOut.get()).values[0]!.value === 1, 10_000, 'fenced out');
      expect(await operation(t, op)).toMatchObject({ status: 'pending', fence: thief, lease_owner: 'another-worker' });
    } finally {
      await replica.stop();
    }
  });

  it('a call still running when its replica stops keeps its lease until it expires: no claim checks or runs it meanwhile', async () => {
    const runs = { started: 0, finished: 0, checks: 0 };
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      // Ignores its signal, as an effect may: the stock service call goes on after the replica gave up on it.
      execute: async () => {
        runs.started++;
        await new Promise((resolve) => setTimeout(resolve, 3_000));
        runs.finished++;
        return { reserved: true };
      },
      check: async () => (runs.checks++, runs.finished ? { status: 'done' } : { status: 'not_done' }),
    };
    const op = await request(app({ slow_hold: def }), 'slow_hold', { sku: 'sku-9' });
    const replica = await startDispatcher(t, new FakeStripe(), 'stopping', { effects: new Map([['slow_hold', def]]), leaseTtlMs: 8_000 });
    try {
      await waitUntil(() => runs.started === 1, 20_000, 'the execution under way');
      await replica.dispatcher.drain(0); // the grace is over, the call still runs
      // Given back now, a claim would check (not done yet) and execute again.
      expect(await acquireLease(t.pool, op, 'next-replica', 1_000)).toBeUndefined();
      expect(await operation(t, op)).toMatchObject({ lease_owner: 'stopping' });
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 10_000, 'the call to land');
      expect(runs).toEqual({ started: 1, finished: 1, checks: 0 });
    } finally {
      await replica.stop();
    }
  });

  it('one that heeds its signal and stops at shutdown has no outcome recorded: its lease is kept, to expire', async () => {
    const runs = { started: 0, checks: 0 };
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      execute: (ctx) =>
        new Promise((_resolve, reject) => {
          runs.started++;
          ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason)); // its request may still land
        }),
      check: async () => (runs.checks++, { status: 'unknown', reason: 'still landing' }),
    };
    const op = await request(app({ heeding_hold: def }), 'heeding_hold', { sku: 'sku-10' });
    const replica = await startDispatcher(t, new FakeStripe(), 'heeding', { effects: new Map([['heeding_hold', def]]), leaseTtlMs: 8_000 });
    try {
      await waitUntil(() => runs.started === 1, 20_000, 'the execution under way');
      await replica.dispatcher.drain(0);
      await waitUntil(async () => (await replica.metrics.inFlight.get()).values[0]!.value === 0, 5_000, 'the call given up');
      expect(await operation(t, op)).toMatchObject({ status: 'pending', last_outcome: null, lease_owner: 'heeding' });
      expect(await acquireLease(t.pool, op, 'next-replica', 1_000)).toBeUndefined();
      expect(runs).toEqual({ started: 1, checks: 0 });
    } finally {
      await replica.stop();
    }
  });

  it('a worker that defines the kind with another policy than it was requested under holds it for a person', async () => {
    const op = await request(app({ parcel: receipts().def }), 'parcel', { to: 'h' });
    const r = reservations();
    const run = await execute(op, { parcel: r.def });
    expect(run).toMatchObject({ call: null, operation: { status: 'pending', needs_review: true } });
    expect(run.operation.review_reason).toMatch(/requested under policy at-least-once, but this worker defines parcel as reconcile-before-retry/);
    expect(r.calls).toEqual({ execute: 0, check: 0 });
  });

  it('the sweep flags an effect that no job of its kind drives, never one that waits in its queue, and never reconciles it', async () => {
    const o = app({ swept_receipt: receipts().def });
    const orphan = await request(o, 'swept_receipt', {});
    const queued = await request(o, 'swept_receipt', {});
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [orphan]);
    await relay(t); // `queued` gets a job in the receipt queue (created by the relay: no receipt worker runs)
    await t.pool.query(`update outboxd.payment_operations set updated_at = now() - interval '1 hour', first_attempted_at = now() - interval '2 days' where id = any($1)`, [[orphan, queued]]);
    const report = await reconcileSweep(t.pool, new FakeStripe(), { owner: 'sweeper', leaseTtlMs: 10_000, log });
    expect(report.decisions.map((d) => d.operationId)).not.toContain(orphan);
    expect(report.decisions.map((d) => d.operationId)).not.toContain(queued);
    expect(report.undriven).toContain(orphan);
    expect(report.undriven).not.toContain(queued);
    expect((await operation(t, orphan)).review_reason).toMatch(/no job drives this operation/);
    const { rows } = await t.pool.query(`select name, state from pgboss.job where data->>'operationId' = $1`, [queued]);
    expect(rows).toEqual([{ name: 'swept_receipt', state: 'created' }]);
  });
});

describe('a person’s resolution of an effect of the application’s', () => {
  it('is refused while its job drives it; then recorded on the person’s word, audited', async () => {
    const r = reservations();
    const op = await request(app({ manual_reservation: r.def }), 'manual_reservation', { sku: 'sku-9' });
    const resolve = (resolution: Resolution) => resolveOperation(t.pool, new FakeStripe(), op, resolution, 'carol', { leaseTtlMs: 10_000, searchFreshnessSeconds: 3_600 });
    await expect(resolve({ outcome: 'succeeded', externalId: 'res-ticket-1' })).rejects.toThrow(/waits in the outbox/);
    await relay(t);
    await expect(resolve({ outcome: 'succeeded', externalId: 'res-ticket-1' })).rejects.toThrow(/the workers still drive it/);
    await t.pool.query(`delete from pgboss.job where data->>'operationId' = $1`, [op]);
    expect(await resolve({ outcome: 'succeeded', externalId: 'res-ticket-1' })).toMatchObject({ status: 'succeeded', external_id: 'res-ticket-1' });
    const { rows } = await t.pool.query(`select actor, action, details->'evidence' as evidence from outboxd.admin_audit where operation_id = $1 order by id`, [op]);
    expect(rows).toEqual([
      { actor: 'carol', action: 'resolve_refused', evidence: null },
      { actor: 'carol', action: 'resolve_refused', evidence: null },
      { actor: 'carol', action: 'resolve', evidence: { reference: 'res-ticket-1', checked: 'nothing: outboxd cannot check an effect of kind manual_reservation' } },
    ]);
    expect(r.calls).toEqual({ execute: 0, check: 0 });
  });
});

describe('timeoutMs: a call that outlives it is given up, and never holds its slot or its lease forever', () => {
  /** An execute that never returns and ignores its signal (a hung socket without a timeout of its own):
   * nothing it does can end the call. */
  const hung = (seen: EffectContext[]) => (ctx: EffectContext) => (seen.push(ctx), new Promise<never>(() => {}));

  it('at-least-once: ambiguous once its time is up (the signal says so), executed again and counted as a possible duplicate', async () => {
    const seen: EffectContext[] = [];
    const def: EffectDefinition = { policy: 'at-least-once', timeoutMs: 300, execute: (ctx) => (ctx.attempt === 1 ? hung(seen)(ctx) : { sent: ctx.attempt }) };
    const op = await request(app({ hung_receipt: def }), 'hung_receipt', { email: 'i@example.com' });
    const fence = await claim(t, op);
    const first = await execute(op, { hung_receipt: def }, fence);
    expect(first).toMatchObject({ call: 'create', outcome: { kind: 'ambiguous' }, operation: { status: 'unknown', last_outcome: 'ambiguous' } });
    expect(first.operation.last_error).toMatch(/did not return within 300 ms \(timeoutMs\)/);
    expect(seen[0]!.signal.aborted).toBe(true);
    expect(seen[0]!.signal.reason).toMatchObject({ name: 'CallTimedOut' });
    const second = await execute(op, { hung_receipt: def }, fence);
    expect(second.operation).toMatchObject({ status: 'succeeded', possible_duplicates: 1, result: { sent: 2 } });
  });

  it('reconcile-before-retry: its lease is kept until the call returns (it may still act), its slot goes on; then what it returned settles it, never executed again', async () => {
    const seen: EffectContext[] = [];
    const { returned, finish } = answerWhenTold();
    let checks = 0;
    const reserved = new Set<string>();
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      timeoutMs: 300,
      // The stock service answers late, whatever the signal says: the reservation is made as it returns.
      execute: async (ctx) => {
        if ((ctx.payload as { hang: boolean }).hang) {
          seen.push(ctx);
          await returned;
        }
        reserved.add(ctx.operationId);
        return { reserved: true };
      },
      check: async ({ operationId }) => (checks++, reserved.has(operationId) ? { status: 'done', result: { found: true } } : { status: 'not_done' }),
    };
    const o = app({ late_hold: def });
    const late = await request(o, 'late_hold', { hang: true });
    const replica = await startDispatcher(t, new FakeStripe(), 'late-holds', { concurrency: 1, leaseTtlMs: 3_000, effects: new Map([['late_hold', def]]) });
    try {
      await waitUntil(() => seen.length === 1, 20_000, 'the call under way');
      const behind = await request(o, 'late_hold', { hang: false });
      await waitUntil(async () => (await operation(t, behind)).status === 'succeeded', 20_000, 'the operation behind it');
      expect(seen[0]!.signal.reason).toMatchObject({ name: 'CallTimedOut' });
      await waitUntil(async () => (await replica.metrics.callsOverdue.get()).values[0]!.value === 1, 5_000, 'counted overdue');
      // Several lease terms on, the lease is still this replica's: no claim (a retry, a requeue, a person) checks it now.
      await new Promise((resolve) => setTimeout(resolve, 7_000));
      expect(await operation(t, late)).toMatchObject({ status: 'pending', lease_owner: 'late-holds', last_outcome: null });
      expect(await acquireLease(t.pool, late, 'a-requeue', 1_000)).toBeUndefined();
      expect(checks).toBe(0);
      finish(); // it returns: the reservation is made, late
      await waitUntil(async () => (await operation(t, late)).status === 'succeeded', 30_000, 'settled');
      expect(await operation(t, late)).toMatchObject({ result: { reserved: true }, attempts: 1 });
      expect(seen).toHaveLength(1); // executed once
      expect(checks).toBe(0);
      expect((await replica.metrics.callsOverdue.get()).values[0]!.value).toBe(0);
    } finally {
      finish();
      await replica.stop();
    }
  });

  it('a service that hangs for good: past the concurrency, a kind’s calls still running past their timeout keep their slots until they return, so its calls in hand stay bounded', async () => {
    const { returned, finish } = answerWhenTold();
    let started = 0;
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      timeoutMs: 200,
      execute: async () => {
        started++;
        await returned;
        return { reserved: true };
      },
      check: async () => ({ status: 'not_done' }),
    };
    const o = app({ blackhole: def });
    const ops: string[] = [];
    for (let i = 0; i < 20; i++) ops.push(await request(o, 'blackhole', { i }));
    // Four slots, three of them for the application's kinds: four calls given up free theirs, the next
    // three keep them.
    const replica = await startDispatcher(t, new FakeStripe(), 'blackhole', { concurrency: 4, leaseTtlMs: 3_000, effects: new Map([['blackhole', def]]) });
    try {
      await waitUntil(() => started >= 7, 20_000, 'the calls under way');
      await new Promise((resolve) => setTimeout(resolve, 3_000)); // fifteen timeouts more
      expect(started).toBe(7);
      expect((await replica.metrics.callsOverdue.get()).values[0]!.value).toBe(7);
      // Their leases, renewed until they return, and the claims made ahead (two a slot) waiting for one.
      const leased = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where id = any($1::uuid[]) and lease_owner = 'blackhole'`, [ops]);
      expect(leased.rows[0].n).toBeLessThanOrEqual(7 + 2 * 3);
    } finally {
      finish();
      await replica.stop();
    }
  });

  it('a service that hangs for good on a replica of one slot: the calls it keeps hold the application’s share of it, never the slot the charges need', async () => {
    const { returned, finish } = answerWhenTold();
    let started = 0;
    const def: EffectDefinition = { policy: 'at-least-once', timeoutMs: 200, execute: async () => (started++, await returned, { sent: true }) };
    const o = app({ hung_mail: def });
    for (let i = 0; i < 3; i++) await request(o, 'hung_mail', { i });
    const replica = await startDispatcher(t, new FakeStripe(), 'one-slot', { concurrency: 1, leaseTtlMs: 3_000, effects: new Map([['hung_mail', def]]) });
    try {
      await waitUntil(async () => (await replica.metrics.callsOverdue.get()).values[0]?.value === 2, 20_000, 'two given up, the second keeping its share');
      const charge = await confirm(t);
      await waitUntil(async () => (await operation(t, charge)).status === 'succeeded', 20_000, 'the charge, behind the hung service');
      expect(started).toBe(2); // the application's share held: no third call started
    } finally {
      finish();
      await replica.stop();
    }
  });

  /** A reservation whose first execute answers only when told to (`finish`), whatever its signal says. */
  function lateReservation() {
    const { returned, finish } = answerWhenTold();
    const executions: number[] = [];
    const reserved = new Set<string>();
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      timeoutMs: 300,
      execute: async (ctx) => {
        executions.push(ctx.attempt);
        if (executions.length === 1) await returned;
        reserved.add(ctx.operationId);
        return { reserved: true };
      },
      check: async ({ operationId }) => (reserved.has(operationId) ? { status: 'done', result: { found: true } } : { status: 'not_done' }),
    };
    return { def, executions, finish };
  }

  it('reconcile-before-retry: a renewal held up past the lease’s deadline (the application holds the row) does not let the lease lapse under a call that may still act', async () => {
    const late = lateReservation();
    const op = await request(app({ stalled_hold: late.def }), 'stalled_hold', {});
    const replica = await startDispatcher(t, new FakeStripe(), 'stalled-holds', { concurrency: 1, leaseTtlMs: 3_000, effects: new Map([['stalled_hold', late.def]]) });
    try {
      await waitUntil(async () => (await replica.metrics.callsOverdue.get()).values[0]!.value === 1, 20_000, 'given up, still running');
      // The application holds the operation's row for most of a lease term: a renewal waits on it.
      await inTx(async (client) => {
        await client.query(`select id from outboxd.payment_operations where id = $1 for update`, [op]);
        await new Promise((resolve) => setTimeout(resolve, 2_500));
      });
      // Several lease terms on, still this replica's, and live: nothing has checked it, nor executed it again.
      await new Promise((resolve) => setTimeout(resolve, 7_000));
      expect(await operation(t, op)).toMatchObject({ status: 'pending', lease_owner: 'stalled-holds' });
      expect((await t.pool.query(`select lease_expires_at > now() as live from outboxd.payment_operations where id = $1`, [op])).rows[0].live).toBe(true);
      late.finish();
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 30_000, 'checked and settled');
      expect(late.executions).toHaveLength(1);
      expect((await operation(t, op)).review_reason).toBeNull();
    } finally {
      late.finish();
      await replica.stop();
    }
  });

  it('reconcile-before-retry: a create given up past its timeout that then returns settles the operation with what it returned; no check is trusted instead (one reading an index that lags ran it twice)', async () => {
    const late = lateReservation();
    // The service's lookup shows a reservation only a minute after it is made: until then a check finds none.
    const lagging: EffectDefinition = { ...late.def, check: async () => ({ status: 'not_done' }) };
    const op = await request(app({ lagging_hold: lagging }), 'lagging_hold', {});
    const replica = await startDispatcher(t, new FakeStripe(), 'lagging-holds', { concurrency: 1, leaseTtlMs: 3_000, effects: new Map([['lagging_hold', lagging]]) });
    try {
      await waitUntil(async () => (await replica.metrics.callsOverdue.get()).values[0]!.value === 1, 20_000, 'given up, still running');
      late.finish();
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 30_000, 'settled');
      await new Promise((resolve) => setTimeout(resolve, 1_500)); // a retried job, had it been checked, would have run it again by now
      expect(late.executions).toHaveLength(1);
      expect(await operation(t, op)).toMatchObject({ status: 'succeeded', result: { reserved: true }, review_reason: null, attempts: 1 });
    } finally {
      late.finish();
      await replica.stop();
    }
  });

  it('reconcile-before-retry: a worker stopped under a call that may still act (given up, or still running) leaves it to a person, never executed again by another; one that stops on its signal is checked and run again', async () => {
    const overdue = lateReservation();
    const running = lateReservation();
    const slow: EffectDefinition = { ...running.def, timeoutMs: 60_000 };
    // Its first execute stops when its signal says so, having done nothing.
    const heeding: number[] = [];
    const heeds: EffectDefinition = {
      ...slow,
      execute: async (ctx) => {
        heeding.push(ctx.attempt);
        if (heeding.length === 1) await new Promise((_resolve, reject) => ctx.signal.addEventListener('abort', () => reject(new Error('stopped'))));
        return { reserved: true };
      },
      check: async () => ({ status: 'not_done' }),
    };
    const defs = { overdue_hold: overdue.def, running_hold: slow, stop_heeding_hold: heeds };
    const o = app(defs);
    const ops = [await request(o, 'overdue_hold', {}), await request(o, 'running_hold', {})];
    const stopped = await request(o, 'stop_heeding_hold', {});
    const effects = new Map(Object.entries(defs));
    const a = await startDispatcher(t, new FakeStripe(), 'stopped-holds', { concurrency: 3, leaseTtlMs: 3_000, effects });
    await waitUntil(async () => (await a.metrics.callsOverdue.get()).values[0]!.value === 1 && running.executions.length === 1 && heeding.length === 1, 20_000, 'one given up, two running');
    await a.stop(); // the application's process goes on, and so do the calls that ignore their signal
    const b = await startDispatcher(t, new FakeStripe(), 'other-holds', { concurrency: 3, leaseTtlMs: 3_000, effects });
    try {
      // The other replica claims each once its lease lapsed, and its check, finding nothing done, is not trusted.
      for (const op of ops) {
        await waitUntil(async () => { const now = await operation(t, op); return now.last_outcome === 'needs_review' && now.lease_owner === null; }, 60_000, 'checked, and held for a person');
        expect((await operation(t, op)).review_reason).toMatch(/given up while it could still act, never said it returned/);
      }
      // The one that returned on its signal is no one's to decide: checked, and run again.
      await waitUntil(async () => (await operation(t, stopped)).status === 'succeeded', 60_000, 'run again');
      expect((await operation(t, stopped)).review_reason).toBeNull();
      expect(heeding).toEqual([1, 3]); // executed, checked (2), executed again
      overdue.finish();
      running.finish();
      await new Promise((resolve) => setTimeout(resolve, 1_500));
      expect([overdue.executions, running.executions]).toEqual([[1], [1]]);
      // A person who found they did not act requeues one: its next check is trusted.
      expect(await requeueOperation(t.pool, b.boss, ops[1]!, { actor: 'alice' })).toMatchObject({ result: 'requeued' });
      await waitUntil(async () => (await operation(t, ops[1]!)).status === 'succeeded', 30_000, 'checked after the requeue');
    } finally {
      overdue.finish();
      running.finish();
      await b.stop();
    }
  });

  it('a check that outlives it acted on nothing: ambiguous, and checked again', async () => {
    const seen: EffectContext[] = [];
    const r = reservations({ loseAnswer: 1 });
    let checks = 0;
    const def: EffectDefinition = { ...r.def, timeoutMs: 300, check: (ctx) => (++checks === 1 ? hung(seen)(ctx) : r.def.check!(ctx)) };
    const op = await request(app({ slow_check: def }), 'slow_check', { sku: 'sku-12' });
    const fence = await claim(t, op);
    expect((await execute(op, { slow_check: def }, fence)).operation.status).toBe('unknown'); // the answer was lost
    const timedOut = await execute(op, { slow_check: def }, fence);
    expect(timedOut).toMatchObject({ call: 'check', outcome: { kind: 'ambiguous' }, operation: { status: 'unknown', needs_review: false } });
    expect(await execute(op, { slow_check: def }, fence)).toMatchObject({ call: 'check', operation: { status: 'succeeded', result: r.held.get(op) } });
    expect(r.calls.execute).toBe(1);
  });

  it('one replica slot: a hung call gives its slot up, and the operations behind it are carried out', async () => {
    const seen: EffectContext[] = [];
    const def: EffectDefinition = { policy: 'at-least-once', timeoutMs: 500, execute: (ctx) => ((ctx.payload as { hang: boolean }).hang ? hung(seen)(ctx) : { sent: true }) };
    const o = app({ one_slot_mail: def });
    const stuck = await request(o, 'one_slot_mail', { hang: true });
    const replica = await startDispatcher(t, new FakeStripe(), 'one-slot', { concurrency: 1, effects: new Map([['one_slot_mail', def]]) });
    try {
      await waitUntil(() => seen.length === 1, 20_000, 'the hung call under way');
      const behind = [await request(o, 'one_slot_mail', { hang: false }), await request(o, 'one_slot_mail', { hang: false })];
      await waitUntil(async () => (await Promise.all(behind.map((op) => operation(t, op)))).every((row) => row.status === 'succeeded'), 20_000, 'the operations behind it');
      // The hung one is retried on its schedule, each attempt given up in turn, and counted while it runs.
      await waitUntil(() => seen.length >= 2, 20_000, 'the hung one executed again');
      await waitUntil(async () => (await replica.metrics.callsOverdue.get()).values[0]!.value >= 1, 5_000, 'counted as given up, still running');
      const row = await operation(t, stuck);
      expect(row).toMatchObject({ status: 'unknown', last_outcome: 'ambiguous' });
      expect(row.possible_duplicates).toBeGreaterThanOrEqual(1);
    } finally {
      await replica.stop();
    }
  });
});

describe('WORKER_CONCURRENCY: calls in flight per replica, whatever their kind', () => {
  it('an at-least-once effect first executed over a key window ago waits for a busy slot like any other: claimed once', { timeout: 30_000 }, async () => {
    let slowStarted = false;
    const slow: EffectDefinition = { policy: 'at-least-once', execute: async () => { slowStarted = true; await new Promise((r) => setTimeout(r, 4_000)); return 'slow'; } };
    const receipt: EffectDefinition = { policy: 'at-least-once', execute: async () => 'sent' };
    const o = app({ busy_slot_job: slow, day_old_receipt: receipt });
    await request(o, 'busy_slot_job', {});
    const replica = await startDispatcher(t, new FakeStripe(), 'day-old', { concurrency: 1, effects: new Map([['busy_slot_job', slow], ['day_old_receipt', receipt]]) });
    try {
      await waitUntil(() => slowStarted, 10_000, 'the one slot taken');
      // Executed a day ago, its answer lost (a person requeues it the next day, say): so from its first claim.
      const op = await inTx(async (client) => {
        const { operationId } = await o.requestEffect(client, 'day_old_receipt', { key: `key-${++n}`, payload: {} });
        await client.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now() - interval '24 hours',
                            last_attempted_at = now() - interval '24 hours' where id = $1`, [operationId]);
        return operationId;
      });
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'carried out once the slot is free');
      // Claimed once, waiting for the slot; not given back and claimed again while it was busy.
      expect((await operation(t, op)).fence).toBe(1);
    } finally {
      await replica.stop();
    }
  });

  it('two kinds with a backlog each share the slots the application’s kinds may take: never more calls at once', async () => {
    let inFlight = 0;
    let most = 0;
    const { returned: finished, finish } = answerWhenTold();
    const slow: EffectDefinition = {
      policy: 'at-least-once',
      async execute() {
        most = Math.max(most, ++inFlight);
        try {
          await finished;
          return {};
        } finally {
          inFlight--;
        }
      },
    };
    const defs = { slow_mail: slow, slow_sms: slow };
    const o = app(defs);
    const ops: string[] = [];
    for (const kind of Object.keys(defs)) for (let i = 0; i < 3; i++) ops.push(await request(o, kind, { i }));
    // Of 3 slots, 2 are the application's kinds' (one is kept for the payments).
    const replica = await startDispatcher(t, new FakeStripe(), 'shared-slots', { concurrency: 3, effects: new Map(Object.entries(defs)) });
    try {
      // Every job fetched (each kind has its own loops), two of them running: with slots per kind, four would.
      const active = async () => (await t.pool.query(`select count(*)::int as n from pgboss.job where name = any($1) and state = 'active'`, [Object.keys(defs)])).rows[0].n;
      await waitUntil(async () => (await active()) === ops.length && inFlight >= 2, 20_000, 'all six fetched, calls running');
      await new Promise((resolve) => setTimeout(resolve, 300)); // a third call would have started by now
      expect(inFlight).toBe(2);
      finish();
      await waitUntil(async () => (await Promise.all(ops.map((op) => operation(t, op)))).every((row) => row.status === 'succeeded'), 20_000, 'all settled');
      expect(most).toBe(2);
    } finally {
      finish();
      await replica.stop();
    }
  });
});

describe('sharing a replica with the payments', () => {
  it("an effect of the application's that hangs holds up no charge: its kinds never take the slots and claims kept for the built-in ones", async () => {
    const hung: (() => void)[] = [];
    // A mail service that black-holes: each call hangs until its timeoutMs, far longer than this test.
    const def: EffectDefinition = { policy: 'at-least-once', timeoutMs: 60_000, execute: () => new Promise((resolve) => void hung.push(() => resolve({}))) };
    const o = app({ hanging_mail: def });
    for (let i = 0; i < 20; i++) await request(o, 'hanging_mail', { i });
    await relay(t);
    const replica = await startDispatcher(t, new FakeStripe(), 'hanging-mail', { concurrency: 4, leaseTtlMs: 5_000, effects: new Map([['hanging_mail', def]]) });
    try {
      // Of 4 slots, the application's kinds take 3.
      await waitUntil(() => hung.length >= 3, 10_000, 'mails hanging in every slot they may take');
      const charge = await confirm(t);
      await waitUntil(async () => (await operation(t, charge)).status === 'succeeded', 20_000, 'the charge settled while the mails hang');
      expect(hung).toHaveLength(3);
    } finally {
      for (const finish of hung) finish();
      await replica.stop();
    }
  });
});

describe('startWorker: the dispatcher inside the application’s process', () => {
  it("on the application's pool, the shared Stripe budget takes its tokens through that pool", async () => {
    process.env.STRIPE_RATE_LIMIT = '50';
    const o = new Outboxd({ pool: appPool });
    apps.push(o);
    try {
      const heard: string[] = [];
      await o.onSettled((event) => void heard.push(event.operationId));
      const worker = await o.startWorker({ concurrency: 2 });
      const charge = (await inTx((c) => o.requestCharge(c, { orderId: `budgeted-${Date.now()}`, amount: 990, currency: 'eur', customer: 'cus_b', paymentMethod: 'pm_card_visa' }))).operationId;
      await waitUntil(async () => heard.includes(charge), 30_000, 'the charge settled');
      expect((await t.pool.query(`select name from outboxd.rate_budgets where name = 'stripe'`)).rows).toHaveLength(1);
      expect(await worker.metrics()).toMatch(/outboxd_stripe_budget_granted_total\{[^}]*budget="stripe"[^}]*\} [1-9]/);
    } finally {
      delete process.env.STRIPE_RATE_LIMIT;
      await o.stop();
    }
  });

  it('carries out the built-in kinds and the defined ones; settlements reach onSettled; metrics carry the policy', async () => {
    const { sent, def } = receipts(1);
    const o = new Outboxd({ pool: appPool }); // on the application's own pool
    apps.push(o);
    o.defineEffect('welcome_mail', def);
    const events: SettlementEvent[] = [];
    await o.onSettled((event) => {
      events.push(event);
    });
    const worker = await o.startWorker({ concurrency: 2 });
    try {
      const op = await request(o, 'welcome_mail', { email: 'w@example.com' }, 'user-7:welcome');
      const charge = (await inTx((c) => o.requestCharge(c, { orderId: `order-${op}`, amount: 990, currency: 'eur', customer: 'cus_w', paymentMethod: 'pm_card_visa' }))).operationId;
      await waitUntil(() => events.some((e) => e.operationId === op) && events.some((e) => e.operationId === charge), 40_000, 'both settled');
      expect(events.find((e) => e.operationId === op)).toMatchObject({ kind: 'welcome_mail', key: 'user-7:welcome', status: 'succeeded', orderId: null, amount: null, externalId: null });
      expect(events.find((e) => e.operationId === charge)).toMatchObject({ kind: 'charge', key: null, status: 'succeeded', amount: 990 });
      expect(sent.map((x) => x.attempt)).toEqual([1, 2]);
      expect(await o.getOperation(op)).toMatchObject({ status: 'succeeded', policy: 'at-least-once', possibleDuplicates: 1, result: { messageId: 'msg-2' } });
      const text = await worker.metrics();
      expect(text).toContain('outboxd_effect_possible_duplicates_total{kind="welcome_mail"} 1');
      expect(text).toContain('outboxd_gateway_outcomes_total{call="create",outcome="succeeded",kind="welcome_mail",policy="at-least-once"} 1');
      expect(text).toContain('outboxd_gateway_outcomes_total{call="create",outcome="succeeded",kind="charge",policy="idempotent-key"} 1');
      expect(() => o.defineEffect('late', def)).toThrow(/before startWorker/);
    } finally {
      await o.stop();
    }
    expect((await appPool.query('select 1 as ok')).rows[0].ok).toBe(1); // the application's pool is not ended
  });

  it("on an application's pool of one connection: a defined kind's first rows do not wait for that connection while holding it (and the outbox's rows), and stop returns", async () => {
    const { def } = receipts();
    const one = new pg.Pool({ connectionString: t.url, max: 1 });
    const o = new Outboxd({ pool: one });
    o.defineEffect('one_conn_mail', def);
    const events: string[] = [];
    await o.onSettled((event) => void events.push(event.operationId));
    const worker = await o.startWorker({ concurrency: 4 });
    try {
      // Requested through the application's other pool, as a request handler would.
      const mails = await Promise.all([1, 2, 3].map((i) => request(o, 'one_conn_mail', { email: `m${i}@example.com` }, `one-conn-${i}`)));
      const charge = (await inTx((c) => o.requestCharge(c, { orderId: `one-conn-${Date.now()}`, amount: 990, currency: 'eur', customer: 'cus_1', paymentMethod: 'pm_card_visa' }))).operationId;
      await waitUntil(() => [...mails, charge].every((id) => events.includes(id)), 30_000, 'all settled');
    } finally {
      const stopped = Date.now();
      await worker.stop();
      await o.stop();
      expect(Date.now() - stopped).toBeLessThan(10_000);
      await one.end();
    }
  });

  it("starts in a process whose own settings of what it never reads (tracing over gRPC, its HTTP port, its logger's level) a worker process would refuse", async () => {
    const own = { OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc', OTEL_EXPORTER_OTLP_ENDPOINT: 'grpc://collector:4317', HTTP_PORT: '80800', ADMIN_TOKEN: 'short', LOG_LEVEL: 'warning' };
    Object.assign(process.env, own);
    const o = new Outboxd({ connectionString: t.url });
    const judged = new Outboxd({ connectionString: t.url });
    try {
      const worker = await o.startWorker({ concurrency: 1 });
      await worker.stop();
      // What it reads is judged as ever.
      process.env.LEASE_TTL_MS = '10';
      await expect(judged.startWorker({ concurrency: 1 })).rejects.toThrow(/LEASE_TTL_MS/);
    } finally {
      for (const name of [...Object.keys(own), 'LEASE_TTL_MS']) delete process.env[name];
      await Promise.all([o.stop(), judged.stop()]);
    }
  });

  it("stop() again, or the worker's and then outboxd's (a SIGTERM handler and a finally): one drain, no error", async () => {
    const o = new Outboxd({ connectionString: t.url });
    const worker = await o.startWorker({ concurrency: 1 });
    await Promise.all([worker.stop(), worker.stop()]);
    await worker.stop();
    await Promise.all([o.stop(), o.stop()]);
    await o.stop();
  });
});

describe('outboxd worker --effects', () => {
  const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
  it('refuses a module that defines no valid effect, saying why (exit 2)', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'outboxd-effects-'));
    try {
      const file = path.join(dir, 'effects.mjs');
      await writeFile(file, `export default { reservation: { policy: 'reconcile-before-retry', execute: async () => null } };`);
      const child = spawn(process.execPath, [BIN, 'worker', '--effects', file], { env: { ...process.env, DATABASE_URL: t.url, LOG_LEVEL: 'silent', HTTP_PORT: '0' } });
      let stderr = '';
      child.stderr.on('data', (d) => (stderr += d));
      const code = await new Promise((r) => child.on('exit', r));
      expect(code).toBe(2);
      expect(stderr).toMatch(/--effects .*effects\.mjs: effect reservation: reconcile-before-retry needs check/);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('an effect that leaves a promise rejected and unhandled does not take the replica down: logged and counted, its outcome recorded, the replica goes on', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'outboxd-effects-'));
    const file = path.join(dir, 'effects.mjs');
    await writeFile(file, `export default { stray_mail: { policy: 'at-least-once', execute: async () => { Promise.reject(new Error('a stray rejection')); return { sent: true }; } } };`);
    const replica = await startReplica({ DATABASE_URL: t.url, LOG_LEVEL: 'info' }, { args: ['--effects', file] });
    try {
      const o = app({ stray_mail: { policy: 'at-least-once', execute: async () => ({ sent: true }) } });
      const first = await request(o, 'stray_mail', { to: 'a@example.com' });
      await waitUntil(async () => (await operation(t, first)).status === 'succeeded', 30_000, 'the first settled');
      // Node's default would have ended the process here, before the outcome was recorded.
      const second = await request(o, 'stray_mail', { to: 'b@example.com' });
      await waitUntil(async () => (await operation(t, second)).status === 'succeeded', 30_000, 'the second settled by the same replica');
      expect(await operation(t, first)).toMatchObject({ attempts: 1, possible_duplicates: 0 });
      expect(replica.proc.exitCode).toBeNull();
      expect(replica.logs.filter((l) => (l.msg as string)?.startsWith('a promise rejected with no handler'))).toHaveLength(2);
      expect((await replica.get('/metrics')).body).toMatch(/^outboxd_unhandled_rejections_total 2$/m);
    } finally {
      replica.kill('SIGKILL');
      await replica.exited;
      await rm(dir, { recursive: true, force: true });
    }
  });
});
