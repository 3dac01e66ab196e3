// outboxd's tables live in their own schema. A database the release created (tables in public, drizzle's
// default migrations table) is upgraded in place without losing a row; a new database never touches an
// application's public tables; another OUTBOXD_SCHEMA is a second, independent installation.
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import pg from 'pg';
import { afterAll, describe, expect, it } from 'vitest';
import { drizzlePending, migrate, MIGRATION_LOCK, readJournal } from '../../src/db/migrate.ts';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { confirmOrder } from '../../src/exampleApp/confirm.ts';
import { createBoss, relayOutbox } from '../../src/outbox/outbox.ts';
import { acquireLease } from '../../src/engine/operation.ts';
import { connectedEmptyDatabase } from '../support/db.ts';
import { orderInput } from '../support/fixtures.ts';
import { createReleaseDatabase, dumpTables as dump, insertReleaseRows, RELEASE_TABLES as TABLES, ROOT } from '../support/release.ts';

const cleanups: (() => Promise<void>)[] = [];
afterAll(async () => {
  for (const c of cleanups.reverse()) await c();
});

const database = (prefix: string) => connectedEmptyDatabase(prefix, cleanups);

function pool(url: string, schema = 'outboxd'): Pool {
  const p = createPool(url, { schema, max: 4, applicationName: 'migrate-test' });
  cleanups.push(() => p.end());
  return p;
}

const schemaOf = async (client: pg.Client, table: string): Promise<string[]> =>
  (await client.query(`select table_schema from information_schema.tables where table_name = $1 order by 1`, [table])).rows.map(
    (r) => r.table_schema,
  );

describe('upgrading a database the release created (tables in public)', () => {
  it('moves every table to the schema with every row, and continues from it', async () => {
    const { url, client } = await database('upgrade');
    await createReleaseDatabase(client);
    // An application using drizzle too: its own record in drizzle's default migrations table.
    await client.query(`insert into drizzle.__drizzle_migrations (hash, created_at) values ('the-app', 1700000000000)`);
    await insertReleaseRows(client);
    const before = await dump(client, 'public');

    await migrate(url, 'outboxd');

    for (const t of TABLES) expect(await schemaOf(client, t), t).toEqual(['outboxd']);
    // Every row, every value (later migrations only add columns, with their defaults).
    const after = await dump(client, 'outboxd');
    expect(after).toMatchObject(before);
    expect(after.payment_operations!.map((op) => op.metadata)).toEqual([{}, {}]);
    // The identity sequences moved with their tables: numbering continues.
    const { rows: audit } = await client.query(`insert into outboxd.admin_audit (actor, action) values ('x', 'requeue') returning id`);
    expect(audit[0].id).toBe(String(Number(before.admin_audit![0]!.id) + 1));
    // drizzle's record: ours moved to the schema, the application's stayed where it was.
    expect((await client.query(`select hash from drizzle.__drizzle_migrations`)).rows).toEqual([{ hash: 'the-app' }]);
    const journal = JSON.parse(await readFile(path.join(ROOT, 'drizzle/meta/_journal.json'), 'utf8'));
    const recorded = async () => (await client.query(`select count(*)::int as n from outboxd.__drizzle_migrations`)).rows[0].n;
    expect(await recorded()).toBe(journal.entries.length);

    // Applications of that release may still read the queue `settled`: settlement events go there until
    // an application of this one subscribes (src/outbox/settlements.ts).
    const tableDelivery = async (schema: string) => (await client.query(`select count(*)::int as n from "${schema}".settlement_delivery`)).rows[0].n;
    expect(await tableDelivery('outboxd')).toBe(0);

    await migrate(url, 'outboxd'); // idempotent
    expect(await recorded()).toBe(journal.entries.length);
    expect(await tableDelivery('outboxd')).toBe(0);
    expect(await dump(client, 'outboxd')).toMatchObject({ orders: before.orders, payment_operations: before.payment_operations });

    // The moved operations are driven as before, and the application may now have its own orders.
    const p = pool(url);
    expect(await acquireLease(p, '00000000-0000-4000-8000-000000000002', 'w', 10_000)).toBe(1);
    await client.query(`create table public.orders (id uuid primary key, total numeric not null)`);
    expect((await confirmOrder(p, orderInput())).created).toBe(true);
  });
});

describe('a new database', () => {
  it('creates nothing in public and leaves an application’s own orders and payment_operations alone', async () => {
    const { url, client } = await database('fresh');
    await client.query(`
      create table public.orders (id uuid primary key default gen_random_uuid(), total numeric not null, note text);
      create table public.payment_operations (id serial primary key, provider text not null);
      insert into public.orders (total, note) values (12.5, 'the app''s own order');
      insert into public.payment_operations (provider) values ('paypal');
    `);
    await migrate(url, 'outboxd');
    for (const t of TABLES) expect((await schemaOf(client, t)).filter((s) => s !== 'public'), t).toEqual(['outboxd']);
    const p = pool(url);
    const input = orderInput();
    const { operationId } = await confirmOrder(p, input);
    expect((await client.query(`select order_id from outboxd.payment_operations where id = $1`, [operationId])).rows).toEqual([
      { order_id: input.orderId },
    ]);
    expect((await client.query(`select total, note from public.orders`)).rows).toEqual([{ total: '12.5', note: "the app's own order" }]);
    expect((await client.query(`select provider from public.payment_operations`)).rows).toEqual([{ provider: 'paypal' }]);
    expect((await client.query(`select to_regclass('drizzle.__drizzle_migrations') as t`)).rows[0].t).toBeNull();
  });
});

describe("an application's pool", () => {
  it("keeps its connections' own settings: the migration runs on a session of its own, its lock released", async () => {
    const { url, client } = await database('apppool');
    await client.query('create schema app; create table app.orders (id int); create table public.orders (id int)');
    const app = new pg.Pool({ connectionString: url, max: 2 });
    cleanups.push(() => app.end());
    app.on('connect', (c) => void c.query(`set search_path to app; set lock_timeout = '2s'`));
    const settings = async () => {
      // Both of its connections at once, so that each is read.
      const held = await Promise.all([app.connect(), app.connect()]);
      try {
        return await Promise.all(held.map(async (c) => (await c.query(`select current_setting('search_path') as sp, current_setting('lock_timeout') as lt`)).rows[0]));
      } finally {
        for (const c of held) c.release();
      }
    };
    expect(await settings()).toEqual([{ sp: 'app', lt: '2s' }, { sp: 'app', lt: '2s' }]);
    await migrate(app, 'outboxd');
    await migrate(app, 'outboxd'); // nothing pending: a boot of the next replica
    expect(await settings()).toEqual([{ sp: 'app', lt: '2s' }, { sp: 'app', lt: '2s' }]);
    expect((await client.query(`select count(*)::int as n from pg_locks where locktype = 'advisory' and objid = $1 and database = (select oid from pg_database where datname = current_database())`, [MIGRATION_LOCK])).rows[0].n).toBe(0);
    // A pool of one migrates too: the lock is the migrator's session's, not one of the pool's.
    const one = new pg.Pool({ connectionString: url, max: 1 });
    cleanups.push(() => one.end());
    await migrate(one, 'outboxd');
  });

  it("is not cut short by the database's default statement_timeout: an index built concurrently waits out an application's older transaction", async () => {
    const { url, client } = await database('stmttimeout');
    const name = (await client.query('select current_database() as d')).rows[0].d;
    await client.query(`alter database "${name}" set statement_timeout = '1s'`);
    const app = new pg.Pool({ connectionString: url, max: 2 });
    cleanups.push(() => app.end());
    // An application's transaction with a snapshot, open for 3 s: every concurrent build waits for it.
    const older = await app.connect();
    await older.query('begin isolation level repeatable read');
    await older.query('select 1');
    const ends = new Promise((resolve) => setTimeout(resolve, 3_000)).then(() => older.query('commit')).finally(() => older.release());
    const started = Date.now();
    await migrate(app, 'outboxd');
    await ends;
    expect(Date.now() - started).toBeGreaterThan(1_000);
    const invalid = await client.query(`select count(*)::int as n from pg_index i join pg_class c on c.oid = i.indexrelid join pg_namespace n on n.oid = c.relnamespace where n.nspname = 'outboxd' and not i.indisvalid`);
    expect(invalid.rows[0].n).toBe(0);
  });
});

describe('what a database still needs', () => {
  it('by the newest migration’s timestamp: one that replaced a withdrawn migration of the same number is pending; a newer release’s schema is not', async () => {
    const { url, client } = await database('pending');
    await migrate(url, 'outboxd');
    const journal = await readJournal();
    expect(await drizzlePending(client, 'outboxd', journal)).toBe(false);
    // The database ran a build whose newest migration was withdrawn; this build's takes its number, later.
    const replaced = { entries: [...journal.entries.slice(0, -1), { when: journal.entries.at(-1)!.when + 1 }] };
    expect(await drizzlePending(client, 'outboxd', replaced)).toBe(true);
    // The previous release's replicas on this release's schema, during a rolling upgrade.
    expect(await drizzlePending(client, 'outboxd', { entries: journal.entries.slice(0, -1) })).toBe(false);
  });
});

describe('operation ids', () => {
  it('a role granted only the schema may call the id function, where default privileges revoke EXECUTE from PUBLIC', async () => {
    const { url, client } = await database('hardened');
    await client.query(`alter default privileges revoke execute on functions from public`);
    await migrate(url, 'outboxd');
    const role = `outboxd_inserter_${process.pid}`;
    await client.query(`create role ${role}`);
    try {
      await client.query(`grant usage on schema outboxd to ${role}`);
      await client.query(`set role ${role}`);
      const { rows } = await client.query(`select outboxd.uuidv7()::text as id`);
      expect(rows[0].id).toMatch(/^[0-9a-f]{8}-[0-9a-f]{4}-7/);
    } finally {
      await client.query(`reset role`);
      await client.query(`drop owned by ${role}`);
      await client.query(`drop role ${role}`);
    }
  });
});

describe('checks added to tables that may be large', () => {
  it('are added NOT VALID: no existing row is read under the ACCESS EXCLUSIVE lock they take', async () => {
    const { url, client } = await database('notvalid');
    await migrate(url, 'outboxd');
    const { rows } = await client.query(
      `select conname, convalidated from pg_constraint where connamespace = 'outboxd'::regnamespace and conname = any($1) order by conname`,
      [['orders_status_check', 'payment_operations_change_check']],
    );
    expect(rows).toEqual([
      { conname: 'orders_status_check', convalidated: false },
      { conname: 'payment_operations_change_check', convalidated: false },
    ]);
  });
});

describe('OUTBOXD_SCHEMA', () => {
  it('another schema is an installation of its own: tables, migrations record and pg-boss schema', async () => {
    const { url, client } = await database('schemas');
    await migrate(url, 'outboxd');
    await migrate(url, 'payments');
    for (const t of TABLES) expect(await schemaOf(client, t), t).toEqual(['outboxd', 'payments']);
    expect((await client.query(`select count(*)::int as n from payments.__drizzle_migrations`)).rows[0].n).toBeGreaterThan(0);
    // Each ledger's ids come from its own schema's function, which a dropped schema takes with it.
    const idDefault = async (schema: string) =>
      (await client.query(`select column_default as d from information_schema.columns where table_schema = $1 and table_name = 'payment_operations' and column_name = 'id'`, [schema])).rows[0].d;
    expect(await idDefault('outboxd')).toBe('outboxd.uuidv7()');
    expect(await idDefault('payments')).toBe('payments.uuidv7()');

    const pools = { outboxd: pool(url, 'outboxd'), payments: pool(url, 'payments') };
    const ids = {
      outboxd: (await confirmOrder(pools.outboxd, orderInput({ orderId: 'same-order' }))).operationId,
      payments: (await confirmOrder(pools.payments, orderInput({ orderId: 'same-order' }))).operationId,
    };
    expect(ids.outboxd).not.toBe(ids.payments);
    // Each installation's jobs go to its own pg-boss schema: neither worker can take the other's.
    for (const schema of ['outboxd', 'payments'] as const) {
      const boss = createBoss(url, 'client', 2, schema);
      await boss.start();
      try {
        expect(await relayOutbox(pools[schema], boss)).toEqual({ operations: 1, settlements: 0 });
      } finally {
        await boss.stop({ graceful: false });
      }
    }
    const jobs = async (bossSchema: string) =>
      (await client.query(`select data->>'operationId' as op from ${bossSchema}.job where name = 'charge'`)).rows.map((r) => r.op);
    expect(await jobs('pgboss')).toEqual([ids.outboxd]);
    expect(await jobs('pgboss_payments')).toEqual([ids.payments]);
  });
});
