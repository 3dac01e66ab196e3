// Stripe's rate limit as a budget shared by the fleet (src/stripe/budget.ts, budgetedGateway.ts): the
// bucket in PostgreSQL bounds every replica together, dispatch calls go before reconciliation, a wait is
// bounded and is no attempt, and Stripe's 429s are told apart by code. Connect: each connected account's
// requests take from its own bucket and the platform's; one busy account starves neither.
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { RetryLater, type PaymentGateway } from '../../src/stripe/gateway.ts';
import { acquireLease } from '../../src/engine/operation.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { AccountBudgets, Budget, budgetMetrics, type AccountKey, type BudgetMetrics, type Priority } from '../../src/stripe/budget.ts';
import { BudgetedGateway, gatewayMetrics, inBackground, type Budgets } from '../../src/stripe/budgetedGateway.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { claim, confirm, operation } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

let t: TestDb;
let e: RunningEmulator;
/** Two more pools on the test database: two replicas' connections. */
let replicaA: Pool;
let replicaB: Pool;
const budgets: Budget[] = [];
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  replicaA = createPool(t.url, { schema: t.schema, max: 2, applicationName: 'replica-a' });
  replicaB = createPool(t.url, { schema: t.schema, max: 2, applicationName: 'replica-b' });
});
afterAll(async () => {
  for (const b of budgets) b.close();
  await Promise.all([t.close(), e.close(), replicaA.end(), replicaB.end()]);
});
beforeEach(() => e.emulator.reset());

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/** A budget of its own (a bucket row no other test touches). */
function budget(db: Pool, rate: number, name = `test_${randomUUID().slice(0, 8)}`, metrics: BudgetMetrics = budgetMetrics()): Budget {
  const b = new Budget(db, { name, rate, metrics });
  budgets.push(b);
  return b;
}
async function value(metric: { get(): Promise<{ values: { value: number; labels: Record<string, unknown> }[] }> }, labels: Record<string, string> = {}): Promise<number> {
  const { values } = await metric.get();
  return values.filter((v) => Object.entries(labels).every(([k, l]) => v.labels[k] === l)).reduce((sum, v) => sum + v.value, 0);
}

/** `loops` callers taking tokens one after another until `until`; the time each token arrived. */
async function takeUntil(b: Budget, loops: number, until: number, priority: Priority = 'dispatch', grants: number[] = [], account: AccountKey = null): Promise<number[]> {
  await Promise.all(
    Array.from({ length: loops }, async () => {
      while (performance.now() < until) {
        await b.take(priority, Date.now() + 10_000, account);
        grants.push(performance.now());
      }
    }),
  );
  return grants;
}

const request = (id = randomUUID()) => ({
  operationId: id,
  amount: 1000,
  currency: 'eur',
  customer: 'cus_budget',
  paymentMethod: 'pm_card_visa',
  metadata: {},
  idempotencyKey: `payment-op:${id}`,
});

describe('the shared bucket', () => {
  it('two replicas taking at once never get more than rate × elapsed + capacity together, and share it', async () => {
    const rate = 40;
    const name = `fleet_${randomUUID().slice(0, 8)}`;
    const a = budget(replicaA, rate, name);
    const b = budget(replicaB, rate, name);
    const started = performance.now();
    const until = started + 3_000;
    const [fromA, fromB] = await Promise.all([takeUntil(a, 12, until), takeUntil(b, 12, until)]);
    const all = [...fromA, ...fromB].sort((x, y) => x - y);
    // Each prefix: the k-th token arrived no earlier than the bucket could have credited it.
    all.forEach((at, i) => expect(i + 1, `token ${i + 1} at ${Math.round(at - started)} ms`).toBeLessThanOrEqual((rate * (at - started)) / 1000 + a.capacity + 1e-9));
    // Neither replica hoards: each gets a fair part of what the fleet got.
    expect(fromA.length).toBeGreaterThan(all.length * 0.3);
    expect(fromB.length).toBeGreaterThan(all.length * 0.3);
    expect(all.length).toBeGreaterThan(rate); // the budget is used, not merely bounded
  });

  it('its one statement grants atomically: eight sessions taking back to back get no more than the bucket credited', async () => {
    const rate = 200;
    const capacity = 20;
    const name = `atomic_${randomUUID().slice(0, 8)}`;
    const sessions = createPool(t.url, { schema: t.schema, max: 8, applicationName: 'budget-sessions' });
    try {
      await sessions.query(sessions.sql.ensureRateBudget(name));
      const started = performance.now();
      const granted = await Promise.all(
        Array.from({ length: 8 }, async () => {
          let n = 0;
          while (performance.now() - started < 1_500) n += (await sessions.query(sessions.sql.takeRateBudget(name, rate, capacity, 3, false, 1))).rows[0].granted;
          return n;
        }),
      );
      const total = granted.reduce((a, b) => a + b, 0);
      expect(total).toBeLessThanOrEqual((rate * (performance.now() - started)) / 1000 + capacity);
      expect(total).toBeGreaterThan(rate / 2);
    } finally {
      await sessions.end();
    }
  });

  it("a take whose transaction began long before (a process stalled between a pooler's begin and its take) credits no interval twice", async () => {
    const [rate, capacity] = [10, 4];
    const name = `lagging_${randomUUID().slice(0, 8)}`;
    const take = async (db: { query: pg.Pool['query'] }) => (await db.query(t.pool.sql.takeRateBudget(name, rate, capacity, capacity, false, 1))).rows[0].granted as number;
    await t.pool.query(t.pool.sql.ensureRateBudget(name));
    const lagging = new pg.Client({ connectionString: t.url });
    await lagging.connect();
    try {
      await lagging.query('begin'); // its now() is from here
      await sleep(1_600);
      const started = performance.now();
      const first = await take(t.pool); // the bucket full: capacity
      const late = await take(lagging);
      await lagging.query('commit');
      const second = await take(t.pool);
      const elapsed = (performance.now() - started) / 1000;
      expect(first + late + second).toBeLessThanOrEqual(capacity + rate * elapsed + 1);
    } finally {
      await lagging.end();
    }
  });

  it('a replica polls only while calls wait, keeps a small reserve, and never spends a stale token', async () => {
    const metrics = budgetMetrics();
    const b = budget(replicaA, 1_000, undefined, metrics);
    for (let i = 0; i < 20; i++) await b.take('dispatch', Date.now() + 5_000);
    const statements = await value(metrics.statements);
    expect(statements).toBeLessThan(20);
    await sleep(600);
    expect(await value(metrics.statements)).toBe(statements);
    // Whatever was left in the reserve has expired: this call needs the bucket again.
    await b.take('dispatch', Date.now() + 5_000);
    expect(await value(metrics.statements)).toBeGreaterThan(statements);
    expect((await value(metrics.granted)) - (await value(metrics.expired))).toBeGreaterThanOrEqual(21);
  });
});

describe('a database clock that steps back (a failover to a lagging standby)', () => {
  /** The bucket as a clock stepped back by an hour leaves it: refilled and short "in the future". */
  const steppedBack = (name: string) =>
    t.pool.query(`update outboxd.rate_budgets set tokens = 0, refilled_at = now() + interval '1 hour', short_at = now() + interval '1 hour' where name = $1`, [name]);

  it('the bucket keeps refilling, bounded by rate × elapsed + capacity from then on', async () => {
    const rate = 20;
    const name = `stepped_${randomUUID().slice(0, 8)}`;
    const b = budget(replicaA, rate, name);
    await b.take('dispatch', Date.now() + 5_000); // the row exists
    await steppedBack(name);
    const started = performance.now();
    const grants = await takeUntil(b, 4, started + 1_500);
    expect(grants.length).toBeGreaterThan(rate / 2); // not frozen for the hour
    grants.sort((x, y) => x - y).forEach((at, i) => expect(i + 1).toBeLessThanOrEqual((rate * (at - started)) / 1000 + b.capacity + 1e-9));
    const { rows } = await t.pool.query(`select refilled_at <= now() as behind from outboxd.rate_budgets where name = $1`, [name]);
    expect(rows[0].behind).toBe(true);
  });

  it('background takes are not held back for the hour by a shortage recorded "ahead"', async () => {
    const name = `stepped_bg_${randomUUID().slice(0, 8)}`;
    const b = budget(replicaA, 50, name);
    await b.take('dispatch', Date.now() + 5_000);
    await steppedBack(name);
    await b.take('background', Date.now() + 10_000);
  });
});

describe('priority: creates before reconciliation', () => {
  it('in a replica, no background call gets a token while a dispatch call waits', async () => {
    const b = budget(replicaA, 20);
    const order: Priority[] = [];
    const take = (p: Priority) => b.take(p, Date.now() + 10_000).then(() => order.push(p));
    // The background calls came first.
    await Promise.all([...Array.from({ length: 6 }, () => take('background')), ...Array.from({ length: 6 }, () => take('dispatch'))]);
    expect(order).toEqual([...Array(6).fill('dispatch'), ...Array(6).fill('background')]);
  });

  it('across the fleet, background takes get nothing while a dispatch take anywhere came up short', async () => {
    const rate = 20;
    const name = `priority_${randomUUID().slice(0, 8)}`;
    const dispatcher = budget(replicaA, rate, name);
    const sweeper = budget(replicaB, rate, name);
    const started = performance.now();
    const busyUntil = started + 2_500;
    const background: number[] = [];
    const sweeping = takeUntil(sweeper, 2, busyUntil + 1_000, 'background', background);
    const dispatched = await takeUntil(dispatcher, 16, busyUntil);
    const stopped = performance.now();
    await sweeping;
    // While the dispatcher was short the sweeper got nothing (the first instant aside: nobody was short yet).
    expect(background.filter((at) => at < stopped).length).toBeLessThanOrEqual(1);
    expect(dispatched.length).toBeGreaterThan(rate);
    // Once nobody was short for a second, the sweeper had the budget.
    expect(background.filter((at) => at > stopped).length).toBeGreaterThan(0);
  });
});

describe('the budgeted gateway', () => {
  function gateway(budgetsOf: Budgets, maxWaitMs = 5_000, inner: PaymentGateway = e.gateway()) {
    const metrics = gatewayMetrics();
    return { gateway: new BudgetedGateway(inner, { budgets: budgetsOf, maxWaitMs, metrics }), metrics };
  }

  it('a call that gets no token by its deadline is not sent, and fails as RetryLater (not an attempt)', async () => {
    const bm = budgetMetrics();
    const { gateway: g } = gateway({ requests: budget(replicaA, 0.2, undefined, bm) }, 300);
    const err = await g.createCharge(request()).catch((x: unknown) => x);
    expect(err).toBeInstanceOf(RetryLater);
    expect(err).toMatchObject({ code: 'budget' });
    expect(e.emulator.requests()).toHaveLength(0);
    expect(await value(bm.timeouts, { priority: 'dispatch' })).toBe(1);

    // Through the executor: status unchanged, the key window not started.
    const id = await confirm(t);
    const run = await executeOperation(t.pool, kindsFor(g), id, await claim(t, id));
    expect(run.outcome).toMatchObject({ kind: 'rate_limited' });
    expect(run.operation).toMatchObject({ status: 'pending', first_attempted_at: null, last_outcome: 'rate_limited' });
    expect(e.emulator.requests()).toHaveLength(0);
  });

  it('a lock_timeout 429 is sent again after a short delay, leaving the budget alone', async () => {
    const bm = budgetMetrics();
    const { gateway: g, metrics } = gateway({ requests: budget(replicaA, 50, undefined, bm) });
    const req = request();
    e.emulator.addFault({ fault: { kind: 'rate_limit', code: 'lock_timeout' }, match: { operationId: req.operationId }, count: 2 });
    const charge = await g.createCharge(req);
    expect(charge.status).toBe('succeeded');
    expect(e.emulator.requests().map((r) => r.status)).toEqual([429, 429, 200]);
    expect(await value(metrics.rateLimited, { code: 'lock_timeout' })).toBe(2);
    expect(await value(bm.backOffs)).toBe(0);
    // Every send took its token.
    expect(await value(bm.granted)).toBeGreaterThanOrEqual(3);
  });

  it('a rate_limit 429 makes the budget back off; the call waits for a token and is sent again', async () => {
    const bm = budgetMetrics();
    const { gateway: g, metrics } = gateway({ requests: budget(replicaA, 50, undefined, bm) });
    const req = request();
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId: req.operationId } });
    expect((await g.createCharge(req)).status).toBe('succeeded');
    expect(e.emulator.requests().map((r) => r.status)).toEqual([429, 200]);
    expect(await value(metrics.rateLimited, { code: 'rate_limit' })).toBe(1);
    expect(await value(bm.backOffs)).toBe(1);
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it("a write's guard: its wait for a token ends when its call is given up, and its check comes last, before each send (a resend after a 429 too)", async () => {
    const { gateway: empty } = gateway({ requests: budget(replicaA, 0.1) }, 10_000);
    const given = new AbortController();
    const abandoned = new Error('given up (its lease ran out)');
    setTimeout(() => given.abort(abandoned), 300);
    const waitedFrom = performance.now();
    await expect(empty.createCharge({ ...request(), guard: { signal: given.signal, beforeSend: () => given.signal.throwIfAborted() } })).rejects.toBe(abandoned);
    expect(performance.now() - waitedFrom).toBeLessThan(5_000);

    const { gateway: g } = gateway({ requests: budget(replicaA, 50) });
    const req = request();
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId: req.operationId } });
    let checks = 0;
    const lapsed = new Error('past the lease deadline');
    const guard = {
      signal: new AbortController().signal,
      beforeSend: () => {
        if (++checks > 1) throw lapsed;
      },
    };
    await expect(g.createCharge({ ...req, guard })).rejects.toBe(lapsed);
    expect(checks).toBe(2);
    expect(e.emulator.requests().map((r) => r.status)).toEqual([429]);
  });

  it('without a budget, a rate_limit 429 goes back to the caller (the dispatcher reschedules it)', async () => {
    const { gateway: g, metrics } = gateway({});
    const req = request();
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId: req.operationId } });
    await expect(g.createCharge(req)).rejects.toMatchObject({ name: 'RetryLater', code: 'rate_limit', httpStatus: 429 });
    expect(e.emulator.requests()).toHaveLength(1);
    expect(await value(metrics.rateLimited, { code: 'rate_limit' })).toBe(1);
  });

  it('a search takes a search token and an account token; other calls only an account token', async () => {
    const bm = budgetMetrics();
    const requests = budget(replicaA, 50, undefined, bm);
    const search = budget(replicaA, 20, undefined, bm);
    const { gateway: g } = gateway({ requests, search });
    const charge = await g.createCharge(request());
    await g.retrieveCharge(charge.id);
    expect(await value(bm.granted, { budget: search.name })).toBe(0);
    await g.findCharges(randomUUID());
    expect(await value(bm.granted, { budget: search.name })).toBeGreaterThanOrEqual(1);
    const waitedRequests = (await bm.waited.get()).values.find((v) => v.metricName === 'outboxd_stripe_budget_wait_seconds_count' && v.labels.budget === requests.name);
    expect(waitedRequests?.value).toBe(3);
  });

  it('a read that spans pages takes its tokens page by page: a search both kinds, a list the account kind', async () => {
    const bm = budgetMetrics();
    const requests = budget(replicaA, 1000, undefined, bm);
    const search = budget(replicaA, 1000, undefined, bm);
    const { gateway: g } = gateway({ requests, search });
    const takes = async (b: Budget) =>
      (await bm.waited.get()).values.find((v) => v.metricName === 'outboxd_stripe_budget_wait_seconds_count' && v.labels.budget === b.name)?.value ?? 0;
    const operationId = randomUUID();
    const stripe = e.client();
    for (let i = 0; i < 205; i++) {
      await stripe.paymentIntents.create({ amount: 10, currency: 'eur', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: operationId } });
    }
    const sent = (endpoint: string) => e.emulator.requests().filter((r) => r.endpoint === endpoint).length;

    const found = await g.findCharges(operationId);
    expect(new Set(found.map((c) => c.id)).size).toBe(205);
    expect(sent('search')).toBe(3);
    expect(await takes(search)).toBe(3);
    expect(await takes(requests)).toBe(3);

    const listed = await g.listCharges(new Date(0));
    expect(new Set(listed.map((c) => c.id)).size).toBe(205);
    expect(sent('list')).toBe(3);
    expect(await takes(search)).toBe(3);
    expect(await takes(requests)).toBe(6);
  });

  it("an operation's read waits for its pages within the call's deadline; the drift report's, page by page", async () => {
    const bm = budgetMetrics();
    // One token a second, and the bucket starts empty: the first page's token comes after ~1 s, the
    // second's after ~2 s, past the call's deadline (1.5 s) but within its own page's.
    const operationId = randomUUID();
    const stripe = e.client();
    for (let i = 0; i < 101; i++) {
      await stripe.paymentIntents.create({ amount: 10, currency: 'eur', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: operationId } });
    }
    const { gateway: g, metrics } = gateway({ requests: budget(replicaA, 1, undefined, bm) }, 1_500);
    const sent = (endpoint: string) => e.emulator.requests().filter((r) => r.endpoint === endpoint).length;
    // Under a lease the sweep does not renew: the second page is not sent, and nothing is resent.
    await expect(g.findCharges(operationId)).rejects.toMatchObject({ name: 'RetryLater', code: 'budget' });
    expect(sent('search')).toBe(1);
    expect(await value(metrics.rateLimited)).toBe(0);
    expect(await value(bm.backOffs)).toBe(0);
    // Under no lease: every page is sent, each after its token.
    expect(await g.listCharges(new Date(0))).toHaveLength(101);
    expect(sent('list')).toBe(2);
  });
});

describe('waiting for a token holds the operation safely', () => {
  /** Only this test's operations are left to drive. */
  const leaveNothingBehind = async () => {
    await t.pool.query(`delete from outboxd.charge_outbox`);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where status in ('pending', 'unknown')`);
  };

  it('the dispatcher renews its lease while a call waits: no other claim can take it, and it settles once', async () => {
    const name = `lease_${randomUUID().slice(0, 8)}`;
    // The bucket starts empty: the first token comes after 8 s, far past the 3 s lease.
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: budget(replicaA, 0.125, name) }, maxWaitMs: 10_000 });
    await leaveNothingBehind();
    const replica = await startDispatcher(t, g, 'waiting-replica', { leaseTtlMs: 3_000, concurrency: 1 });
    try {
      const id = await confirm(t);
      await waitUntil(async () => (await operation(t, id)).lease_owner, 10_000, 'the claim');
      await sleep(4_500);
      expect(await acquireLease(t.pool, id, 'intruder', 1_000)).toBeUndefined();
      expect(e.emulator.requests()).toHaveLength(0);
      const settled = await waitUntil(async () => {
        const op = await operation(t, id);
        return op.status === 'succeeded' && op;
      }, 15_000, 'the charge to settle');
      expect(settled).toMatchObject({ fence: 1, attempts: 1 });
      expect(e.emulator.ledger()).toHaveLength(1);
      expect(await value(replica.metrics.leaseTakeovers)).toBe(0);
    } finally {
      await replica.stop();
    }
  });

  it('a call whose lease runs out while it waits for a token (its renewals failing) stops waiting and sends nothing, then or once another claim holds the operation', async () => {
    const name = `lapse_${randomUUID().slice(0, 8)}`;
    // The bucket starts empty: its first token comes after 5 s, past the 3 s lease.
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: budget(replicaA, 0.2, name) }, maxWaitMs: 10_000 });
    await leaveNothingBehind();
    const id = await confirm(t);
    // Every renewal of this operation (an update that moves lease_expires_at under the same fence) fails.
    await t.pool.query(`create or replace function outboxd.fail_renewal() returns trigger language plpgsql as $$
      begin if new.fence = old.fence and new.lease_expires_at > old.lease_expires_at then raise exception 'renewal refused (injected)'; end if; return new; end $$`);
    await t.pool.query(`create trigger fail_renewal before update on outboxd.payment_operations for each row when (old.id = '${id}') execute function outboxd.fail_renewal()`);
    const replica = await startDispatcher(t, g, 'lapsing-replica', { leaseTtlMs: 3_000, concurrency: 1 });
    try {
      await waitUntil(async () => (await operation(t, id)).lease_owner === 'lapsing-replica', 10_000, 'the claim');
      // Given up at its deadline: the job is out of the replica's hands before the token could come.
      await waitUntil(async () => (await value(replica.metrics.jobs, { result: 'abandoned' })) === 1, 5_000, 'the call given up');
      const other = await waitUntil(() => acquireLease(t.pool, id, 'other-replica', 60_000), 10_000, 'the lease to expire');
      expect(other).toBe(2);
      // Past the time the bucket had a token for the stale call: it never went out.
      await sleep(4_000);
      expect(e.emulator.requests()).toHaveLength(0);
    } finally {
      await replica.stop();
      await t.pool.query(`drop trigger fail_renewal on outboxd.payment_operations`);
    }
  });

  it('the reconcile sweep yields: once the budget turns it away, it stops and leaves every operation as it was', async () => {
    const log = createLogger('silent');
    const name = `sweep_${randomUUID().slice(0, 8)}`;
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: budget(replicaA, 50, name), search: budget(replicaA, 20, `${name}_search`) }, maxWaitMs: 400 });
    await leaveNothingBehind();
    const ops = [await confirm(t), await confirm(t)];
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = any($1::uuid[])`, [ops]);
    await t.pool.query(
      `update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now() - interval '25 hours' where id = any($1::uuid[])`,
      [ops],
    );
    for (const op of ops) await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } });
    const before = e.emulator.requests().length;
    // A dispatcher elsewhere came up short just now, and keeps being short (further ahead is a clock
    // that stepped back, not a shortage).
    await t.pool.query(`insert into outboxd.rate_budgets (name, tokens, refilled_at, short_at) values ($1, 0, now(), now() + interval '30 seconds'), ($2, 0, now(), now() + interval '30 seconds')`, [name, `${name}_search`]);

    const sweep = () => reconcileSweep(t.pool, g, { owner: 'sweeper', leaseTtlMs: 10_000, log });
    const refused = await sweep();
    expect(refused).toMatchObject({ examined: 2, settled: 0, skipped: 1 });
    expect(refused.decisions).toEqual([expect.objectContaining({ outcome: 'rate_limited', from: 'unknown', to: 'unknown' })]);
    expect(e.emulator.requests()).toHaveLength(before);
    for (const op of ops) expect(await operation(t, op)).toMatchObject({ status: 'unknown', lease_owner: null });

    // Once nobody is short (and this replica's loop has ended its yield), the next sweeps settle them.
    await t.pool.query(`update outboxd.rate_budgets set short_at = null where name like $1`, [`${name}%`]);
    await waitUntil(async () => (await sweep()).examined === 0, 10_000, 'the sweeps to settle both');
    for (const op of ops) expect(await operation(t, op)).toMatchObject({ status: 'succeeded' });
  });

  it('the sweep view takes background priority; any other gateway is left as it is', () => {
    const g = new BudgetedGateway(e.gateway(), { budgets: {}, maxWaitMs: 1 });
    expect(inBackground(g)).toBeInstanceOf(BudgetedGateway);
    expect(inBackground(g)).not.toBe(g);
    const plain = e.gateway();
    expect(inBackground(plain)).toBe(plain);
  });
});

describe("Connect: each connected account's own bucket beside the platform's", () => {
  /** The platform's budget and every account's, on one replica's pool. */
  function connect(db: Pool, rates: { platform: number; account: number }, name = `connect_${randomUUID().slice(0, 8)}`, metrics = budgetMetrics()) {
    const requests = budget(db, rates.platform, name, metrics);
    const accounts = new AccountBudgets(db, { name, rate: rates.account, metrics });
    return { requests, accounts, metrics, close: () => accounts.close() };
  }
  const gatewayOf = (b: ReturnType<typeof connect>, maxWaitMs = 10_000) => new BudgetedGateway(e.gateway(), { budgets: { requests: b.requests, accounts: b.accounts }, maxWaitMs });
  /** `loops` callers on `account` sending retrieves (of nothing: 404) until `until`. */
  const retrieveUntil = (g: BudgetedGateway, account: AccountKey, loops: number, until: number) =>
    Promise.all(
      Array.from({ length: loops }, async () => {
        while (performance.now() < until) await g.retrieveCharge('pi_nothing', account).catch((err: unknown) => expect(err).toMatchObject({ httpStatus: 404 }));
      }),
    );
  /** What the emulator received, each request's time since `started` (its clock is the wall clock). */
  const receivedSince = (startedAt: number, account?: AccountKey) =>
    e.emulator
      .requests()
      .filter((r) => account === undefined || r.account === account)
      .map((r) => r.at - startedAt)
      .sort((x, y) => x - y);
  /** The k-th request came no earlier than a bucket of `rate` and `capacity` (empty at first) allowed. */
  const expectBounded = (sinceStart: number[], rate: number, capacity: number, what: string) =>
    sinceStart.forEach((ms, i) => expect(i + 1, `${what}: request ${i + 1} at ${ms} ms`).toBeLessThanOrEqual((rate * Math.max(0, ms)) / 1000 + capacity + 1));

  it('in a replica, a busy account with many calls waiting holds no other account (or the platform) behind them', async () => {
    const b = budget(replicaA, 20);
    const started = performance.now();
    const until = started + 2_500;
    const [busy, other, platform] = await Promise.all([
      takeUntil(b, 40, until, 'dispatch', [], 'acct_busy'),
      takeUntil(b, 1, until, 'dispatch', [], 'acct_other'),
      takeUntil(b, 1, until, 'dispatch', [], null),
    ]);
    const total = busy.length + other.length + platform.length;
    // Served in turn: each of the two single callers gets one of every few tokens, not 1 in 42.
    expect(other.length).toBeGreaterThan(total / 12);
    expect(platform.length).toBeGreaterThan(total / 12);
    expect(busy.length).toBeGreaterThan(total / 3); // and the busy one has the rest
  });

  it("two replicas, calls spread over eight accounts: the platform's limit holds whatever the accounts' allow", async () => {
    const name = `connect_fleet_${randomUUID().slice(0, 8)}`;
    const [a, b] = [connect(replicaA, { platform: 20, account: 40 }, name), connect(replicaB, { platform: 20, account: 40 }, name)];
    const startedAt = Date.now();
    const until = performance.now() + 2_500;
    const accounts = Array.from({ length: 8 }, (_, i) => `acct_fleet${i}`);
    await Promise.all(accounts.flatMap((acct) => [retrieveUntil(gatewayOf(a), acct, 2, until), retrieveUntil(gatewayOf(b), acct, 2, until)]));
    a.close();
    b.close();
    const all = receivedSince(startedAt);
    expectBounded(all, 20, a.requests.capacity, 'the fleet');
    expect(all.length).toBeGreaterThan(20); // the budget is used, not merely bounded
  });

  it("each account's own limit holds across replicas, another account gets its own in full, and the platform's calls are not held up", async () => {
    const name = `connect_own_${randomUUID().slice(0, 8)}`;
    const rates = { platform: 100, account: 5 };
    const [a, b] = [connect(replicaA, rates, name), connect(replicaB, rates, name)];
    e.emulator.setRateLimit(100, 5); // the emulator counts each account as Stripe may
    try {
      const startedAt = Date.now();
      const seconds = 2.5;
      const until = performance.now() + seconds * 1_000;
      await Promise.all([
        ...['acct_busy', 'acct_other'].flatMap((acct) => [retrieveUntil(gatewayOf(a), acct, 6, until), retrieveUntil(gatewayOf(b), acct, 6, until)]),
        retrieveUntil(gatewayOf(a), null, 1, until),
      ]);
      a.close();
      b.close();
      expect(e.emulator.requests().filter((r) => r.status === 429)).toEqual([]);
      const capacity = a.accounts.for('acct_busy').capacity;
      for (const acct of ['acct_busy', 'acct_other']) {
        const got = receivedSince(startedAt, acct);
        expectBounded(got, rates.account, capacity, acct);
        // Its own bucket, in full: not a share of one bucket for every account (counted within the
        // window: calls that started in it may be sent after it).
        expect(got.filter((ms) => ms <= seconds * 1_000).length, acct).toBeGreaterThan(rates.account * seconds * 0.7);
      }
      // The platform's one caller waited for no account's token.
      expect(receivedSince(startedAt, null).filter((ms) => ms <= seconds * 1_000).length).toBeGreaterThan(rates.account * seconds * 4);
    } finally {
      e.emulator.setRateLimit(null);
    }
  });

  it("every request on a connected account takes that account's token; a platform request does not", async () => {
    // An account's first token comes after a second; the calls may wait 300 ms.
    const b = connect(replicaA, { platform: 1_000, account: 1 });
    const g = gatewayOf(b, 300);
    const calls: [string, (account: AccountKey) => Promise<unknown>][] = [
      ['createCharge', (account) => g.createCharge({ ...request(randomUUID()), account })],
      ['retrieveCharge', (account) => g.retrieveCharge('pi_nothing', account)],
      ['findCharges', (account) => g.findCharges(randomUUID(), account)],
      ['capturePaymentIntent', (account) => g.capturePaymentIntent({ paymentIntent: 'pi_nothing', amount: 1, idempotencyKey: `capture-op:${randomUUID()}`, account })],
      ['cancelPaymentIntent', (account) => g.cancelPaymentIntent({ paymentIntent: 'pi_nothing', reason: null, idempotencyKey: `cancel-op:${randomUUID()}`, account })],
      ['createRefund', (account) => g.createRefund({ operationId: randomUUID(), paymentIntent: 'pi_nothing', amount: 1, reason: null, idempotencyKey: `refund-op:${randomUUID()}`, account })],
      ['retrieveRefund', (account) => g.retrieveRefund('re_nothing', account)],
      ['findRefunds', (account) => g.findRefunds('pi_nothing', account)],
    ];
    // Each on an account of its own, whose bucket is still empty.
    for (const [i, [method, call]] of calls.entries()) {
      const err = await call(`acct_tokens${i}`).catch((x: unknown) => x);
      expect(err, method).toBeInstanceOf(RetryLater);
      expect(err, method).toMatchObject({ code: 'budget' });
      expect(e.emulator.requests(), method).toHaveLength(0);
    }
    // The same calls on the platform are sent at once.
    for (const [method, call] of calls) await call(null).catch((x: unknown) => expect(x, method).not.toBeInstanceOf(RetryLater));
    expect(e.emulator.requests()).toHaveLength(calls.length);
    expect(e.emulator.requests().every((r) => r.account === null)).toBe(true);
    b.close();
  });

  it("a busy account's calls wait for its bucket in at most accountWaiters of a replica's slots: one more is put off at once, naming the account, while the platform's is sent", async () => {
    // The account's first token comes after 2 s.
    const b = connect(replicaA, { platform: 1_000, account: 0.5 });
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: b.requests, accounts: b.accounts }, maxWaitMs: 10_000, accountWaiters: 1 });
    const first = g.retrieveCharge('pi_nothing', 'acct_hot').catch((x: unknown) => x);
    const second = await g.retrieveCharge('pi_nothing', 'acct_hot').catch((x: unknown) => x);
    expect(second).toBeInstanceOf(RetryLater);
    expect(second).toMatchObject({ code: 'budget', account: 'acct_hot' });
    expect(e.emulator.requests()).toHaveLength(0);
    await expect(g.retrieveCharge('pi_nothing', null)).rejects.toMatchObject({ httpStatus: 404 });
    expect(await first).toMatchObject({ httpStatus: 404 }); // sent once its token came
    expect(e.emulator.requests().map((r) => r.account)).toEqual([null, 'acct_hot']);
    b.close();
  });

  /** `charges` charges on `account`, the only operations left to drive, and a gateway over the platform's
   * bucket and the accounts' (at `accountRate`) that lets `accountWaiters` calls wait for one account. */
  async function backlogOn(account: string, charges: number, accountRate: number, accountWaiters: number) {
    const b = connect(replicaA, { platform: 1_000, account: accountRate });
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: b.requests, accounts: b.accounts }, maxWaitMs: 10_000, accountWaiters });
    await t.pool.query(`delete from outboxd.charge_outbox`);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where status in ('pending', 'unknown')`);
    const ops: string[] = [];
    for (let i = 0; i < charges; i++) ops.push(await confirm(t, { stripeAccount: account, amount: 500 + i }));
    return { b, g, ops };
  }

  it("the calls a busy account's bucket put off come back paced at its rate, each after the one before, not all within seconds", async () => {
    const { b, g, ops } = await backlogOn('acct_paced', 10, 0.5, 1);
    const replica = await startDispatcher(t, g, 'paced', { concurrency: 2 });
    try {
      // One waits for the account's token (one each 2 s); the others are put off, one after another.
      const putOff = async () =>
        (await t.pool.query(`select extract(epoch from start_after - now())::float8 as s from pgboss.job where name = 'charge' and state = 'created' and start_after > now() + interval '500 ms' and data->>'operationId' = any($1)`, [ops])).rows.map((r) => r.s as number);
      await waitUntil(async () => (await putOff()).length >= 8, 20_000, 'the backlog put off');
      const later = (await putOff()).sort((x, y) => x - y);
      expect(later.at(-1)).toBeGreaterThan(10); // the 8th put off: about 16 s, where each used to be 1 to 5 s
      expect(e.emulator.requests().length).toBeLessThanOrEqual(3);
    } finally {
      await replica.stop();
      b.close();
    }
  });

  it("a busy account's backlog drains at its rate: each call put off comes back at its turn and is sent, not put off again and again", async () => {
    const { b, g, ops } = await backlogOn('acct_drain', 40, 4, 2);
    const replica = await startDispatcher(t, g, 'drain', { concurrency: 8 });
    try {
      await waitUntil(async () => (await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where status = 'succeeded' and id = any($1)`, [ops])).rows[0].n === ops.length, 60_000, 'the backlog drained');
      // Put off about once each (the first few wait for their tokens instead). Rounded to whole seconds
      // and jittered by a quarter of the delay, they came back together and out of turn: 4.3 each.
      expect(await value(replica.metrics.jobs, { result: 'rescheduled' })).toBeLessThanOrEqual(ops.length * 1.5);
      expect(e.emulator.requests().filter((r) => r.method === 'POST')).toHaveLength(ops.length);
    } finally {
      await replica.stop();
      b.close();
    }
  });

  it("a busy account fast enough for every slot still waits in a bounded share of them: the platform's charge behind its backlog is sent among its first calls, not after them all", async () => {
    // 0.5 s of its rate (20/s) is more than the replica's 8 slots.
    const { b, g } = await backlogOn('acct_fast', 120, 20, 2);
    const platform = await confirm(t, { amount: 777 });
    const replica = await startDispatcher(t, g, 'fast-account', { concurrency: 8 });
    try {
      await waitUntil(async () => (await operation(t, platform)).status === 'succeeded', 30_000, 'the platform charge');
      // Waiting in every slot, the account's calls were sent first-in, first-out: the platform's 121st, after 114 of them.
      const before = e.emulator.requests().filter((r) => r.method === 'POST').findIndex((r) => r.account === null);
      expect(before).toBeLessThan(40);
    } finally {
      await replica.stop();
      b.close();
    }
  });

  it('the pacing starts again once none of its calls waits: put-offs that never came back (a sweep’s, a webhook’s) do not hold the next ones for minutes', async () => {
    const b = connect(replicaA, { platform: 1_000, account: 1 });
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: b.requests, accounts: b.accounts }, maxWaitMs: 10_000, accountWaiters: 1 });
    const retryAfter = (x: unknown) => (x as RetryLater).retryAfterSeconds;
    const waiting = g.retrieveCharge('pi_nothing', 'acct_again').catch((x: unknown) => x);
    const putOff: unknown[] = [];
    for (let i = 0; i < 20; i++) putOff.push(await g.retrieveCharge('pi_nothing', 'acct_again').catch((x: unknown) => x));
    expect(retryAfter(putOff.at(-1))).toBeGreaterThanOrEqual(15);
    await waiting; // its token came; nobody waits now
    const next = g.retrieveCharge('pi_nothing', 'acct_again').catch((x: unknown) => x);
    expect(retryAfter(await g.retrieveCharge('pi_nothing', 'acct_again').catch((x: unknown) => x))).toBeLessThanOrEqual(2);
    await next;
    b.close();
  });

  it("the reconcile sweep turned away by one account's own bucket skips only that account's operations: the platform's are settled", async () => {
    const b = connect(replicaA, { platform: 1_000, account: 0.2 });
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: b.requests, accounts: b.accounts }, maxWaitMs: 300 });
    // Only this test's operations are left to reconcile.
    await t.pool.query(`delete from outboxd.charge_outbox`);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where status in ('pending', 'unknown')`);
    const pastWindow = async (over: Parameters<typeof confirm>[1], age: string) => {
      const op = await confirm(t, over);
      await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now() - interval '25 hours', updated_at = now() - $2::interval where id = $1`, [op, age]);
      return op;
    };
    const [hot, hotToo] = [await pastWindow({ stripeAccount: 'acct_sweephot' }, '3 hours'), await pastWindow({ stripeAccount: 'acct_sweephot' }, '2 hours')];
    const platform = [await pastWindow({}, '1 hour'), await pastWindow({}, '1 hour')];
    for (const op of platform) await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } });
    const report = await reconcileSweep(t.pool, g, { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect(report).toMatchObject({ examined: 4, settled: 2, skipped: 1 });
    expect(report.decisions.map((d) => [d.operationId, d.outcome])).toEqual([[hot, 'rate_limited'], ...platform.map((op) => [op, 'succeeded'])]);
    for (const op of platform) expect((await operation(t, op)).status).toBe('succeeded');
    expect((await operation(t, hotToo)).status).toBe('unknown');
    expect(e.emulator.requests().filter((r) => r.account === 'acct_sweephot')).toHaveLength(0);

    // Stripe's own 429 on that account (its own integration spends the same limit), its bucket full: the
    // same, however long the call may wait.
    const patient = connect(replicaA, { platform: 1_000, account: 1_000 });
    const waits = new BudgetedGateway(e.gateway(), { budgets: { requests: patient.requests, accounts: patient.accounts }, maxWaitMs: 5_000 });
    const [limited, other] = [await pastWindow({ stripeAccount: 'acct_sweeplimited' }, '3 hours'), await pastWindow({}, '1 hour')];
    await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: other } });
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = any($1::uuid[])`, [[hot, hotToo]]);
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, endpoint: 'search', match: { operationId: limited }, count: 100 });
    const again = await reconcileSweep(t.pool, waits, { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect(again.decisions.map((d) => [d.operationId, d.outcome])).toEqual([[limited, 'rate_limited'], [other, 'succeeded']]);

    // One object held by another request (a lock_timeout 429) is that object's: the account's others go on.
    const [locked, sibling] = [await pastWindow({ stripeAccount: 'acct_sweeplocked' }, '3 hours'), await pastWindow({ stripeAccount: 'acct_sweeplocked' }, '2 hours')];
    await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: sibling } }, { stripeAccount: 'acct_sweeplocked' });
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = any($1::uuid[])`, [[limited, other]]);
    e.emulator.addFault({ fault: { kind: 'rate_limit', code: 'lock_timeout' }, endpoint: 'search', match: { operationId: locked }, count: 100 });
    const third = await reconcileSweep(t.pool, waits, { owner: 'sweeper', leaseTtlMs: 10_000, log: createLogger('silent') });
    expect(third.decisions.map((d) => [d.operationId, d.outcome])).toEqual([[locked, 'rate_limited'], [sibling, 'succeeded']]);
    b.close();
    patient.close();
  });

  it("a rate_limit 429 on a connected account backs off that account's budget alone", async () => {
    const b = connect(replicaA, { platform: 1_000, account: 500 });
    const g = gatewayOf(b);
    const req = { ...request(randomUUID()), account: 'acct_limited' };
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId: req.operationId } });
    expect((await g.createCharge(req)).status).toBe('succeeded');
    expect(e.emulator.requests().map((r) => r.status)).toEqual([429, 200]);
    expect(await value(b.metrics.backOffs, { budget: `${b.requests.name}_account` })).toBe(1);
    expect(await value(b.metrics.backOffs, { budget: b.requests.name })).toBe(0);
    b.close();
  });

  it("with no bucket of its own (the default: its limit is the platform's), a connected account's 429 backs nothing off; the call goes back to its caller", async () => {
    const b = connect(replicaA, { platform: 1_000, account: 500 });
    const g = new BudgetedGateway(e.gateway(), { budgets: { requests: b.requests }, maxWaitMs: 10_000 });
    const req = { ...request(randomUUID()), account: 'acct_noisy' };
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId: req.operationId } });
    await expect(g.createCharge(req)).rejects.toMatchObject({ name: 'RetryLater', httpStatus: 429 });
    expect(await value(b.metrics.backOffs, { budget: b.requests.name })).toBe(0);
    // The platform's own 429 still backs the platform off.
    const own = request(randomUUID());
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId: own.operationId } });
    expect((await g.createCharge(own)).status).toBe('succeeded');
    expect(await value(b.metrics.backOffs, { budget: b.requests.name })).toBe(1);
    b.close();
  });

  it('a thousand accounts: Budgets made on first use, dropped once idle, one metrics series for them all, none on the console', async () => {
    const metrics = budgetMetrics();
    const name = `connect_many_${randomUUID().slice(0, 8)}`;
    // Idle for 10 s: making the thousand took over 3 s on a loaded CI machine, so the first were already idle.
    const accounts = new AccountBudgets(replicaA, { name, rate: 1_000, idleMs: 10_000, metrics });
    for (let i = 0; i < 1_000; i += 50) {
      await Promise.all(Array.from({ length: 50 }, (_, j) => accounts.for(`acct_many${i + j}`).take('dispatch', Date.now() + 10_000)));
    }
    expect(accounts.size).toBe(1_000);
    await sleep(10_100);
    await accounts.for('acct_later').take('dispatch', Date.now() + 10_000);
    expect(accounts.size).toBe(1);
    for (const m of [metrics.granted, metrics.statements, metrics.limit]) expect((await m.get()).values.map((v) => v.labels.budget)).toEqual([`${name}_account`]);
    const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.rate_budgets where name like $1`, [`${name}@%`]);
    expect(rows[0].n).toBe(1_001);
    const listed = await t.pool.query(t.pool.sql.rateBudgetStates());
    expect(listed.rows.filter((r: { name: string }) => r.name.startsWith(name))).toEqual([]);
    accounts.close();
  });
});
