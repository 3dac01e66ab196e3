// The dispatcher: in-process replicas for queue semantics, real OS processes where the property is
// about processes (kill -9, SIGSTOP, SIGTERM).
import { AsyncLocalStorage } from 'node:async_hooks';
import { queryObjects } from 'node:v8';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { inTransaction } from '../../src/db/pool.ts';
import { Dispatcher } from '../../src/dispatcher/dispatcher.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { createBoss } from '../../src/outbox/outbox.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { createMetrics } from '../../src/telemetry/metrics.ts';
import { idempotencyKeyFor, refundIdempotencyKeyFor } from '../../src/stripe/gateway.ts';
import { acquireLease, releaseLease, settleFromOutside } from '../../src/engine/operation.ts';
import { KEY_WINDOW_SECONDS } from '../../src/engine/executor.ts';
import { requestRefund } from '../../src/kinds/refund/request.ts';
import { requestEffect } from '../../src/kinds/application/request.ts';
import type { EffectDefinitions } from '../../src/kinds/application/definition.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation, relay } from '../support/fixtures.ts';
import { startReplica, waitUntil, type Replica } from '../../harness/replica.ts';

let t: TestDb;
let e: RunningEmulator;
const replicas: Replica[] = [];
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.reset());
afterEach(async () => {
  for (const r of replicas.splice(0)) {
    r.kill('SIGCONT');
    r.kill('SIGKILL');
    await r.exited;
  }
  await t.pool.query(`delete from pgboss.job where name in ('charge', 'charge_dead', 'refund', 'refund_dead')`);
  await t.pool.query(`delete from outboxd.charge_outbox`);
});

const replica = async (env: Record<string, string> = {}) => {
  const r = await startReplica({
    DATABASE_URL: t.url,
    STRIPE_API_BASE: e.url,
    STRIPE_SECRET_KEY: '',
    WORKER_CONCURRENCY: '4',
    STRIPE_TIMEOUT_MS: '2000',
    LEASE_TTL_MS: '3000',
    SHUTDOWN_GRACE_MS: '10000',
    ...env,
  });
  replicas.push(r);
  return r;
};
const charges = (op: string) => e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === op);
const createsFor = (op: string) => e.emulator.requests().filter((r) => r.endpoint === 'create' && r.operationId === op);
const settled = async (op: string) => ['succeeded', 'failed'].includes((await operation(t, op)).status);

describe('dispatcher replicas (OS processes)', () => {
  it('two replicas, many orders: every operation settles with exactly one charge', async () => {
    // A generous timeout: 60 concurrent calls on a loaded machine must not turn into ambiguous outcomes.
    const [a, b] = await Promise.all([replica({ STRIPE_TIMEOUT_MS: '10000', LEASE_TTL_MS: '12000' }), replica({ STRIPE_TIMEOUT_MS: '10000', LEASE_TTL_MS: '12000' })]);
    const ops = await Promise.all(Array.from({ length: 60 }, (_, i) => confirm(t, { paymentMethod: i % 10 === 0 ? 'pm_card_chargeDeclined' : 'pm_card_visa' })));
    await waitUntil(async () => (await Promise.all(ops.map(settled))).every(Boolean), 60_000, 'all settled');
    for (const op of ops) {
      expect(charges(op)).toHaveLength(1);
      expect(new Set(createsFor(op).map((r) => r.idempotencyKey))).toEqual(new Set([idempotencyKeyFor(op)]));
    }
    const { rows } = await t.pool.query(`select status, count(*)::int as n from outboxd.payment_operations where id = any($1) group by status`, [ops]);
    expect(Object.fromEntries(rows.map((r) => [r.status, r.n]))).toEqual({ succeeded: 54, failed: 6 });
    const sum = async (name: string) => (await a.metric(name)) + (await b.metric(name));
    // A job is counted once its handler returns, a moment after the outcome it wrote is visible.
    await waitUntil(async () => (await sum('outboxd_jobs_total')) === 60 && (await a.metric('outboxd_in_flight')) === 0, 10_000, 'every job counted');
    expect(await sum('outboxd_operation_transitions_total{from="pending",to="succeeded"}')).toBe(54);
    expect(await sum('outboxd_operation_transitions_total{from="pending",to="failed"}')).toBe(6);
    expect(await sum('outboxd_gateway_outcomes_total{call="create"')).toBe(60);
  });

  it('a call still running past SHUTDOWN_GRACE_MS holds no exit: the process ends after the grace, its lease left to lapse; another replica settles it', async () => {
    const a = await replica({ SHUTDOWN_GRACE_MS: '2000', STRIPE_TIMEOUT_MS: '40000', LEASE_TTL_MS: '42000' });
    e.emulator.addFault({ fault: { kind: 'latency', ms: 20_000 }, count: 1 });
    const op = await confirm(t);
    await waitUntil(() => createsFor(op).length === 1, 20_000, 'a call in flight');
    const term = Date.now();
    a.kill('SIGTERM');
    const { code } = await a.exited;
    expect(code).toBe(0);
    expect(Date.now() - term).toBeLessThan(12_000); // the call had 18 s or more left
    expect(a.logs.find((l) => l.msg === 'worker stopped')).toMatchObject({ finished: false });
    // Its lease is kept (the call may still charge): expired, a replica sends the same key again (a 409
    // while the first request still runs in the emulator, then its replay).
    await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
    await replica();
    await waitUntil(() => settled(op), 90_000, 'settled by another replica');
    expect(charges(op)).toHaveLength(1);
  }, 120_000);

  it('a second signal during the drain exits at once, without waiting for the calls', async () => {
    const a = await replica({ SHUTDOWN_GRACE_MS: '20000', STRIPE_TIMEOUT_MS: '16000', LEASE_TTL_MS: '18000' });
    e.emulator.addFault({ fault: { kind: 'latency', ms: 15_000 }, count: Infinity });
    const op = await confirm(t);
    await waitUntil(() => createsFor(op).length === 1, 20_000, 'a call in flight');
    a.kill('SIGTERM');
    await waitUntil(async () => (await a.get('/readyz').catch(() => ({ status: 0 }))).status === 503, 5_000, 'draining');
    // A person's second signal, not the first delivered twice (which comes within milliseconds, and is one).
    await new Promise((resolve) => setTimeout(resolve, 500));
    const second = Date.now();
    a.kill('SIGTERM');
    const { code } = await a.exited;
    expect(code).toBe(143);
    expect(Date.now() - second).toBeLessThan(5_000); // the call in flight had 9 s or more to run
    // Nothing is lost: the lease expires and the operation is still driven (here, by a new replica).
    e.emulator.clearFaults();
    await replica();
    await waitUntil(() => settled(op), 60_000, 'settled after the hard exit');
    expect(charges(op)).toHaveLength(1);
  });

  it('Ctrl-C to the process group of a worker run from the sources without type stripping (Node 22.12–22.17, re-run by bin/outboxd.js): one signal, forwarded too, still drains', async () => {
    const a = await startReplica(
      { DATABASE_URL: t.url, STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: '', WORKER_CONCURRENCY: '4', STRIPE_TIMEOUT_MS: '8000', LEASE_TTL_MS: '10000', SHUTDOWN_GRACE_MS: '20000' },
      { nodeArgs: ['--no-experimental-strip-types'], group: true },
    );
    replicas.push(a);
    e.emulator.addFault({ fault: { kind: 'latency', ms: 2_000 }, count: 1 });
    const op = await confirm(t);
    await waitUntil(() => createsFor(op).length === 1, 20_000, 'a call in flight');
    a.killGroup('SIGINT');
    expect((await a.exited).code).toBe(0);
    expect(a.logs.find((l) => l.msg === 'worker stopped')).toMatchObject({ finished: true });
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', lease_owner: null });
  });

  it('kill -9 while the call is in flight: another replica takes over after the lease, same key, one charge', async () => {
    const a = await replica();
    const op = await confirm(t);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 1500 } });
    await waitUntil(() => createsFor(op).length === 1, 20_000, 'the first create');
    a.kill('SIGKILL');
    const b = await replica();
    const started = Date.now();
    await waitUntil(() => settled(op), 60_000, 'takeover settles');
    expect(Date.now() - started).toBeLessThan(60_000);
    expect((await operation(t, op)).status).toBe('succeeded');
    expect(charges(op)).toHaveLength(1);
    expect(createsFor(op).map((r) => r.idempotencyKey)).toEqual([idempotencyKeyFor(op), idempotencyKeyFor(op)]);
    expect(await b.metric('outboxd_lease_takeovers_total')).toBe(1);
  });

  it('kill -9 while a refund is in flight: another replica takes over after the lease, same key, one refund', async () => {
    const a = await replica();
    const customer = 'cus_refund_kill9';
    // The refund's create is slow (matched by the charge's customer: the refund's id is not known yet).
    e.emulator.addFault({ endpoint: 'create_refund', match: { customer }, fault: { kind: 'latency', ms: 1500 } });
    const charge = await confirm(t, { customer });
    await waitUntil(() => settled(charge), 30_000, 'the charge');
    const { operationId: op } = await inTransaction(t.pool, (tx) => requestRefund(tx, { chargeOperationId: charge, amount: 1000, key: 'kill-9' }));
    const refundCreates = () => e.emulator.requests().filter((r) => r.endpoint === 'create_refund' && r.operationId === op);
    await waitUntil(() => refundCreates().length === 1, 20_000, 'the refund’s first create');
    a.kill('SIGKILL');
    const b = await replica();
    await waitUntil(() => settled(op), 60_000, 'takeover settles the refund');
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', external_id: expect.stringMatching(/^re_/) });
    expect(e.emulator.refundLedger().filter((r) => r.refund.metadata.operation_id === op)).toHaveLength(1);
    expect(refundCreates().map((r) => r.idempotencyKey)).toEqual([refundIdempotencyKeyFor(op), refundIdempotencyKeyFor(op)]);
    expect(await b.metric('outboxd_lease_takeovers_total')).toBe(1);
    expect(await b.metric('outboxd_gateway_outcomes_total{call="create",outcome="succeeded",kind="refund",policy="idempotent-key"}')).toBe(1);
  });

  it('a replica SIGSTOPped past its lease gives its call up (or is fenced out) when it resumes; the status stays as the other wrote it', async () => {
    const a = await replica();
    const op = await confirm(t);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 1000 } });
    await waitUntil(() => createsFor(op).length === 1, 20_000, 'the first create');
    a.kill('SIGSTOP');
    const b = await replica();
    await waitUntil(() => settled(op), 60_000, 'the second replica settles');
    const settledByB = await operation(t, op);
    expect(settledByB.status).toBe('succeeded');
    a.kill('SIGCONT');
    // Past its own lease deadline it gives the call up, recording nothing; had its outcome come first,
    // the write would be fenced out.
    const stopped = (l: Record<string, unknown>) => String(l.msg).startsWith('call abandoned') || l.msg === 'fenced out: another claim owns this operation; abandoning the job';
    await waitUntil(() => a.logs.some(stopped), 20_000, 'the stale replica to stop');
    const after = await operation(t, op);
    expect(after).toMatchObject({ status: 'succeeded', fence: settledByB.fence, external_id: settledByB.external_id, settled_at: settledByB.settled_at });
    expect(charges(op)).toHaveLength(1);
    expect(await b.metric('outboxd_fenced_out_writes_total')).toBe(0);
  });

  it('a claim made ahead that waits past its lease (the replica stopped) sends nothing and is not counted: its operation settles at one attempt', async () => {
    e.emulator.addFault({ fault: { kind: 'latency', ms: 1500 }, count: Infinity });
    const ops = await Promise.all(Array.from({ length: 4 }, () => confirm(t)));
    await relay(t);
    const a = await replica({ WORKER_CONCURRENCY: '2' }); // 3 s leases
    await waitUntil(() => ops.filter((op) => createsFor(op).length === 1).length === 2, 20_000, 'two calls in flight');
    const waiting = ops.filter((op) => createsFor(op).length === 0);
    await waitUntil(async () => (await Promise.all(waiting.map((op) => operation(t, op)))).every((o) => o.attempts === 1), 5_000, 'the claims made ahead');
    a.kill('SIGSTOP');
    await new Promise((resolve) => setTimeout(resolve, 4_000)); // past the leases, with no renewal
    e.emulator.clearFaults();
    a.kill('SIGCONT');
    await waitUntil(async () => (await Promise.all(ops.map(settled))).every(Boolean), 60_000, 'all settled');
    for (const op of waiting) {
      expect(createsFor(op)).toHaveLength(1);
      expect(await operation(t, op)).toMatchObject({ status: 'succeeded', attempts: 1, possible_duplicates: 0 });
    }
    for (const op of ops) expect(charges(op)).toHaveLength(1);
  });

  it('SIGTERM during in-flight calls: /readyz turns unready, the calls finish, exit 0, nothing left leased', async () => {
    const a = await replica({ STRIPE_TIMEOUT_MS: '6000', LEASE_TTL_MS: '8000' });
    e.emulator.addFault({ fault: { kind: 'latency', ms: 1500 }, count: Infinity });
    const ops = await Promise.all(Array.from({ length: 4 }, () => confirm(t)));
    await waitUntil(() => ops.every((op) => createsFor(op).length === 1), 20_000, 'four calls in flight');
    expect((await a.get('/readyz')).status).toBe(200);
    const termAt = Date.now();
    a.kill('SIGTERM');
    await waitUntil(async () => (await a.get('/readyz').catch(() => ({ status: 0 }))).status === 503, 5_000, 'unready');
    const { code } = await a.exited;
    expect(code).toBe(0);
    expect(Date.now() - termAt).toBeLessThan(10_000);
    for (const op of ops) expect(await operation(t, op)).toMatchObject({ status: 'succeeded', lease_owner: null });
  });

  it('SIGTERM: claims made ahead of a slot are given back uncounted, with no key window opened; another replica settles them', async () => {
    e.emulator.addFault({ fault: { kind: 'latency', ms: 4_000 }, count: Infinity });
    const ops = await Promise.all(Array.from({ length: 4 }, () => confirm(t)));
    await relay(t); // four jobs waiting: the two loops fetch two each, two slots run two calls
    const a = await replica({ WORKER_CONCURRENCY: '2', STRIPE_TIMEOUT_MS: '6000', LEASE_TTL_MS: '8000' });
    await waitUntil(() => ops.filter((op) => createsFor(op).length === 1).length === 2, 20_000, 'two calls in flight');
    const waiting = ops.filter((op) => createsFor(op).length === 0);
    // The other two are claimed ahead (two claims per slot): leased, their create counted, not sent.
    await waitUntil(async () => (await Promise.all(waiting.map((op) => operation(t, op)))).every((o) => o.lease_owner !== null), 5_000, 'the claims made ahead');
    for (const op of waiting) expect(await operation(t, op)).toMatchObject({ status: 'pending', attempts: 1, fence: 1, first_attempted_at: expect.any(Date) });
    a.kill('SIGTERM');
    expect((await a.exited).code).toBe(0);
    const waited = ops.filter((op) => createsFor(op).length === 0);
    expect(waited).toEqual(waiting);
    for (const op of waited) {
      expect(await operation(t, op)).toMatchObject({ status: 'pending', attempts: 0, fence: 1, lease_owner: null, first_attempted_at: null, last_attempted_at: null });
    }
    e.emulator.clearFaults();
    await replica();
    await waitUntil(async () => (await Promise.all(ops.map(settled))).every(Boolean), 30_000, 'all settled');
    for (const op of ops) expect(charges(op)).toHaveLength(1);
  });

  it('while calls are in flight no worker session is in a transaction (pg_stat_activity)', async () => {
    const a = await replica({ WORKER_CONCURRENCY: '6', STRIPE_TIMEOUT_MS: '10000', LEASE_TTL_MS: '12000' });
    e.emulator.addFault({ fault: { kind: 'latency', ms: 6_000 }, count: Infinity });
    const ops = await Promise.all(Array.from({ length: 6 }, () => confirm(t)));
    await waitUntil(() => ops.every((op) => createsFor(op).length === 1), 20_000, 'six calls in flight');
    const observer = new pg.Client({ connectionString: t.url });
    await observer.connect();
    // The relay and lease renewals run meanwhile and may be caught 'active', or between two statements of
    // their transactions for a moment; none may hold a transaction open across a call (6 s here).
    const { rows } = await observer.query(
      `select state, query, now() - state_change as for from pg_stat_activity
       where application_name = 'outboxd-worker' and datname = current_database()
         and state like 'idle in transaction%' and now() - state_change > interval '50 milliseconds'`,
    );
    await observer.end();
    expect(await a.metric('outboxd_in_flight')).toBe(6);
    expect(rows).toEqual([]);
    await waitUntil(async () => (await Promise.all(ops.map(settled))).every(Boolean), 20_000, 'settled');
  });
});

describe('dispatcher (in-process)', () => {
  const dispatcher = (workerId: string, opts: Parameters<typeof startDispatcher>[3] = {}) => startDispatcher(t, e.gateway({ timeoutMs: 10_000 }), workerId, opts);

  it("one job's claim failing fails that job alone, not the others fetched with it", async () => {
    const [ok, poisoned] = [await confirm(t), await confirm(t)];
    await relay(t); // both jobs wait when the loop first fetches: one batch
    // The claims of `poisoned` fail twice (the batch's statement, then its own, sent alone), as a
    // statement the server refused.
    let refusals = 2;
    const pool = new Proxy(t.pool, {
      get(target, prop, receiver) {
        if (prop !== 'query') return Reflect.get(target, prop, receiver);
        return (q: pg.QueryConfig) => {
          if (q.name?.startsWith('outboxd_claim_attempts') && JSON.stringify(q.values).includes(poisoned) && refusals-- > 0) {
            return Promise.reject(Object.assign(new pg.DatabaseError('canceling statement due to statement timeout', 0, 'error'), { code: '57014' }));
          }
          return target.query(q);
        };
      },
    });
    const replica = await dispatcher('claim-refused', { concurrency: 2, fetchBatch: 2, pool });
    const jobOf = async (op: string) => (await t.pool.query(`select state, retry_count from pgboss.job where name = 'charge' and data->>'operationId' = $1`, [op])).rows;
    try {
      await waitUntil(async () => (await Promise.all([ok, poisoned].map((op) => operation(t, op)))).every((o) => o.status === 'succeeded'), 30_000, 'both settled');
      expect(refusals).toBeLessThan(1);
      await waitUntil(async () => (await jobOf(ok))[0]?.state === 'completed', 10_000, "ok's job completed");
      // Its job completed at its first delivery: no retry spent for the other's failure.
      expect(await jobOf(ok)).toEqual([{ state: 'completed', retry_count: 0 }]);
    } finally {
      await replica.stop();
    }
  });

  it('a reconcile cron pg-boss refuses stops the start before any work loop claims an operation', async () => {
    const ops = [await confirm(t), await confirm(t), await confirm(t)];
    await relay(t);
    const gateway = e.gateway({ timeoutMs: 10_000 });
    const boss = createBoss(t.url, 'worker', 3, t.schema, t.url);
    boss.on('error', () => {});
    await boss.start();
    const refused = new Dispatcher(
      { boss, pool: t.pool, gateway, log: createLogger('silent'), metrics: createMetrics({ db: t.pool, boss }), kinds: kindsFor(gateway) },
      { workerId: 'bad-cron', concurrency: 2, leaseTtlMs: 12_000, reconcileCron: '*/5 * * * * * *' },
    );
    try {
      await expect(refused.start()).rejects.toThrow(/cron/i);
      // A work loop begun fetches at once, then every half second: it would have claimed by now.
      await new Promise((resolve) => setTimeout(resolve, 1_500));
      for (const op of ops) expect(await operation(t, op)).toMatchObject({ status: 'pending', attempts: 0, lease_owner: null });
    } finally {
      await refused.drain(0);
      await boss.stop({ graceful: false });
    }
    const replica = await dispatcher('good-cron');
    try {
      await waitUntil(async () => (await Promise.all(ops.map((op) => operation(t, op)))).every((o) => o.status === 'succeeded'), 30_000, 'settled by a replica started right');
    } finally {
      await replica.stop();
    }
  });

  it('a settled operation costs at most 4 sequential round trips; a redelivery of its job, 3 and no call', async () => {
    // Every statement any client of this process sends, with the pg-boss work() loop it was sent from
    // (each loop runs in a context of its own): a loop's statements are sequential round trips.
    const loops = new AsyncLocalStorage<{ queue: string }>();
    const sent: { loop: { queue: string } | undefined; text: string; name?: string; values: unknown[] }[] = [];
    const query = pg.Client.prototype.query;
    pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
      const q = args[0] as string | pg.QueryConfig;
      const [text, values, name] = typeof q === 'string' ? [q, args[1] as unknown[]] : [q.text, q.values ?? [], q.name];
      sent.push({ loop: loops.getStore(), text, values: values ?? [], ...(name ? { name } : {}) });
      return (query as (...a: unknown[]) => unknown).apply(this, args);
    } as typeof query;
    const jobOf = async (op: string) =>
      (await t.pool.query(`select id, state from pgboss.job where name = 'charge' and data->>'operationId' = $1 order by created_on`, [op])).rows;
    /** The statements of the loop that completed the job, from the fetch that handed the job out to its completion. */
    const path = (jobId: string) => {
      const done = sent.findLast((s) => JSON.stringify(s.values).includes(jobId))!;
      expect(done.loop?.queue, `${done.name ?? ''} ${done.text.slice(0, 300)}`).toBe('charge');
      const ofLoop = sent.filter((s) => s.loop === done.loop);
      const to = ofLoop.indexOf(done);
      const from = ofLoop.slice(0, to).findLastIndex((s) => /^\s*WITH\s+next AS/i.test(s.text)); // pg-boss's fetch
      return ofLoop.slice(from, to + 1).map((s) => s.name?.replace(/_[0-9a-f]{8}$/, '') ?? s.text.trim().split(/\s+/).slice(0, 3).join(' '));
    };
    const op = await confirm(t);
    await relay(t); // its job is waiting when the loop first fetches
    const a = await dispatcher('counted', {
      concurrency: 1,
      beforeStart: (boss) => {
        const work = boss.work.bind(boss) as (...args: unknown[]) => Promise<string>;
        boss.work = ((name: string, ...rest: unknown[]) => loops.run({ queue: name }, () => work(name, ...rest))) as typeof boss.work;
      },
    });
    try {
      await waitUntil(async () => (await jobOf(op))[0]?.state === 'completed', 20_000, 'the job to complete');
      expect((await operation(t, op)).status).toBe('succeeded');
      const settledPath = path((await jobOf(op))[0].id);
      expect(settledPath.length, settledPath.join(' → ')).toBeLessThanOrEqual(4);

      // A redelivered job of the settled operation: fetch, the claim (which reads it settled), completion.
      await t.boss.send('charge', { operationId: op });
      const both = async () => {
        const jobs = await jobOf(op);
        return jobs.length === 2 && jobs.every((j) => j.state === 'completed') ? jobs : undefined;
      };
      const redeliveredPath = path((await waitUntil(both, 20_000, 'the redelivery to complete'))[1].id);
      expect(redeliveredPath.length, redeliveredPath.join(' → ')).toBeLessThanOrEqual(3);
      expect(createsFor(op)).toHaveLength(1);
    } finally {
      pg.Client.prototype.query = query;
      await a.stop();
    }
  });

  it('a malformed job fetched with good ones is dead-lettered alone: the others settle at their first try', async () => {
    const ops = await Promise.all(Array.from({ length: 3 }, () => confirm(t)));
    await relay(t);
    for (const operationId of ['not-a-uuid', 42]) await t.boss.send('charge', { operationId });
    const jobs = async () =>
      (await t.pool.query(`select name, state, retry_count, data->>'operationId' as op from pgboss.job where name in ('charge', 'charge_dead') order by created_on`)).rows;
    const a = await dispatcher('replica-a', { concurrency: 5, fetchBatch: 5 }); // one fetch, one claim statement
    try {
      await waitUntil(async () => (await jobs()).filter((j) => j.name === 'charge_dead' && j.state === 'completed').length === 2, 20_000, 'both dead-lettered');
      for (const op of ops) expect(await operation(t, op)).toMatchObject({ status: 'succeeded', attempts: 1 });
      const all = await jobs();
      expect(all.filter((j) => j.name === 'charge' && ops.includes(j.op))).toEqual(ops.map(() => expect.objectContaining({ state: 'completed', retry_count: 0 })));
      expect(all.filter((j) => j.name === 'charge' && !ops.includes(j.op)).map((j) => j.state)).toEqual(['failed', 'failed']);
    } finally {
      await a.stop();
    }
  });

  it('batches are fetched, yet no slot idles behind a slow call: the other slot drains the rest meanwhile', async () => {
    const slow = await confirm(t);
    const fast = await Promise.all(Array.from({ length: 4 }, () => confirm(t)));
    e.emulator.addFault({ match: { operationId: slow }, fault: { kind: 'latency', ms: 8_000 } });
    await relay(t); // the first loop's batch holds the slow call and a fast one
    const a = await dispatcher('replica-a', { concurrency: 2, fetchBatch: 2 });
    try {
      await waitUntil(async () => (await Promise.all(fast.map(settled))).every(Boolean), 20_000, 'the fast operations');
      expect(createsFor(slow)).toHaveLength(1);
      expect(await settled(slow)).toBe(false); // its call is still in flight
      await waitUntil(() => settled(slow), 20_000, 'the slow operation');
    } finally {
      await a.stop();
    }
  });

  /** Three operations whose calls take `ms`, relayed (`before`: done to them first) before a replica of two
   * slots starts: its two loops fetch all three (two at most each), two calls go out and the third
   * operation is claimed ahead, waiting for a slot. Which one waits is the claims' race. A job enqueued
   * once the calls are in flight would be fetched only by a loop left free, which the fetches' split
   * does not promise. */
  const threeSlowCalls = async (ms: number, before: (ops: string[]) => Promise<unknown> = async () => {}) => {
    const ops = await Promise.all([confirm(t), confirm(t), confirm(t)]);
    for (const op of ops) e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms } });
    await before(ops);
    await relay(t);
    return ops;
  };
  /** Once two of `ops` have their call in flight: the third, whose claim made ahead waits for a slot. */
  const claimWaiting = async (ops: string[]) => {
    await waitUntil(() => ops.filter((op) => createsFor(op).length === 1).length === 2, 10_000, 'two calls');
    const ahead = ops.find((op) => createsFor(op).length === 0)!;
    await waitUntil(async () => (await operation(t, ahead)).lease_owner === 'replica-a', 3_000, 'the third claimed ahead');
    return { ahead, slow: ops.filter((op) => op !== ahead) };
  };
  /** Until the two calls claimWaiting found in flight have settled. */
  const slowSettled = (slow: string[]) => waitUntil(async () => (await Promise.all(slow.map(settled))).every(Boolean), 20_000, 'the slow calls to settle');
  type InProcess = Awaited<ReturnType<typeof dispatcher>>;
  /** Outcomes this replica could not write, its fence moved (a claim made ahead that noticed, or a call). */
  const fencedOut = async (a: InProcess) => (await a.metrics.fencedOut.get()).values[0]?.value ?? 0;
  /** Claims this replica gave back uncounted, each with a fresh job (no retry spent). */
  const rescheduled = async (a: InProcess) => (await a.metrics.jobs.get()).values.find((v) => v.labels.result === 'rescheduled')?.value ?? 0;
  /** Every renewal of `op`'s lease (an update under the same fence to a later lease end) runs `body`
   * (plpgsql) first, until removeRenewalFault. */
  const onRenewalOf = async (op: string, body: string) => {
    await t.pool.query(`create or replace function outboxd.renewal_fault() returns trigger language plpgsql as $$
      begin if new.fence = old.fence and new.lease_expires_at > old.lease_expires_at then ${body}; end if; return new; end $$`);
    await t.pool.query(`create trigger renewal_fault before update on outboxd.payment_operations for each row when (old.id = '${op}') execute function outboxd.renewal_fault()`);
  };
  const removeRenewalFault = async () => {
    await t.pool.query(`select pg_cancel_backend(pid) ${ASLEEP}`);
    await t.pool.query('drop trigger if exists renewal_fault on outboxd.payment_operations; drop function if exists outboxd.renewal_fault()');
  };
  /** This database's sessions in pg_sleep (a renewal a fault holds up), but this one. */
  const ASLEEP = `from pg_stat_activity where wait_event = 'PgSleep' and datname = current_database() and pid <> pg_backend_pid()`;
  const sleeping = async () => Number((await t.pool.query(`select count(*) ${ASLEEP}`)).rows[0].count);

  it('a claim made ahead of a slot and taken over while it waits sends nothing', async () => {
    const ops = await threeSlowCalls(6_000);
    const a = await dispatcher('replica-a', { concurrency: 2, leaseTtlMs: 4_500 });
    try {
      // The waiting claim renews its lease every 1.5 s.
      const { ahead, slow } = await claimWaiting(ops);
      // Another claim takes it (as a takeover or a settlement from outside does: the fence moves).
      await t.pool.query(`update outboxd.payment_operations set fence = fence + 1, lease_owner = 'replica-b', lease_expires_at = now() + interval '1 minute' where id = $1`, [ahead]);
      await slowSettled(slow);
      await waitUntil(async () => (await fencedOut(a)) === 1, 10_000, 'the waiting claim to notice');
      expect(createsFor(ahead)).toHaveLength(0);
      expect(await operation(t, ahead)).toMatchObject({ status: 'pending', lease_owner: 'replica-b' });
    } finally {
      await a.stop();
    }
  });

  it('a claim made ahead of a slot sends nothing for an operation settled from outside while it waited, between its renewals', async () => {
    const ops = await threeSlowCalls(6_000);
    // Renewals every 10 s: none comes between the settlement and the slot.
    const a = await dispatcher('replica-a', { concurrency: 2, leaseTtlMs: 30_000 });
    try {
      const { ahead, slow } = await claimWaiting(ops);
      // A webhook's settlement: no lease needed, the fence raised.
      expect(await settleFromOutside(t.pool, ahead, 'failed', null, 'webhook:payment_intent.canceled', 'canceled')).toMatchObject({ status: 'failed' });
      await slowSettled(slow);
      await waitUntil(async () => (await fencedOut(a)) === 1, 10_000, 'the waiting claim to notice');
      expect(createsFor(ahead)).toHaveLength(0);
      expect(await operation(t, ahead)).toMatchObject({ status: 'failed' });
    } finally {
      await a.stop();
    }
  });

  it('a claim made ahead whose lease cannot be confirmed when its slot comes (the renewal errs) sends nothing: it is given back uncounted', async () => {
    const ops = await threeSlowCalls(6_000);
    const a = await dispatcher('replica-a', { concurrency: 2, leaseTtlMs: 30_000 });
    try {
      const { ahead, slow } = await claimWaiting(ops);
      // Its renewals (the same fence, a later lease end) fail, as with a database that does not answer; a
      // new claim (a new fence) does not.
      await onRenewalOf(ahead, `raise exception 'renewal refused (injected)'`);
      await slowSettled(slow);
      await waitUntil(async () => (await rescheduled(a)) === 1, 10_000, 'the claim given back');
      // Its fresh job's claim (no renewal before its call, its slot free) sends the one create, counted once.
      await waitUntil(() => settled(ahead), 20_000, 'the operation');
      expect(createsFor(ahead)).toHaveLength(1);
      expect(await operation(t, ahead)).toMatchObject({ status: 'succeeded', attempts: 1 });
    } finally {
      await a.stop();
      await removeRenewalFault();
    }
  });

  it('a claim made ahead whose renewal hangs when its slot comes sends nothing, and is given back uncounted once the renewal ends', async () => {
    const ops = await threeSlowCalls(6_000);
    // Renewals every 3 s; the local deadline 8 s after the claim, the last renewal that succeeded.
    const a = await dispatcher('replica-a', { concurrency: 2, leaseTtlMs: 9_000 });
    try {
      const { ahead } = await claimWaiting(ops);
      // From now on its renewals hang: the one in flight when the slot comes (6 s) is the one it confirms with.
      await onRenewalOf(ahead, 'perform pg_sleep(60)');
      // Past the deadline, and past the lock_timeout (5 s) that a give-back queued on the hung renewal's
      // row lock would have met, leaving the claim counted.
      await new Promise((resolve) => setTimeout(resolve, 18_000));
      expect(await sleeping()).toBeGreaterThan(0);
      expect(createsFor(ahead)).toHaveLength(0);
      await removeRenewalFault(); // the renewal ends (cancelled)
      await waitUntil(async () => (await rescheduled(a)) === 1, 10_000, 'the claim given back');
      // Its fresh job's claim sends the one create, counted once: the given-back claim counted nothing.
      await waitUntil(() => settled(ahead), 20_000, 'the operation');
      expect(createsFor(ahead)).toHaveLength(1);
      expect(await operation(t, ahead)).toMatchObject({ status: 'succeeded', attempts: 1 });
    } finally {
      await removeRenewalFault();
      await a.stop();
    }
  });

  it('a drain while a claim made ahead confirms its lease gives it up with the calls in flight: its lease is not released under it, nothing is sent', async () => {
    const ops = await threeSlowCalls(6_000);
    const a = await dispatcher('replica-a', { concurrency: 2, leaseTtlMs: 30_000 });
    try {
      const { ahead } = await claimWaiting(ops);
      // The renewal it confirms with when its slot comes takes 6 s, then succeeds.
      await onRenewalOf(ahead, 'perform pg_sleep(6)');
      await waitUntil(async () => (await sleeping()) > 0, 10_000, 'the confirming renewal');
      // The grace is over at once: the drain gives up what is in flight and releases the other leases.
      await a.dispatcher.drain(0);
      await waitUntil(async () => (await sleeping()) === 0, 15_000, 'the renewal to end');
      await new Promise((resolve) => setTimeout(resolve, 500));
      expect(createsFor(ahead)).toHaveLength(0);
    } finally {
      await removeRenewalFault();
      await a.stop();
    }
  });

  it('a claim made ahead to send a create again never sends it past the key window: it waits no longer, and is claimed anew to reconcile', async () => {
    // Each sent once before with no answer (unknown, no pi_), 23 h less 5 s ago: inside the key window when
    // claimed. Two are sent again at once; the third's claim waits behind their 8 s calls.
    const ops = await threeSlowCalls(8_000, (ids) =>
      t.pool.query(
        `update outboxd.payment_operations
         set status = 'unknown', attempts = 1,
             first_attempted_at = now() - make_interval(secs => $2) + interval '5 seconds',
             last_attempted_at = now() - make_interval(secs => $2) + interval '5 seconds'
         where id = any($1::uuid[])`,
        [ids, KEY_WINDOW_SECONDS],
      ));
    const a = await dispatcher('replica-a', { concurrency: 2 });
    try {
      const { ahead } = await claimWaiting(ops);
      const searched = () => e.emulator.requests().some((r) => r.endpoint === 'search' && r.operationId === ahead);
      await waitUntil(() => searched() || createsFor(ahead).length > 0, 30_000, 'the waiting claim to act');
      expect(createsFor(ahead)).toEqual([]); // a create here would be sent past the window its claim judged
      await waitUntil(async () => (await operation(t, ahead)).review_reason !== null, 10_000, 'no match: held for a person');
      expect(await operation(t, ahead)).toMatchObject({ status: 'unknown', attempts: 2 }); // the search, not a create
    } finally {
      await a.stop();
    }
  });

  it('a replica whose slots are stuck keeps no operation from the others for longer than a lease: its claims made ahead are given back', async () => {
    // An effect that never returns (it honours only the abort at shutdown) holds the only slot (of one, the
    // application's kinds may take it: there is none to keep for the payments).
    const stuck: EffectDefinitions = new Map([
      ['stuck_note', { policy: 'at-least-once', execute: ({ signal }) => new Promise<never>((_, reject) => signal.addEventListener('abort', () => reject(signal.reason))) }],
    ]);
    const a = await dispatcher('replica-a', { concurrency: 1, leaseTtlMs: 4_000, effects: stuck });
    let b: Awaited<ReturnType<typeof dispatcher>> | undefined;
    try {
      await inTransaction(t.pool, (tx) => requestEffect(tx, stuck, 'stuck_note', { key: `stuck-${Date.now()}`, payload: {} }));
      await relay(t);
      await waitUntil(async () => (await a.metrics.inFlight.get()).values[0]?.value === 1, 10_000, 'the slot stuck');
      const op = await confirm(t);
      await relay(t);
      await waitUntil(async () => (await operation(t, op)).lease_owner === 'replica-a', 10_000, 'the charge claimed ahead');
      // Given back within its lease's TTL, with a fresh job (claimed ahead again by this replica, given back
      // again, …, until a replica with a free slot fetches it: no retry spent meanwhile).
      await waitUntil(async () => (await rescheduled(a)) >= 1, 10_000, 'the claim given back');
      b = await dispatcher('replica-b', { concurrency: 2 });
      await waitUntil(() => settled(op), 60_000, 'another replica to settle it');
      expect(createsFor(op)).toHaveLength(1);
      // Every claim given back was uncounted: one attempt, the one that charged.
      expect(await operation(t, op)).toMatchObject({ status: 'succeeded', attempts: 1 });
    } finally {
      await b?.stop();
      await a.stop();
    }
  });

  it('a replica keeps nothing of the operations it settled: live promises do not grow with them', async () => {
    // A claim waiting for a slot listens for the drain: a listener left behind by each job (a promise per
    // job chained to one that resolves only at SIGTERM) grew a replica by ~570 bytes an operation.
    const livePromises = () => queryObjects(Promise, { format: 'count' }) as number; // after a full GC
    const a = await dispatcher('replica-a', { concurrency: 4 });
    const settle = async (n: number) => {
      const ops = await Promise.all(Array.from({ length: n }, () => confirm(t)));
      await relay(t);
      await waitUntil(async () => (await Promise.all(ops.map(settled))).every(Boolean), 60_000, `${n} settled`);
      await waitUntil(async () => (await a.metrics.inFlight.get()).values[0]?.value === 0, 10_000, 'idle');
      await new Promise((resolve) => setTimeout(resolve, 500)); // every handler has returned
    };
    try {
      await settle(20); // warm-up: pools, prepared statements, loops
      const before = livePromises();
      await settle(300);
      expect(livePromises() - before).toBeLessThan(150);
    } finally {
      await a.stop();
    }
  });

  it('a job redelivered by pg-boss expiry while its first handler runs waits on the lease: one charge', async () => {
    const op = await confirm(t);
    await relay(t);
    // Shorten this job's expiry so pg-boss's own supervisor hands it out again mid-call.
    await t.pool.query(`update pgboss.job set expire_seconds = 1 where name = 'charge' and data->>'operationId' = $1`, [op]);
    // The call outlasts pg-boss's expiry, its monitor pass and the retry backoff by a wide margin.
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 15_000 } });
    const a = await startDispatcher(t, e.gateway({ timeoutMs: 30_000 }), 'replica-a');
    let b: Awaited<ReturnType<typeof dispatcher>> | undefined;
    try {
      await waitUntil(() => createsFor(op).length === 1, 10_000, 'the first create');
      b = await dispatcher('replica-b');
      const busy = async () => (await a.metrics.leaseBusy.get()).values[0]!.value + (await b!.metrics.leaseBusy.get()).values[0]!.value;
      await waitUntil(async () => (await busy()) >= 1, 20_000, 'the redelivered job to meet the lease');
      expect(await settled(op)).toBe(false);
      await waitUntil(() => settled(op), 40_000, 'settled');
      expect(charges(op)).toHaveLength(1);
      expect(createsFor(op)).toHaveLength(1);
      // The redelivery is the same job: it completes, and no second job was ever made.
      const jobStates = async () =>
        (await t.pool.query(`select state from pgboss.job where name = 'charge' and data->>'operationId' = $1`, [op])).rows;
      await waitUntil(async () => (await jobStates()).every((j) => j.state === 'completed'), 20_000, 'the job to complete');
      expect(await jobStates()).toHaveLength(1);
    } finally {
      await Promise.all([a.stop(), b?.stop()]);
    }
  }, 90_000);

  it('fenced out while the operation stays unsettled (a resolution claimed it and let go): the job is retried, not completed', async () => {
    const op = await confirm(t);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 5_000 } });
    const a = await dispatcher('replica-a');
    try {
      await waitUntil(() => createsFor(op).length === 1, 20_000, 'the first create');
      // A's lease lapses (its renewals failed); an operator's resolution claims the operation, finds its
      // job live, refuses and lets go: the fence has moved, nothing settled it.
      const resolver = await waitUntil(async () => {
        await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
        return acquireLease(t.pool, op, 'resolve:alice', 10_000); // undefined if A's renewal came in between
      }, 5_000, 'the resolution’s claim');
      await releaseLease(t.pool, op, resolver);
      await waitUntil(async () => (await fencedOut(a)) === 1, 20_000, "A's outcome fenced out");
      await waitUntil(() => settled(op), 30_000, 'settled by the job, driven again');
      expect(charges(op)).toHaveLength(1);
      expect(createsFor(op).map((r) => r.idempotencyKey)).toEqual([idempotencyKeyFor(op), idempotencyKeyFor(op)]);
    } finally {
      await a.stop();
    }
  });

  it('unknown operations are re-driven with the same key until settled', async () => {
    const op = await confirm(t);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_before_commit', status: 503 }, count: 2 });
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    const a = await dispatcher('replica-a');
    try {
      await waitUntil(() => settled(op), 30_000, 'settled');
      expect((await operation(t, op)).status).toBe('succeeded');
      expect(createsFor(op).map((r) => [r.idempotencyKey, r.status, r.replayed])).toEqual([
        [idempotencyKeyFor(op), 503, false],
        [idempotencyKeyFor(op), 503, false],
        [idempotencyKeyFor(op), 'truncated', false],
        [idempotencyKeyFor(op), 200, true],
      ]);
      expect(charges(op)).toHaveLength(1);
    } finally {
      await a.stop();
    }
  });

  it('a dead-lettered operation is flagged for review, never silently dropped', async () => {
    const op = await confirm(t);
    await relay(t);
    // Exhaust the retries at once instead of waiting hours of backoff.
    await t.pool.query(`update pgboss.job set retry_limit = 0 where name = 'charge' and data->>'operationId' = $1`, [op]);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_before_commit', status: 503 } });
    const a = await dispatcher('replica-a');
    try {
      await waitUntil(async () => (await operation(t, op)).needs_review, 30_000, 'review flag');
      const flagged = await operation(t, op);
      expect(flagged.status).toBe('unknown');
      expect(flagged.review_reason).toMatch(/dead-lettered.*503/);
      expect(flagged.lease_owner).toBeNull();
    } finally {
      await a.stop();
    }
  });

  it('an idempotency-key misuse is flagged and dead-lettered at once, not retried', async () => {
    const op = await confirm(t);
    // The first create executes and stores a 500 under the key; then the operation's amount changes
    // under it (the bug this guards against): the same key with other parameters → 400 idempotency_error.
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'error_after_commit', status: 500 } });
    const a = await dispatcher('replica-a');
    try {
      await relay(t);
      await waitUntil(async () => (await operation(t, op)).status === 'unknown', 10_000, 'first attempt');
      await t.pool.query(`update outboxd.payment_operations set amount = amount + 1 where id = $1`, [op]);
      const jobs = async () =>
        (await t.pool.query(`select name, state, retry_count from pgboss.job where name in ('charge', 'charge_dead') and data->>'operationId' = $1 order by name`, [op])).rows;
      await waitUntil(async () => (await jobs()).some((j) => j.name === 'charge_dead'), 20_000, 'dead-lettered');
      expect((await jobs())[0]).toEqual({ name: 'charge', state: 'failed', retry_count: 1 });
      await waitUntil(async () => (await operation(t, op)).needs_review, 10_000, 'review flag');
      expect((await operation(t, op)).review_reason).toMatch(/idempotency key misuse/);
      await new Promise((r) => setTimeout(r, 2_500)); // past the first retry's backoff: no retry comes
      expect(createsFor(op).map((r) => r.status)).toEqual([500, 400]);
    } finally {
      await a.stop();
    }
  });

  it('429s are not attempts: they spend no retries, so an operation that only met 429s is never dead-lettered', async () => {
    const op = await confirm(t);
    await relay(t);
    // No retries left: a 429 that spent one would dead-letter the job.
    await t.pool.query(`update pgboss.job set retry_limit = 0 where name = 'charge' and data->>'operationId' = $1`, [op]);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'rate_limit' }, count: 2 });
    const a = await dispatcher('replica-a');
    try {
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 30_000, 'settled');
      expect(await operation(t, op)).toMatchObject({ needs_review: false, first_attempted_at: expect.any(Date) });
      expect(createsFor(op).map((r) => r.status)).toEqual([429, 429, 200]);
      const { rows } = await t.pool.query(`select count(*)::int as n from pgboss.job where name = 'charge_dead' and data->>'operationId' = $1`, [op]);
      expect(rows[0].n).toBe(0);
    } finally {
      await a.stop();
    }
  });
});
