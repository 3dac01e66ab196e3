// Behind PgBouncer in transaction mode, with a pool of two server connections, so that one client's
// consecutive transactions land on different ones: everything an application calls, the CLI, and a worker
// replica as a real process. What needs a session (the migrations' lock, LISTEN) goes to the database
// directly (DATABASE_DIRECT_URL, directConnectionString). Two releases: Debian bookworm's 1.18 (no prepared
// statement survives a transaction, no startup parameter it does not know) and the current one (>= 1.21,
// max_prepared_statements on, as managed poolers run it), where the application's own named statements
// share the transactions outboxd joins.
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { MIGRATION_LOCK } from '../../src/db/migrate.ts';
import { Outboxd } from '../../src/outboxd.ts';
import type { SettlementEvent } from '../../src/outbox/settlements.ts';
import { startReplica, waitUntil, type Replica } from '../../harness/replica.ts';
import { createTestDatabase, inAppTransaction, type TestDb } from '../support/db.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';
import { CURRENT_PGBOUNCER_ROOT, currentPgBouncer, debianPgBouncer, PGBOUNCER, startPgBouncer, type PgBouncerRelease, type RunningPgBouncer } from '../support/pgbouncer.ts';

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
const debian = debianPgBouncer();
if (!debian) throw new Error(`${PGBOUNCER} is missing: install Debian's pgbouncer (npm test does, as root)`);
const current = currentPgBouncer();
// CI makes the current release's root (.ci/run, scripts/ci/pgbouncer-current.sh) and requires it here.
if (!current && process.env.OUTBOXD_REQUIRE_PGBOUNCER_CURRENT === '1') {
  throw new Error(`no PgBouncer >= 1.21 under ${CURRENT_PGBOUNCER_ROOT}: run scripts/ci/pgbouncer-current.sh as root`);
}

const releases = [debian, current]
  .filter((r): r is PgBouncerRelease => r !== undefined)
  .map((release) => ({ release, label: `${release.version}${release.preparedStatements ? ', max_prepared_statements on' : ''}` }));

describe.for(releases)('through PgBouncer $label in transaction mode', ({ release }) => {
  let t: TestDb;
  let e: RunningEmulator;
  let bouncer: RunningPgBouncer;
  let pooled: string;
  let appPool: pg.Pool;
  let app: Outboxd;
  let replica: Replica | undefined;
  const settled: SettlementEvent[] = [];

  beforeAll(async () => {
    [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
    bouncer = await startPgBouncer(t.url, { poolSize: 2, release });
    pooled = bouncer.through(t.url);
    appPool = new pg.Pool({ connectionString: pooled, max: 6 });
    // startWorker reads the worker's settings from the environment, as `outboxd worker` does.
    Object.assign(process.env, { STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: TEST_KEY, LOG_LEVEL: 'silent' });
    app = new Outboxd({ connectionString: pooled, directConnectionString: t.url, schema: t.schema });
    app.defineEffect('pooler_note', { policy: 'at-least-once', execute: async ({ payload }) => ({ noted: payload }) });
  });
  afterAll(async () => {
    await replica?.kill('SIGTERM');
    await replica?.exited;
    await app.stop();
    await appPool.end();
    await t.close();
    await bouncer.stop();
    await e.close();
  });

  function outboxd(...args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
    return new Promise((resolve) => {
      const env = { ...process.env, DATABASE_URL: pooled, DATABASE_DIRECT_URL: t.url, LOG_LEVEL: 'warn' };
      const child = spawn(process.execPath, [BIN, ...args], { env });
      let stdout = '';
      let stderr = '';
      child.stdout.on('data', (d) => (stdout += d));
      child.stderr.on('data', (d) => (stderr += d));
      child.on('exit', (code) => resolve({ code, stdout, stderr }));
    });
  }

  const statusOf = async (id: string) => (await app.getOperation(id))?.status;
  const charge = (i: number) => ({ orderId: `pooled-${i}`, amount: 1000 + i, currency: 'eur', customer: 'cus_pooled', paymentMethod: 'pm_card_visa' });

  it('requests, the CLI, a worker replica, onSettled, refunds and an application effect all work', async () => {
    // The application's transactions, several at once, each joined by requestCharge; where the pooler keeps
    // prepared statements, each also runs the application's own named statement before and after.
    const appStatement = { name: 'app_order_note', text: 'select $1::text as note' };
    const withAppStatements = async <T>(client: pg.PoolClient, fn: () => Promise<T>): Promise<T> => {
      if (!release.preparedStatements) return fn();
      expect((await client.query({ ...appStatement, values: ['before'] })).rows).toEqual([{ note: 'before' }]);
      const result = await fn();
      expect((await client.query({ ...appStatement, values: ['after'] })).rows).toEqual([{ note: 'after' }]);
      return result;
    };
    const requested = await Promise.all(
      Array.from({ length: 6 }, (_, i) => inAppTransaction(appPool, (client) => withAppStatements(client, () => app.requestCharge(client, charge(i))))),
    );
    expect(requested.every((r) => r.created)).toBe(true);
    // The same order again, in another transaction (on another server connection): the same operation.
    const again = await inAppTransaction(appPool, (client) => withAppStatements(client, () => app.requestCharge(client, charge(0))));
    expect(again).toEqual({ operationId: requested[0]!.operationId, created: false });

    const confirmed = await outboxd('order', 'confirm', '--order-id', 'pooled-cli', '--amount', '1999', '--currency', 'EUR', '--customer', 'cus_1', '--payment-method', 'pm_card_visa');
    expect(confirmed.stderr).toBe('');
    expect(confirmed.code).toBe(0);
    const cliOperation = confirmed.stdout.trim();

    await app.onSettled((event) => {
      settled.push(event);
    });
    // Its delivery waits registered, through the pooler, for the NOTIFY it LISTENs for on the direct URL.
    await waitUntil(async () => (await t.pool.query(`select 1 from "${t.schema}".settlement_sleepers`)).rows.length === 1, 10_000, 'the delivery registered');

    replica = await startReplica({ DATABASE_URL: pooled, DATABASE_DIRECT_URL: t.url, STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: TEST_KEY, WORKER_CONCURRENCY: '4' });
    const charges = [...requested.map((r) => r.operationId), cliOperation];
    await waitUntil(async () => (await Promise.all(charges.map(statusOf))).every((s) => s === 'succeeded'), 90_000, 'every charge to succeed');
    await waitUntil(() => charges.every((id) => settled.some((s) => s.operationId === id)), 60_000, 'every settlement to reach onSettled');

    const listed = await outboxd('ops', 'list', '--status', 'succeeded', '--json');
    expect(listed.code).toBe(0);
    expect(JSON.parse(listed.stdout).map((op: { order_id: string }) => op.order_id).sort()).toEqual(['pooled-0', 'pooled-1', 'pooled-2', 'pooled-3', 'pooled-4', 'pooled-5', 'pooled-cli']);

    const refund = await inAppTransaction(appPool, (client) =>
      app.requestRefund(client, { chargeOperationId: requested[1]!.operationId, amount: 500, key: 'pooled-refund' }),
    );
    expect(refund.created).toBe(true);
    await waitUntil(async () => (await statusOf(refund.operationId)) === 'succeeded', 60_000, 'the refund to succeed');

    // The worker inside the application's process, on the pooler as well.
    await app.startWorker({ concurrency: 2 });
    const effect = await inAppTransaction(appPool, (client) => app.requestEffect(client, 'pooler_note', { key: 'note-1', payload: { hello: 'pooler' } }));
    await waitUntil(async () => (await statusOf(effect.operationId)) === 'succeeded', 60_000, 'the effect to succeed');
    expect((await app.getOperation(effect.operationId))?.result).toEqual({ noted: { hello: 'pooler' } });
    await waitUntil(() => settled.some((s) => s.operationId === effect.operationId), 60_000, 'the effect’s settlement');

    // The replica and the subscription LISTEN on the direct URL (a pooler would lose the session).
    const listeners = async () =>
      (
        await t.pool.query(
          `select application_name from pg_stat_activity
           where datname = current_database() and (query like 'LISTEN%' or query like '%pg_listening_channels%') order by 1`,
        )
      ).rows.map((r) => r.application_name);
    await waitUntil(async () => {
      const names = await listeners();
      return names.includes('outboxd-boss-worker') && names.includes('outboxd-boss-subscriber');
    }, 30_000, 'the LISTEN sessions on the direct URL');

    // Nothing the replica did failed on the pooler, and PgBouncer refused no startup parameter.
    const failures = replica.logs.filter((l) => typeof l.level === 'number' && l.level >= 50);
    expect(failures).toEqual([]);
    expect(replica.logs.some((l) => typeof l.msg === 'string' && /prepared statement/.test(JSON.stringify(l)))).toBe(false);
    expect(bouncer.log()).not.toMatch(/unsupported startup parameter/);
  }, 300_000);

  it("`outboxd order follow` beside DATABASE_DIRECT_URL subscribes, and marks the example's order paid", async () => {
    const env = { ...process.env, DATABASE_URL: pooled, DATABASE_DIRECT_URL: t.url, LOG_LEVEL: 'info' };
    const follower = spawn(process.execPath, [BIN, 'order', 'follow'], { env, stdio: ['ignore', 'ignore', 'pipe'] });
    const exited = new Promise<number | null>((resolve) => follower.once('exit', resolve));
    let stderr = '';
    follower.stderr!.on('data', (d) => (stderr += d));
    try {
      await Promise.race([
        waitUntil(() => stderr.includes('following settlements'), 60_000, 'the follower subscribed'),
        exited.then((code) => Promise.reject(new Error(`order follow exited ${code}: ${stderr}`))),
      ]);
      const confirmed = await outboxd('order', 'confirm', '--order-id', 'pooled-follow', '--amount', '1999', '--currency', 'EUR', '--customer', 'cus_1', '--payment-method', 'pm_card_visa');
      expect(confirmed.code).toBe(0);
      const status = async () => (await t.pool.query(`select status from "${t.schema}".orders where id = 'pooled-follow'`)).rows[0]?.status;
      await waitUntil(async () => (await status()) === 'paid', 60_000, 'the example order paid');
    } finally {
      follower.kill('SIGTERM');
    }
    expect(await exited).toBe(0);
  }, 120_000);

  it('a migration through the pooler is refused before it takes its lock, naming DATABASE_DIRECT_URL; the database itself migrates', async () => {
    // The migrations' own lock (a bigint key: its low 32 bits in objid); the replica and pg-boss take
    // others, for a moment, while this test runs.
    const heldLocks = async () => (await t.pool.query(`select count(*)::int as n from pg_locks l join pg_database d on d.oid = l.database
      where l.locktype = 'advisory' and d.datname = current_database() and l.classid = 0 and l.objid = $1 and l.objsubid = 1`, [MIGRATION_LOCK])).rows[0].n;
    // Run again and again, as a deploy's migrate Job is: each time refused, none left waiting on a lock.
    const env = { ...process.env, DATABASE_URL: pooled, DATABASE_DIRECT_URL: '', OUTBOXD_SCHEMA: t.schema, LOG_LEVEL: 'warn' };
    for (let run = 0; run < 3; run++) {
      const child = spawn(process.execPath, [BIN, 'migrate'], { env });
      let stderr = '';
      child.stderr.on('data', (d) => (stderr += d));
      expect(await new Promise((resolve) => child.on('exit', resolve))).toBe(2);
      expect(stderr).toMatch(/through a transaction pooler .*DATABASE_DIRECT_URL/);
    }
    const pool = new pg.Pool({ connectionString: pooled, max: 2 });
    try {
      await expect(new Outboxd({ pool, schema: t.schema }).migrate()).rejects.toMatchObject({ name: 'ConfigError', message: expect.stringMatching(/directConnectionString/) });
    } finally {
      await pool.end();
    }
    expect(await heldLocks()).toBe(0);
    await new Outboxd({ pool: appPool, directConnectionString: t.url, schema: t.schema }).migrate();
    expect(await heldLocks()).toBe(0);
  }, 60_000);

  it("the pooler's URL given alone (no direct URL) is refused, naming it, before outboxd sets anything on the pooler's server connections", async () => {
    const other = new pg.Client({ connectionString: pooled });
    await other.connect();
    const settings = async () => (await other.query(`select current_setting('statement_timeout') as statement, current_setting('lock_timeout') as lock`)).rows[0];
    const before = await settings();
    const alone = new Outboxd({ connectionString: pooled, schema: t.schema, onError: () => {} });
    try {
      await expect(alone.getOperation('01a250ea-b374-72a1-a09b-47875df2b840')).rejects.toMatchObject({ name: 'ConfigError', message: expect.stringMatching(/through a transaction pooler .*directConnectionString/) });
      // The pooler's other clients keep their own settings (both of its server connections asked).
      for (let i = 0; i < 4; i++) expect(await settings()).toEqual(before);
      const env = { ...process.env, DATABASE_URL: pooled, DATABASE_DIRECT_URL: '', OUTBOXD_SCHEMA: t.schema, LOG_LEVEL: 'warn' };
      // A command, and a worker, which would otherwise start and retry its loops for ever.
      for (const args of [['ops', 'list'], ['worker']]) {
        const child = spawn(process.execPath, [BIN, ...args], { env: { ...env, HTTP_PORT: '0' } });
        let stderr = '';
        child.stderr.on('data', (d) => (stderr += d));
        const exited = new Promise((resolve) => child.on('exit', resolve));
        const late = setTimeout(() => child.kill('SIGKILL'), 20_000);
        expect(await exited, args.join(' ')).toBe(2);
        clearTimeout(late);
        expect(stderr).toMatch(/through a transaction pooler .*DATABASE_DIRECT_URL/);
      }
    } finally {
      await alone.stop();
      await other.end();
    }
  }, 60_000);
});
