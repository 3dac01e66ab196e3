// A rolling upgrade: the next release's migration runs while this release's replicas, an application's
// Outboxd and its in-process worker keep their warm connections (prepared statements included). Its
// columns change nothing for them (no 0A000 `cached plan must not change result type`), this release's
// worker runs on the next release's schema, and the migration itself never queues the application's
// statements behind a lock it waits for.
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { getTableColumns } from 'drizzle-orm';
import { migrate } from '../../src/db/migrate.ts';
import { paymentOperations } from '../../src/db/schema.ts';
import { operationColumns } from '../../src/sql/statements.ts';
import { Outboxd } from '../../src/outboxd.ts';
import { startReplica, waitUntil, type Replica } from '../../harness/replica.ts';
import { createTestDatabase, inAppTransaction, type TestDb } from '../support/db.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';
import { ROOT } from '../support/release.ts';

let t: TestDb;
let e: RunningEmulator;
let appPool: pg.Pool;
let folder: string;
const replicas: Replica[] = [];
const apps: Outboxd[] = [];

/** drizzle/ with the next release's migrations after this release's own. */
async function nextRelease(migrations: { tag: string; sql: string[] }[]): Promise<void> {
  const journalFile = path.join(folder, 'meta/_journal.json');
  const journal = JSON.parse(await readFile(journalFile, 'utf8'));
  for (const m of migrations) {
    const last = journal.entries.at(-1);
    journal.entries.push({ idx: last.idx + 1, version: last.version, when: last.when + 1_000, tag: m.tag, breakpoints: true });
    await writeFile(path.join(folder, `${m.tag}.sql`), m.sql.join('\n--> statement-breakpoint\n'));
  }
  await writeFile(journalFile, JSON.stringify(journal));
}

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  appPool = new pg.Pool({ connectionString: t.url, max: 4 });
  folder = await mkdtemp(path.join(tmpdir(), 'outboxd-next-release-'));
  await cp(path.join(ROOT, 'drizzle'), folder, { recursive: true });
  Object.assign(process.env, { STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: TEST_KEY, LOG_LEVEL: 'silent' });
});
afterAll(async () => {
  for (const r of replicas) r.kill('SIGTERM');
  await Promise.all(replicas.map((r) => r.exited));
  for (const o of apps) await o.stop();
  await appPool.end();
  await t.close();
  await e.close();
  await rm(folder, { recursive: true, force: true });
});

const env = () => ({ DATABASE_URL: t.url, DATABASE_DIRECT_URL: t.url, STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: TEST_KEY, WORKER_CONCURRENCY: '2' });
let n = 0;
const charge = () => ({ orderId: `upgrade-${++n}`, amount: 1000 + n, currency: 'eur', customer: 'cus_up', paymentMethod: 'pm_card_visa' });
const cachedPlanErrors = (logs: Record<string, unknown>[]) => logs.filter((l) => /0A000|cached plan must not change result type/.test(JSON.stringify(l)));

it('the statements name every column of payment_operations (src/db/schema.ts), and only those', () => {
  expect(operationColumns().split(', ').sort()).toEqual(Object.values(getTableColumns(paymentOperations)).map((c) => c.name).sort());
});

describe('the next release’s migration while this release runs', () => {
  it('adds a column to every outboxd table under warm pools: no 0A000, and this release’s worker runs on the new schema', async () => {
    const app = new Outboxd({ connectionString: t.url, schema: t.schema });
    apps.push(app);
    app.defineEffect('upgrade_note', { policy: 'at-least-once', execute: async ({ payload }) => payload });
    replicas.push(await startReplica(env()));
    await app.startWorker({ concurrency: 2 });

    // Warm every connection: charges, refunds and effects settled, each operation read by the application.
    const round = async () => {
      const charges = await Promise.all(Array.from({ length: 4 }, () => inAppTransaction(appPool, (c) => app.requestCharge(c, charge()))));
      const effect = await inAppTransaction(appPool, (c) => app.requestEffect(c, 'upgrade_note', { key: `note-${n}`, payload: { n } }));
      const ids = [...charges.map((c) => c.operationId), effect.operationId];
      await waitUntil(async () => (await Promise.all(ids.map((id) => app.getOperation(id)))).every((op) => op?.status === 'succeeded'), 90_000, 'the round to settle');
      const refund = await inAppTransaction(appPool, (c) => app.requestRefund(c, { chargeOperationId: ids[0]!, amount: 100, key: `r-${n}` }));
      await waitUntil(async () => (await app.getOperation(refund.operationId))?.status === 'succeeded', 60_000, 'the refund to settle');
    };
    await round();

    const { rows: tables } = await t.pool.query(
      `select tablename from pg_tables where schemaname = $1 and tablename not like '\\_\\_%' order by 1`,
      [t.schema],
    );
    expect(tables.length).toBeGreaterThanOrEqual(8);
    await nextRelease([
      { tag: '0900_next_release', sql: tables.map(({ tablename }) => `alter table "outboxd"."${tablename}" add column "next_release" text default 'n+1'`) },
      {
        tag: '0901_next_release_index',
        sql: [
          'drop index concurrently if exists "outboxd"."payment_operations_next_release_idx"',
          'create index concurrently "payment_operations_next_release_idx" on "outboxd"."payment_operations" ("next_release", "updated_at")',
        ],
      },
    ]);
    await migrate(t.url, t.schema, folder);
    const { rows: added } = await t.pool.query(`select count(*)::int as n from information_schema.columns where table_schema = $1 and column_name = 'next_release'`, [t.schema]);
    expect(added[0].n).toBe(tables.length);
    const { rows: index } = await t.pool.query(
      `select i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid join pg_namespace s on s.oid = c.relnamespace
       where s.nspname = $1 and c.relname = 'payment_operations_next_release_idx'`,
      [t.schema],
    );
    expect(index).toEqual([{ indisvalid: true }]);
    await migrate(t.url, t.schema, folder); // applied once, recorded: nothing again

    // The same warm pools go on: the replica, the application's reads and requests, its worker.
    await round();
    // This release's worker, started on the next release's schema, takes over (without a direct URL:
    // DATABASE_URL is its session connection too).
    const first = replicas[0]!;
    first.kill('SIGTERM');
    await first.exited;
    const { DATABASE_DIRECT_URL: _, ...withoutDirectUrl } = env();
    const second = await startReplica(withoutDirectUrl);
    replicas.push(second);
    await round();

    for (const r of replicas) expect(cachedPlanErrors(r.logs)).toEqual([]);
    for (const r of replicas) expect(r.logs.filter((l) => typeof l.level === 'number' && l.level >= 50)).toEqual([]);
  }, 400_000);

  it('a migration waits for a lock a few seconds at most, then fails and changes nothing; run again later, it applies', async () => {
    await nextRelease([{ tag: '0902_next_release_again', sql: ['alter table "outboxd"."payment_operations" add column "next_release_2" text'] }]);
    const holder = await appPool.connect();
    try {
      // An application's long transaction holding a row of the table.
      await holder.query('begin');
      await holder.query(`select id from "${t.schema}".payment_operations limit 1 for update`);
      const started = Date.now();
      const outcome = await Promise.race([
        // drizzle wraps PostgreSQL's error in one of its own.
        migrate(t.url, t.schema, folder).then(() => 'applied', (err: { code?: string; cause?: { code?: string } }) => err.cause?.code ?? err.code ?? String(err)),
        new Promise((resolve) => setTimeout(() => resolve('still waiting after 30 s'), 30_000)),
      ]);
      expect(outcome).toBe('55P03'); // lock_not_available
      expect(Date.now() - started).toBeLessThan(30_000);
    } finally {
      await holder.query('rollback');
      holder.release();
    }
    const { rows: before } = await t.pool.query(`select 1 from information_schema.columns where table_schema = $1 and column_name = 'next_release_2'`, [t.schema]);
    expect(before).toEqual([]);
    await migrate(t.url, t.schema, folder);
    const { rows: after } = await t.pool.query(`select 1 from information_schema.columns where table_schema = $1 and column_name = 'next_release_2'`, [t.schema]);
    expect(after).toHaveLength(1);
  }, 120_000);

  /** A confirmation as `outboxd order confirm` makes it, on `client` inside BEGIN: its order, then its charge. */
  const confirmation = async (app: Outboxd, client: pg.PoolClient) => {
    const order = charge();
    await client.query(`insert into "${t.schema}".orders (id, amount, currency, customer_id, payment_method) values ($1, $2, $3, $4, $5)`,
      [order.orderId, order.amount, order.currency, order.customer, order.paymentMethod]);
    await app.requestCharge(client, order);
  };

  it.each([
    ['charge_outbox before payment_operations', 'charge_outbox', 'payment_operations'],
    ['payment_operations before orders', 'payment_operations', 'orders'],
  ])("a migration altering %s does not deadlock with confirmations under way", async (_, first, second) => {
    await nextRelease([{ tag: `0903_next_release_${first}_${second}`, sql: [`alter table "outboxd"."${first}" add column "next_${first}_${second}" text`, `alter table "outboxd"."${second}" add column "next_${second}_${first}" text`] }]);
    const app = new Outboxd({ connectionString: t.url, schema: t.schema });
    apps.push(app);
    // A confirmation still open (the application does more before it commits), holding its rows.
    const open = await appPool.connect();
    const next = await appPool.connect();
    try {
      await open.query('begin');
      await confirmation(app, open);
      const migrated = migrate(t.url, t.schema, folder).then(() => 'applied', (err: Error & { cause?: Error }) => `failed: ${err.cause?.message ?? err.message}`);
      await new Promise((r) => setTimeout(r, 500));
      // The next confirmation, which takes the tables in the writers' order meanwhile.
      const confirmed = (async () => {
        await next.query('begin');
        await confirmation(app, next);
        await next.query('commit');
        return 'committed';
      })().catch(async (err: Error) => {
        await next.query('rollback').catch(() => {});
        return `failed: ${err.message}`;
      });
      await new Promise((r) => setTimeout(r, 500));
      await open.query('commit');
      expect({ migrated: await migrated, confirmed: await confirmed }).toEqual({ migrated: 'applied', confirmed: 'committed' });
    } finally {
      open.release();
      next.release();
    }
  }, 60_000);
});
