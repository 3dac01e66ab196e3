// onSettled(handler, { transactional: true }): the application's writes for a settlement and the record
// that its subscriber consumed it commit in one transaction, fenced on the delivery's claim. The one
// boundary where "exactly once" is true: each subscriber's table sees each event once, through throws,
// timeouts, claims taken over and kill -9 of the application's process.
import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createMetrics } from '../../src/telemetry/metrics.ts';
import { Outboxd, type SettlementTransaction } from '../../src/index.ts';
import { createBoss } from '../../src/outbox/outbox.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { redriveSettlements, SETTLED_DEAD_QUEUE, settledQueueFor, subscribeSettlements } from '../../src/outbox/settlements.ts';
import { waitUntil } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { startEmulator } from '../support/emulator.ts';
import { inTransaction } from '../../src/db/pool.ts';
import { requestCancel, requestCapture } from '../../src/kinds/hold/request.ts';
import { claim, confirm, relay } from '../support/fixtures.ts';
import { CREATE_APPLIED, SUBSCRIBERS } from '../support/settledApp.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

/** Settles a new operation through the executor, without relaying its event. */
async function settleUnrelayed(): Promise<string> {
  const op = await confirm(t);
  await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op));
  return op;
}
async function settle(): Promise<string> {
  const op = await settleUnrelayed();
  await relay(t);
  return op;
}
const subscriberJobs = async (subscriber: string, ops: string[]) =>
  (await t.pool.query(`select state, retry_count from pgboss.job where name = $1 and data->>'operationId' = any($2)`, [settledQueueFor(subscriber), ops])).rows;
const allCompleted = async (subscriber: string, ops: string[]) => {
  const jobs = await subscriberJobs(subscriber, ops);
  return jobs.length === ops.length && jobs.every((j) => j.state === 'completed');
};

describe('transactional subscribers', () => {
  it('each subscriber consumes each event once, in the application’s transaction; a throw rolls both back and redelivers', { timeout: 180_000 }, async () => {
    await t.pool.query('create table receipts (subscriber text not null, operation_id uuid not null)');
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    let thrown = 0;
    await outboxd.onSettled(async (event, tx) => {
      await tx.query('insert into receipts values ($1, $2)', ['mark-paid', event.operationId]);
    }, { transactional: true, subscriber: 'mark-paid' });
    await outboxd.onSettled(async (event, tx) => {
      await tx.query('insert into receipts values ($1, $2)', ['send-receipt', event.operationId]);
      if (thrown++ === 0) throw new Error('the mail service is down');
    }, { transactional: true, subscriber: 'send-receipt' });
    // A named subscriber at least once, beside them: it consumes each event too, whatever they do.
    const notified: string[] = [];
    await outboxd.onSettled((event) => void notified.push(event.operationId), { subscriber: 'notify' });
    try {
      const ops = [await settle(), await settle(), await settle()];
      for (const subscriber of ['mark-paid', 'send-receipt']) {
        await waitUntil(() => allCompleted(subscriber, ops), 60_000, `${subscriber} consumed every event`);
      }
      expect(thrown).toBe(4);
      await waitUntil(() => allCompleted('notify', ops), 30_000, 'notify consumed every event');
      expect(notified.filter((op) => ops.includes(op)).sort()).toEqual([...ops].sort());
      const { rows } = await t.pool.query(`select subscriber, count(*)::int as n from receipts where operation_id = any($1) group by subscriber, operation_id`, [ops]);
      expect(rows).toHaveLength(6);
      expect(rows.every((r) => r.n === 1)).toBe(true);
      const consumed = await t.pool.query(`select subscriber from outboxd.settlement_consumption where operation_id = any($1)`, [ops]);
      expect(consumed.rows).toHaveLength(6);
      // The redelivered one: its first delivery was rolled back, consumption record included.
      expect((await subscriberJobs('send-receipt', ops)).map((j) => j.retry_count).sort()).toEqual([0, 0, 1]);
    } finally {
      await outboxd.stop();
    }
  });

  it('a handler that ends its delivery’s transaction (drizzle’s transaction() over tx: its ROLLBACK swallowed, then its COMMIT) still sees the event consumed once, with its writes', { timeout: 180_000 }, async () => {
    await t.pool.query('create table paid (operation_id uuid not null, attempt int not null)');
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    let calls = 0;
    try {
      await outboxd.onSettled(async (event, tx) => {
        const attempt = ++calls;
        try {
          await drizzle({ client: tx as unknown as pg.PoolClient }).transaction(async (d) => {
            await d.execute(sql`insert into paid values (${event.operationId}, ${attempt})`);
            if (attempt === 1) throw new Error('a check in the handler failed: try again later');
          });
        } catch {
          // logged by the application, and not thrown: its ROLLBACK ended outboxd's transaction too
        }
      }, { transactional: true, subscriber: 'drizzle-app' });
      const op = await settle();
      await waitUntil(async () => (await subscriberJobs('drizzle-app', [op]))[0]?.state === 'completed', 60_000, 'the job completed');
      const consumed = await t.pool.query(`select count(*)::int as n from outboxd.settlement_consumption where subscriber = 'drizzle-app' and operation_id = $1`, [op]);
      expect(consumed.rows[0].n).toBe(1);
      // The first attempt's write rolled back; the second's committed (by drizzle's COMMIT, with the
      // consumption), and the delivery after it found the event consumed and ran nothing.
      expect((await t.pool.query('select attempt from paid where operation_id = $1', [op])).rows).toEqual([{ attempt: 2 }]);
      expect(calls).toBe(2);
    } finally {
      await outboxd.stop();
    }
  });

  it("a handler's statements reach PostgreSQL as it sent them: an object whose text is a getter (a tagged template's), read with the application pool's own parsers", { timeout: 180_000 }, async () => {
    /** As sql-template-tag and sql-template-strings make them: `text` computed on the prototype. */
    class Tagged {
      readonly strings: string[];
      readonly values: unknown[];
      constructor(strings: string[], values: unknown[]) {
        this.strings = strings;
        this.values = values;
      }
      get text(): string {
        return this.strings.reduce((text, part, i) => `${text}$${i}${part}`);
      }
    }
    const TIMESTAMPTZ = pg.types.builtins.TIMESTAMPTZ;
    const own = (oid: number, format?: 'text' | 'binary') => (oid === TIMESTAMPTZ ? (s: string) => `app:${s}` : pg.types.getTypeParser(oid, format));
    const appPool = new pg.Pool({ connectionString: t.url, max: 6, types: { getTypeParser: own as typeof pg.types.getTypeParser } });
    const outboxd = new Outboxd({ pool: appPool, onError: () => {} });
    const read: unknown[] = [];
    try {
      await outboxd.onSettled(async (event, tx) => {
        read.push((await tx.query(new Tagged(['select ', '::uuid as id, now() as at'], [event.operationId]) as never)).rows[0]);
      }, { transactional: true, subscriber: 'tagged' });
      const op = await settle();
      await waitUntil(() => read.length > 0, 30_000, 'the handler');
      expect(read[0]).toEqual({ id: op, at: expect.stringMatching(/^app:/) });
    } finally {
      await outboxd.stop();
      await appPool.end();
    }
  });

  it('its transaction is bounded: statement_timeout is the handler’s timeout, idle_in_transaction_session_timeout a little past it', { timeout: 180_000 }, async () => {
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {}, settlementHandlerTimeoutMs: 1_500 });
    const seen: { statement_timeout: string; idle: string }[] = [];
    let slept = false;
    await outboxd.onSettled(async (_event, tx) => {
      const [{ statement_timeout }] = (await tx.query('show statement_timeout')).rows;
      const [{ idle_in_transaction_session_timeout: idle }] = (await tx.query('show idle_in_transaction_session_timeout')).rows;
      seen.push({ statement_timeout, idle });
      if (!slept) {
        slept = true;
        await tx.query('select pg_sleep(30)'); // cancelled by the statement timeout: rolled back, retried
      }
    }, { transactional: true, subscriber: 'bounded' });
    try {
      const op = await settle();
      await waitUntil(() => allCompleted('bounded', [op]), 60_000, 'the retried delivery completes');
      expect(seen).toEqual([
        { statement_timeout: '1500ms', idle: '7s' },
        { statement_timeout: '1500ms', idle: '7s' },
      ]);
    } finally {
      await outboxd.stop();
    }
  });

  /**
   * The first delivery is abandoned at its 1.5 s timeout while its handler still means to write (after
   * `pause`): that write is refused, and only the redelivery's row is left.
   */
  async function abandonedWriteRefused(table: string, outboxd: Outboxd, pause: (tx: SettlementTransaction) => Promise<unknown>): Promise<void> {
    await t.pool.query(`create table ${table} (operation_id uuid not null, delivery int not null)`);
    let deliveries = 0;
    let refused: unknown;
    await outboxd.onSettled(async (event, tx) => {
      const delivery = ++deliveries;
      if (delivery === 1) {
        await pause(tx);
        refused = await tx.query(`insert into ${table} values ($1, $2)`, [event.operationId, delivery]).then(() => 'written', (err: Error) => err.message);
        return;
      }
      await tx.query(`insert into ${table} values ($1, $2)`, [event.operationId, delivery]);
    }, { transactional: true, subscriber: table });
    const op = await settle();
    await waitUntil(() => refused !== undefined && deliveries >= 2, 60_000, 'the abandoned handler tried to write');
    await waitUntil(() => allCompleted(table, [op]), 30_000, 'the retry committed');
    expect(refused).toMatch(/delivery is over/);
    expect((await t.pool.query(`select delivery from ${table} where operation_id = $1`, [op])).rows).toEqual([{ delivery: 2 }]);
  }

  it('on the application’s own pool, a handler abandoned at its timeout can write nothing afterwards', { timeout: 180_000 }, async () => {
    const appPool = new pg.Pool({ connectionString: t.url, max: 6 });
    const outboxd = new Outboxd({ pool: appPool, onError: () => {}, settlementHandlerTimeoutMs: 1_500 });
    try {
      // Past its timeout: rolled back meanwhile.
      await abandonedWriteRefused('late', outboxd, () => new Promise((resolve) => setTimeout(resolve, 4_000)));
    } finally {
      await outboxd.stop();
      await appPool.end();
    }
  });

  it('a handler whose statement is still running at its timeout writes nothing after it, not even outside the transaction', { timeout: 180_000 }, async () => {
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {}, settlementHandlerTimeoutMs: 1_500 });
    try {
      // Its last statement starts before the timeout and ends after it (within its own statement_timeout):
      // pg-boss's ROLLBACK waits behind it on the connection, and the insert comes after that.
      await abandonedWriteRefused('after_timeout', outboxd, async (tx) => {
        await new Promise((resolve) => setTimeout(resolve, 1_000));
        await tx.query('select pg_sleep(1)');
      });
    } finally {
      await outboxd.stop();
    }
  });

  it('as many as the pool holds with connections to spare, each handler outliving the heartbeat, all commit at their first delivery; one more is refused, naming the pool', { timeout: 240_000 }, async () => {
    // Each holds a connection for each of its deliveries in hand: with none left, pg-boss's heartbeats and
    // fetches waited out its connect timeout, every delivery was retried and none ever committed.
    await t.pool.query('create table slow_receipts (subscriber text not null, operation_id uuid not null)');
    // The workers' pg-boss supervises the queues: it fails a job whose heartbeat lapsed, for a retry.
    const supervisor = createBoss(t.url, 'worker', 2, t.schema);
    supervisor.on('error', () => {});
    await supervisor.start();
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {}, settlementHandlerTimeoutMs: 60_000 });
    const subscribers = ['slow-a', 'slow-b', 'slow-c', 'slow-d'];
    try {
      for (const subscriber of subscribers) {
        await outboxd.onSettled(async (event, tx) => {
          await tx.query('insert into slow_receipts values ($1, $2)', [subscriber, event.operationId]);
          await tx.query('select pg_sleep(35)'); // past the subscriber queues' 30 s heartbeat
        }, { transactional: true, subscriber });
      }
      await expect(outboxd.onSettled(async () => {}, { transactional: true, subscriber: 'one-more' })).rejects.toThrow(/would hold 20 of the 20 connections of outboxd's own pool/);
      const ops = [await settle(), await settle(), await settle(), await settle()];
      for (const subscriber of subscribers) await waitUntil(() => allCompleted(subscriber, ops), 150_000, `${subscriber} consumed every event`);
      for (const subscriber of subscribers) expect((await subscriberJobs(subscriber, ops)).map((j) => j.retry_count)).toEqual([0, 0, 0, 0]);
      const { rows } = await t.pool.query('select subscriber, count(*)::int as n from slow_receipts where operation_id = any($1) group by subscriber order by subscriber', [ops]);
      expect(rows).toEqual(subscribers.map((subscriber) => ({ subscriber, n: 4 })));
    } finally {
      await outboxd.stop();
      await supervisor.stop({ graceful: false });
    }
    // On the application's pool: what it has, less the spare ones.
    const appPool = new pg.Pool({ connectionString: t.url, max: 10 });
    const onAppPool = new Outboxd({ pool: appPool, onError: () => {} });
    try {
      for (const subscriber of ['app-a', 'app-b']) await onAppPool.onSettled(async () => {}, { transactional: true, subscriber });
      await expect(onAppPool.onSettled(async () => {}, { transactional: true, subscriber: 'app-c' })).rejects.toThrow(/would hold 12 of the 10 connections of the application's pool/);
    } finally {
      await onAppPool.stop();
      await appPool.end();
    }
  });

  it("a handler's timeout is taken as at most 14 minutes, said once: pg-boss retries a subscriber's job 15 minutes after its delivery began", { timeout: 60_000 }, async () => {
    const notices: string[] = [];
    const outboxd = new Outboxd({ connectionString: t.url, onError: (err) => notices.push(err.message), settlementHandlerTimeoutMs: 3_600_000 });
    const seen: string[] = [];
    await outboxd.onSettled(async (_event, tx) => {
      seen.push((await tx.query('show statement_timeout')).rows[0].statement_timeout);
    }, { transactional: true, subscriber: 'longest' });
    try {
      const op = await settle();
      await waitUntil(() => allCompleted('longest', [op]), 30_000, 'the delivery');
      expect(seen).toEqual(['14min']);
      expect(notices).toEqual([expect.stringMatching(/settlementHandlerTimeoutMs 3600000 is taken as 840000/)]);
    } finally {
      await outboxd.stop();
    }
  });

  it('a delivery whose claim was taken over commits nothing: the delivery holding the claim does', { timeout: 180_000 }, async () => {
    await t.pool.query('create table ledger (operation_id uuid not null, delivery text not null)');
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {}, settlementHandlerTimeoutMs: 120_000 });
    let deliveries = 0;
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    await outboxd.onSettled(async (event, tx) => {
      const delivery = ++deliveries === 1 ? 'stale' : 'current';
      await tx.query('insert into ledger values ($1, $2)', [event.operationId, delivery]);
      if (delivery === 'stale') await gate;
    }, { transactional: true, subscriber: 'ledger' });
    const queue = settledQueueFor('ledger');
    try {
      const op = await settle();
      await waitUntil(() => deliveries === 1, 30_000, 'the first delivery has written');
      // Its claim is taken away, as expiry or another instance's supervisor does, and the retry claimed.
      const { rows: [job] } = await t.pool.query(`select id from pgboss.job where name = $1 and data->>'operationId' = $2`, [queue, op]);
      await t.boss.fail(queue, job.id, { message: 'claim expired' });
      await waitUntil(async () => (await subscriberJobs('ledger', [op]))[0]?.state === 'active', 30_000, 'the event claimed again');
      // The new delivery's consumption record waits on the stale one's transaction.
      await waitUntil(
        async () => (await t.pool.query(`select 1 from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock' and query like '%settlement_consumption%'`)).rows.length > 0,
        30_000,
        'the current delivery waits on the stale one',
      );
      release();
      await waitUntil(() => allCompleted('ledger', [op]), 30_000, 'the current delivery commits');
      expect((await t.pool.query('select delivery from ledger where operation_id = $1', [op])).rows).toEqual([{ delivery: 'current' }]);
      expect(deliveries).toBe(2);
    } finally {
      release();
      await outboxd.stop();
    }
  });
});

describe('`outboxd settlements redrive`', () => {
  it('sends a subscriber’s dead-lettered event back to that subscriber’s queue; a retired subscriber’s stops no other', async () => {
    await subscribeSettlements(t.boss, 'mark-paid');
    await subscribeSettlements(t.boss, 'retired');
    const dead = async (queue: string) => {
      const op = randomUUID();
      const data = { operationId: op, orderId: null, kind: 'charge', key: null, status: 'succeeded', externalId: null, amount: 1, currency: 'eur', settledAt: new Date().toISOString(), source: 'admin', queue };
      await t.boss.send(SETTLED_DEAD_QUEUE, data);
      return op;
    };
    const op = await dead(settledQueueFor('mark-paid'));
    const orphan = await dead(settledQueueFor('retired'));
    await t.boss.deleteQueue(settledQueueFor('retired'));
    expect(await redriveSettlements(t.pool, t.boss)).toBeGreaterThanOrEqual(1);
    expect(await subscriberJobs('mark-paid', [op])).toEqual([{ state: 'created', retry_count: 0 }]);
    expect((await t.pool.query(`select 1 from outboxd.settlement_outbox where operation_id = $1`, [op])).rows).toEqual([]);
    const left = await t.pool.query(`select state from pgboss.job where name = $1 and data->>'operationId' = any($2) order by state`, [SETTLED_DEAD_QUEUE, [op, orphan]]);
    expect(left.rows).toEqual([{ state: 'completed' }, { state: 'completed' }]);
  });
});

describe('/metrics', () => {
  it('counts the events each named subscriber has not consumed yet', async () => {
    await subscribeSettlements(t.boss, 'metered');
    await settle();
    await settle();
    // A worker's /metrics (its pg-boss supervises, which refreshes the queue counts).
    const boss = createBoss(t.url, 'worker', 2, t.schema);
    boss.on('error', () => {});
    await boss.start();
    const metrics = createMetrics({ db: t.pool, boss });
    const waiting = async () => (await metrics.subscriberEvents.get()).values.find((v) => v.labels.subscriber === 'metered')?.value ?? 0;
    try {
      await waitUntil(async () => (await waiting()) >= 2, 30_000, 'the gauge counts them');
    } finally {
      await boss.stop({ graceful: false });
    }
  });
});

describe('the CLI’s built-in example', () => {
  it('`outboxd order follow` marks the example’s orders paid or payment_failed, in the transaction that consumes each settlement', { timeout: 180_000 }, async () => {
    const follower = spawn(process.execPath, [BIN, 'order', 'follow'], { env: { ...process.env, DATABASE_URL: t.url, LOG_LEVEL: 'info' }, stdio: ['ignore', 'ignore', 'pipe'] });
    const exited = new Promise<number | null>((resolve) => follower.once('exit', resolve));
    let stderr = '';
    follower.stderr!.on('data', (d) => (stderr += d));
    try {
      await waitUntil(() => stderr.includes('following settlements'), 60_000, 'the follower subscribed');
      const paid = await settle();
      const declined = await confirm(t, { paymentMethod: 'pm_card_chargeDeclined' });
      await executeOperation(t.pool, kindsFor(new FakeStripe()), declined, await claim(t, declined));
      await relay(t);
      const statusOf = async (op: string) =>
        (await t.pool.query(`select o.status from outboxd.orders o join outboxd.payment_operations p on p.order_id = o.id where p.id = $1`, [op])).rows[0]?.status;
      await waitUntil(async () => (await statusOf(paid)) === 'paid' && (await statusOf(declined)) === 'payment_failed', 30_000, 'both orders settled');
      const consumed = await t.pool.query(`select operation_id from outboxd.settlement_consumption where subscriber = 'example-orders' order by operation_id`);
      expect(consumed.rows.map((r) => r.operation_id).sort()).toEqual([paid, declined].sort());
    } finally {
      follower.kill('SIGTERM');
    }
    expect(await exited).toBe(0);
  });

  it('`outboxd order follow` marks an authorization’s order authorized (funds held), then paid once captured, or released once cancelled', { timeout: 180_000 }, async () => {
    const e = await startEmulator();
    const follower = spawn(process.execPath, [BIN, 'order', 'follow'], { env: { ...process.env, DATABASE_URL: t.url, LOG_LEVEL: 'info' }, stdio: ['ignore', 'ignore', 'pipe'] });
    const exited = new Promise<number | null>((resolve) => follower.once('exit', resolve));
    let stderr = '';
    follower.stderr!.on('data', (d) => (stderr += d));
    const run = async (op: string) => {
      await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
      await relay(t);
    };
    const statusOf = async (op: string) =>
      (await t.pool.query(`select o.status from outboxd.orders o join outboxd.payment_operations p on p.order_id = o.id where p.id = $1`, [op])).rows[0]?.status;
    try {
      await waitUntil(() => stderr.includes('following settlements'), 60_000, 'the follower subscribed');
      const [shipped, abandoned] = [await confirm(t, { captureMethod: 'manual' }), await confirm(t, { captureMethod: 'manual' })];
      for (const op of [shipped, abandoned]) await run(op);
      await waitUntil(async () => (await statusOf(shipped)) === 'authorized' && (await statusOf(abandoned)) === 'authorized', 30_000, 'both orders authorized');
      const { operationId: capture } = await inTransaction(t.pool, (tx) => requestCapture(tx, { chargeOperationId: shipped, key: 'shipment' }));
      const { operationId: cancel } = await inTransaction(t.pool, (tx) => requestCancel(tx, { chargeOperationId: abandoned, key: 'abandoned' }));
      for (const op of [capture, cancel]) await run(op);
      await waitUntil(async () => (await statusOf(shipped)) === 'paid' && (await statusOf(abandoned)) === 'released', 30_000, 'paid and released');
      // A declined card, then another one's hold on the same order: authorized.
      const orderId = `ord_${randomUUID()}`;
      const declined = await confirm(t, { orderId, captureMethod: 'manual', paymentMethod: 'pm_card_chargeDeclined' });
      await run(declined);
      await waitUntil(async () => (await statusOf(declined)) === 'payment_failed', 30_000, 'the declined card');
      const second = await confirm(t, { orderId, captureMethod: 'manual' });
      await run(second);
      await waitUntil(async () => (await statusOf(second)) === 'authorized', 30_000, 'the second card’s hold');
    } finally {
      follower.kill('SIGTERM');
      await e.close();
    }
    expect(await exited).toBe(0);
  });
});

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
const APP = fileURLToPath(new URL('../support/settledApp.ts', import.meta.url));

/** The application as a process of its own, once both its subscribers are subscribed. */
async function startApp(env: Record<string, string> = {}): Promise<ChildProcess> {
  const child = spawn(process.execPath, [APP], { env: { ...process.env, DATABASE_URL: t.url, ...env }, stdio: ['ignore', 'pipe', 'inherit'] });
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('the application did not subscribe')), 60_000);
    child.stdout!.on('data', (d) => {
      if (String(d).includes('subscribed')) {
        clearTimeout(timer);
        resolve();
      }
    });
    child.once('exit', (code) => reject(new Error(`the application exited with ${code}`)));
  });
  return child;
}

async function kill9(child: ChildProcess): Promise<void> {
  const exited = new Promise((resolve) => child.once('exit', resolve));
  child.kill('SIGKILL');
  await exited;
}

describe('kill -9 of the application process while settlements flow', () => {
  it('leaves exactly one row per settled operation in its table (no unique constraint), for every subscriber', { timeout: 300_000 }, async () => {
    await t.pool.query(CREATE_APPLIED);
    // A worker's pg-boss supervises: a killed process's deliveries come back once their heartbeat is stale.
    const supervisor = createBoss(t.url, 'worker', 2, t.schema);
    supervisor.on('error', () => {});
    await supervisor.start();
    let app = await startApp();
    const settled: string[] = [];
    let kills = 0;
    try {
      while (kills < 6) {
        const started = Date.now();
        while (Date.now() - started < 1_000 + Math.random() * 1_500) {
          for (let i = 0; i < 3; i++) settled.push(await settleUnrelayed());
          await relay(t);
        }
        await kill9(app);
        kills++;
        app = await startApp();
      }
      const counts = async () =>
        (await t.pool.query(
          `select subscriber, count(*)::int as rows, count(distinct operation_id)::int as ops from applied where operation_id = any($1) group by subscriber order by subscriber`,
          [settled],
        )).rows;
      for (const subscriber of SUBSCRIBERS) await waitUntil(() => allCompleted(subscriber, settled), 180_000, `${subscriber} consumed every event`);
      expect(await counts()).toEqual(SUBSCRIBERS.map((subscriber) => ({ subscriber, rows: settled.length, ops: settled.length })).sort((a, b) => a.subscriber.localeCompare(b.subscriber)));
      // The kills landed inside deliveries: some events came back after their process died.
      const redelivered = (await Promise.all(SUBSCRIBERS.map((s) => subscriberJobs(s, settled)))).flat().filter((j) => j.retry_count > 0);
      expect(redelivered.length).toBeGreaterThan(0);
    } finally {
      await kill9(app);
      await supervisor.stop({ graceful: false });
    }
  });
});
