// The library API as an application uses it (from src/; test/processes/package.test.ts runs the packed tarball):
// requestCharge joins the caller's transaction, whatever it is, validates before writing, and keeps at
// most one live charge per order, with a new operation (a new key) once every earlier one failed.
import { randomUUID } from 'node:crypto';
import { drizzle } from 'drizzle-orm/node-postgres';
import { numeric, pgTable, text, uuid } from 'drizzle-orm/pg-core';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { Outboxd, OrderConflictError, RefundRefused, TransactionTypeError, ValidationError, type ChargeRequest } from '../../src/index.ts';
import { createTestDatabase, emptyDatabases, inAppTransaction, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { claim, counts, operation, outboxRows } from '../support/fixtures.ts';

/** The application's own orders: other columns than the example's, in public. */
const appOrders = pgTable('orders', {
  id: uuid('id').primaryKey(),
  total: numeric('total').notNull(),
  status: text('status').notNull(),
});

let t: TestDb;
let appPool: pg.Pool; // the application's pool: pg's defaults (bigints as strings), no outboxd settings
let outboxd: Outboxd;
let emu: RunningEmulator;
beforeAll(async () => {
  t = await createTestDatabase();
  appPool = new pg.Pool({ connectionString: t.url, max: 4 });
  await appPool.query(`create table public.orders (id uuid primary key, total numeric not null, status text not null)`);
  outboxd = new Outboxd({ connectionString: t.url });
  emu = await startEmulator();
});
afterAll(async () => {
  await outboxd.stop();
  await appPool.end();
  await emu.close();
  await t.close();
});

const charge = (over: Partial<ChargeRequest> = {}): ChargeRequest => ({
  orderId: randomUUID(),
  amount: 4200,
  currency: 'eur',
  customer: 'cus_lib',
  paymentMethod: 'pm_card_visa',
  ...over,
});

const inPgTransaction = <T>(fn: (client: pg.PoolClient) => Promise<T>, commit = true) => inAppTransaction(appPool, fn, commit);

const fail = (id: string) => t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = $1`, [id]);

describe('requestCharge joins the caller’s transaction', () => {
  it('a pg client inside BEGIN: the app’s order, the operation and its outbox row commit together', async () => {
    const req = charge();
    const { operationId, created } = await inPgTransaction(async (client) => {
      await client.query(`insert into public.orders (id, total, status) values ($1, 42.00, 'awaiting_payment')`, [req.orderId]);
      return outboxd.requestCharge(client, req);
    });
    expect(created).toBe(true);
    expect(await outboxd.getOperation(operationId)).toMatchObject({ orderId: req.orderId, amount: 4200, currency: 'eur', status: 'pending', kind: 'charge' });
    expect(await outboxRows(t, operationId)).toBe(1);
  });

  it('a drizzle node-postgres transaction', async () => {
    const db = drizzle({ client: appPool });
    const req = charge();
    const { operationId } = await db.transaction(async (tx) => {
      await tx.insert(appOrders).values({ id: req.orderId, total: '42.00', status: 'awaiting_payment' });
      return outboxd.requestCharge(tx, req);
    });
    expect((await outboxd.getOperation(operationId))?.orderId).toBe(req.orderId);
    expect(await outboxRows(t, operationId)).toBe(1);
  });

  it('a rollback (pg or drizzle) leaves no operation and no outbox row', async () => {
    const before = await counts(t);
    const viaPg = charge();
    const { operationId } = await inPgTransaction((client) => outboxd.requestCharge(client, viaPg), false);
    const viaDrizzle = charge();
    let drizzleOp: string | undefined;
    await expect(
      drizzle({ client: appPool }).transaction(async (tx) => {
        drizzleOp = (await outboxd.requestCharge(tx, viaDrizzle)).operationId;
        throw new Error('payment page closed');
      }),
    ).rejects.toThrow('payment page closed');
    expect(await outboxd.getOperation(operationId)).toBeUndefined();
    expect(await outboxd.getOperation(drizzleOp!)).toBeUndefined();
    expect(await counts(t)).toEqual(before);
  });

  it('anything with query(text, values), even one reading bigints as strings', async () => {
    const req = charge();
    const first = await inPgTransaction((client) => outboxd.requestCharge({ query: (text: string, values?: unknown[]) => client.query(text, values) }, req));
    const again = await inPgTransaction((client) => outboxd.requestCharge({ query: (text: string, values?: unknown[]) => client.query(text, values) }, req));
    expect(first.created).toBe(true);
    expect(again).toEqual({ operationId: first.operationId, created: false });
  });

  it('anything with query(text, values) reading JSON as its text: a manual or Connect order asked again is the same operation; its capture and cancel are decided as on a pg client', async () => {
    const JSON_TYPES = new Set([pg.types.builtins.JSON, pg.types.builtins.JSONB]);
    const textPool = new pg.Pool({
      connectionString: t.url,
      max: 2,
      types: { getTypeParser: ((oid: number, format?: 'text' | 'binary') => (JSON_TYPES.has(oid) ? (v: string) => v : pg.types.getTypeParser(oid, format))) as typeof pg.types.getTypeParser },
    });
    try {
      const bare = <T>(fn: (tx: { query: (text: string, values?: unknown[]) => Promise<pg.QueryResult> }) => Promise<T>) =>
        inAppTransaction(textPool, (client) => fn({ query: (text, values) => client.query(text, values) }));
      for (const over of [{ captureMethod: 'manual' }, { stripeAccount: 'acct_1LibraryShop', applicationFeeAmount: 100 }] as const) {
        const req = charge(over);
        const first = await bare((tx) => outboxd.requestCharge(tx, req));
        expect(await bare((tx) => outboxd.requestCharge(tx, req))).toEqual({ operationId: first.operationId, created: false });
      }
      const held = async () => {
        const { operationId } = await bare((tx) => outboxd.requestCharge(tx, charge({ captureMethod: 'manual' })));
        expect((await executeOperation(t.pool, kindsFor(emu.gateway()), operationId, await claim(t, operationId))).operation.status).toBe('succeeded');
        return operationId;
      };
      const captured = await held();
      const capture = { chargeOperationId: captured, key: 'ship-1', amount: 1000 };
      const firstCapture = await bare((tx) => outboxd.requestCapture(tx, capture));
      expect(firstCapture.created).toBe(true);
      expect(await bare((tx) => outboxd.requestCapture(tx, capture))).toEqual({ operationId: firstCapture.operationId, created: false });
      const cancel = { chargeOperationId: await held(), key: 'abandon', reason: 'abandoned' } as const;
      const firstCancel = await bare((tx) => outboxd.requestCancel(tx, cancel));
      expect(await bare((tx) => outboxd.requestCancel(tx, cancel))).toEqual({ operationId: firstCancel.operationId, created: false });
    } finally {
      await textPool.end();
    }
  });

  it('a query(text, values) resolving to the rows alone (as pg-promise’s and TypeORM’s do) is refused before anything is written', async () => {
    const before = await counts(t);
    // An application that logs the error and commits its order anyway commits nothing of outboxd's.
    const err = await inPgTransaction((client) =>
      outboxd.requestCharge({ query: async (text: string, values?: unknown[]) => (await client.query(text, values)).rows }, charge()).catch((e: unknown) => e),
    );
    expect(err).toBeInstanceOf(TransactionTypeError);
    expect((err as Error).message).toMatch(/resolved to an array/);
    expect(await counts(t)).toEqual(before);
  });

  it('the caller’s search_path does not matter: an app schema with its own payment_operations stays untouched', async () => {
    await appPool.query(`create schema shop; create table shop.payment_operations (id serial primary key, order_id text); create table shop.charge_outbox (id serial primary key)`);
    const req = charge();
    const { operationId } = await inPgTransaction(async (client) => {
      await client.query(`set local search_path to shop`);
      return outboxd.requestCharge(client, req);
    });
    expect((await operation(t, operationId)).order_id).toBe(req.orderId);
    expect((await appPool.query(`select (select count(*)::int from shop.payment_operations) + (select count(*)::int from shop.charge_outbox) as n`)).rows[0].n).toBe(0);
  });

  it('one application connection serves two schemas (prepared statements named per schema)', async () => {
    const other = new Outboxd({ connectionString: t.url, schema: 'payments' });
    await other.migrate();
    try {
      const req = charge();
      const [a, b] = await inPgTransaction(async (client) => [await outboxd.requestCharge(client, req), await other.requestCharge(client, req)]);
      expect(a.operationId).not.toBe(b.operationId);
      expect((await other.getOperation(b.operationId))?.orderId).toBe(req.orderId);
      expect(await outboxd.getOperation(b.operationId)).toBeUndefined();
    } finally {
      await other.stop();
    }
  });

  it('refuses what is not a transaction, before writing anything', async () => {
    const before = await counts(t);
    for (const notATransaction of [appPool, drizzle({ client: appPool }), null, {}]) {
      await expect(outboxd.requestCharge(notATransaction as object, charge())).rejects.toBeInstanceOf(TransactionTypeError);
    }
    expect(await counts(t)).toEqual(before);
  });

  it('refuses a pg client outside BEGIN (each statement its own transaction: the order and its charge apart), before writing anything; one whose BEGIN is still queued is inside it', async () => {
    const before = await counts(t);
    const client = await appPool.connect();
    try {
      await expect(outboxd.requestCharge(client, charge())).rejects.toThrow(TransactionTypeError);
      await expect(outboxd.requestCharge(client, charge())).rejects.toThrow(/outside a transaction.*BEGIN/);
      // Another statement in flight is no transaction either.
      const sleeping = client.query('select pg_sleep(0.2)');
      await expect(outboxd.requestCharge(client, charge())).rejects.toThrow(TransactionTypeError);
      await sleeping;
      expect(await counts(t)).toEqual(before);
      // BEGIN sent, not yet answered: the charge's statements queue behind it, inside the transaction.
      const begun = client.query('begin');
      const { created } = await outboxd.requestCharge(client, charge());
      await begun;
      expect(created).toBe(true);
      await client.query('rollback');
      expect(await counts(t)).toEqual(before);
    } finally {
      client.release();
    }
  });
});

describe('input and conflicts: refused with a typed error, nothing written', () => {
  const metadata = (n: number) => Object.fromEntries(Array.from({ length: n }, (_, i) => [`k${i}`, 'v']));
  const bad: [string, Record<string, unknown>, string][] = [
    ['zero amount', { amount: 0 }, 'amount'],
    ['unknown currency', { currency: 'xyz' }, 'currency'],
    ['empty order id', { orderId: '' }, 'orderId'],
    // Kept as given, it is the application's key: trimmed, ' A-1' and 'A-1' would share one charge.
    ['an order id with spaces around it', { orderId: ' A-1 ' }, 'orderId'],
    ['missing customer', { customer: undefined }, 'customer'],
    ['unknown field', { card: '4242' }, 'card'],
    ['retry not a boolean', { retry: 'yes' }, 'retry'],
    ['metadata not an object', { metadata: 'x' }, 'metadata'],
    ['50 metadata keys: Stripe’s limit, with operation_id one of them', { metadata: metadata(50) }, 'metadata'],
    ['a 41-character key', { metadata: { ['k'.repeat(41)]: 'v' } }, `metadata.${'k'.repeat(41)}`],
    ['a 501-character value', { metadata: { note: 'v'.repeat(501) } }, 'metadata.note'],
    ['a number value', { metadata: { count: 3 } }, 'metadata.count'],
    ['operation_id is reserved', { metadata: { operation_id: 'mine' } }, 'metadata.operation_id'],
    ['square brackets in a key', { metadata: { 'a[b]': 'v' } }, 'metadata.a[b]'],
  ];
  it.each(bad)('%s', async (_name, change, field) => {
    const before = await counts(t);
    const err = await inPgTransaction((client) => outboxd.requestCharge(client, { ...charge(), ...change } as ChargeRequest)).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ValidationError);
    expect((err as ValidationError).field).toBe(field);
    expect(await counts(t)).toEqual(before);
  });

  it('49 keys (and operation_id) of 40, values of 500 characters: Stripe’s limits, accepted', async () => {
    const req = charge({ metadata: { ...metadata(48), ['k'.repeat(40)]: 'v'.repeat(500) } });
    const { operationId } = await inPgTransaction((client) => outboxd.requestCharge(client, req));
    expect((await outboxd.getOperation(operationId))?.metadata).toEqual(req.metadata);
  });

  it('the same orderId twice is the same operation; other details while it is live are a conflict naming the field', async () => {
    const req = charge();
    const first = await inPgTransaction((client) => outboxd.requestCharge(client, req));
    expect(await inPgTransaction((client) => outboxd.requestCharge(client, { ...req, currency: 'EUR' }))).toEqual({ operationId: first.operationId, created: false });
    for (const [change, field] of [[{ amount: 1 }, 'amount'], [{ currency: 'usd' }, 'currency'], [{ customer: 'cus_x' }, 'customer'], [{ paymentMethod: 'pm_card_mastercard' }, 'paymentMethod'], [{ paymentMethod: 'pm_card_mastercard', retry: true }, 'paymentMethod']] as const) {
      const err = await inPgTransaction((client) => outboxd.requestCharge(client, { ...req, ...change })).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(OrderConflictError);
      expect(err).toMatchObject({ field, orderId: req.orderId, operationId: first.operationId });
    }
    expect(await outboxRows(t, first.operationId)).toBe(1);
  });
});

describe('a declined card is not the end of an order', () => {
  it('another payment method, or retry: true, after every earlier charge failed: a new operation and key', async () => {
    const req = charge({ paymentMethod: 'pm_card_chargeDeclined' });
    const request = (r: ChargeRequest) => inPgTransaction((client) => outboxd.requestCharge(client, r));
    const op1 = await request(req);
    await fail(op1.operationId);
    // The same details again (an import re-run): the failed operation, nothing new.
    expect(await request(req)).toEqual({ operationId: op1.operationId, created: false });
    // Another card: a new operation.
    const op2 = await request({ ...req, paymentMethod: 'pm_card_visa' });
    expect(op2.created).toBe(true);
    expect(op2.operationId).not.toBe(op1.operationId);
    // While it is live: the same details return it; another card is refused.
    expect(await request({ ...req, paymentMethod: 'pm_card_visa', retry: true })).toEqual({ operationId: op2.operationId, created: false });
    await expect(request(req)).rejects.toMatchObject({ name: 'OrderConflictError', field: 'paymentMethod', operationId: op2.operationId });
    await fail(op2.operationId);
    // The first card again is the first (failed) operation, unless the caller says retry.
    expect(await request(req)).toEqual({ operationId: op1.operationId, created: false });
    const op3 = await request({ ...req, retry: true });
    expect(op3.created).toBe(true);
    expect(new Set([op1.operationId, op2.operationId, op3.operationId]).size).toBe(3);
    // The order's amount, currency and customer never change between its charges.
    await fail(op3.operationId);
    await expect(request({ ...req, amount: 1, paymentMethod: 'pm_card_amex' })).rejects.toMatchObject({ field: 'amount' });
    expect(await outboxRows(t, op3.operationId)).toBe(1);
  });

  it('the database keeps at most one live charge per order, whatever the code does', async () => {
    const req = charge();
    const { operationId } = await inPgTransaction((client) => outboxd.requestCharge(client, req));
    const insertLive = () =>
      t.pool.query(
        `insert into outboxd.payment_operations (order_id, kind, amount, currency, customer_id, payment_method) values ($1, 'charge', 1, 'eur', 'c', 'pm')`,
        [req.orderId],
      );
    await expect(insertLive()).rejects.toMatchObject({ code: '23505', constraint: 'payment_operations_live_charge_idx' });
    await fail(operationId);
    await insertLive();
    await expect(insertLive()).rejects.toMatchObject({ code: '23505' });
  });

  it('concurrent new attempts with different cards: exactly one operation is created', async () => {
    const req = charge({ paymentMethod: 'pm_card_chargeDeclined' });
    const { operationId } = await inPgTransaction((client) => outboxd.requestCharge(client, req));
    await fail(operationId);
    const cards = ['pm_card_visa', 'pm_card_mastercard', 'pm_card_amex', 'pm_card_discover'];
    const results = await Promise.allSettled(cards.map((pm) => inPgTransaction((client) => outboxd.requestCharge(client, { ...req, paymentMethod: pm }))));
    const created = results.filter((r) => r.status === 'fulfilled' && r.value.created);
    expect(created).toHaveLength(1);
    for (const r of results) if (r.status === 'rejected') expect(r.reason).toBeInstanceOf(OrderConflictError);
    const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where order_id = $1 and status <> 'failed'`, [req.orderId]);
    expect(rows[0].n).toBe(1);
  });
});

describe('the rest of the API', () => {
  it('metadata reaches Stripe beside operation_id', async () => {
    const req = charge({ metadata: { cart: 'c-17', channel: 'web' } });
    const { operationId } = await inPgTransaction((client) => outboxd.requestCharge(client, req));
    const run = await executeOperation(t.pool, kindsFor(emu.gateway()), operationId, await claim(t, operationId));
    expect(run.operation.status).toBe('succeeded');
    const pi = await emu.client().paymentIntents.retrieve(run.operation.external_id!);
    expect(pi.metadata).toEqual({ cart: 'c-17', channel: 'web', operation_id: operationId });
  });

  it('requestRefund joins the caller’s transaction (here one reading bigints as strings): the same key is the same refund; too much is refused', async () => {
    const req = charge({ amount: 1000 });
    const { operationId: chargeOp } = await inPgTransaction((client) => outboxd.requestCharge(client, req));
    await executeOperation(t.pool, kindsFor(emu.gateway()), chargeOp, await claim(t, chargeOp));
    const refund = { chargeOperationId: chargeOp, amount: 600, key: 'return-1', reason: 'requested_by_customer' } as const;
    const first = await drizzle({ client: appPool }).transaction((tx) => outboxd.requestRefund(tx, refund));
    expect(first.created).toBe(true);
    expect(await inPgTransaction((client) => outboxd.requestRefund(client, refund))).toEqual({ operationId: first.operationId, created: false });
    expect(await outboxd.getOperation(first.operationId)).toMatchObject({ kind: 'refund', orderId: req.orderId, amount: 600, parentOperationId: chargeOp, key: 'return-1', status: 'pending', customer: null });
    const err = await inPgTransaction((client) => outboxd.requestRefund(client, { ...refund, key: 'return-2', amount: 401 })).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RefundRefused);
    expect(err).toMatchObject({ code: 'exceeds_remaining', chargeOperationId: chargeOp });
    const rolledBack = await inPgTransaction((client) => outboxd.requestRefund(client, { ...refund, key: 'return-3', amount: 400 }), false);
    expect(await outboxd.getOperation(rolledBack.operationId)).toBeUndefined();
  });

  it('getOperation: undefined for an unknown or malformed id', async () => {
    expect(await outboxd.getOperation(randomUUID())).toBeUndefined();
    expect(await outboxd.getOperation('not-an-id')).toBeUndefined();
  });

  it('{ pool }: the application’s own pool, read with outboxd’s types without changing the pool’s', async () => {
    const onAppPool = new Outboxd({ pool: appPool });
    await onAppPool.migrate(); // idempotent on a migrated database
    const req = charge();
    const { operationId } = await inPgTransaction((client) => onAppPool.requestCharge(client, req));
    expect((await onAppPool.getOperation(operationId))?.amount).toBe(4200);
    expect((await appPool.query(`select 1::bigint as n`)).rows[0].n).toBe('1');
    await onAppPool.stop();
    expect((await appPool.query('select 1 as ok')).rows[0].ok).toBe(1); // the application's pool is not ended
  });

  it('{ pool } given its password apart from a URL (pg keeps it off the pool\'s enumerable options): migrate() signs in', async () => {
    const u = new URL(t.url);
    expect(u.password).not.toBe(''); // the test database asks for one
    const pool = new pg.Pool({ host: u.hostname, port: Number(u.port), user: decodeURIComponent(u.username), password: decodeURIComponent(u.password), database: u.pathname.slice(1), max: 2 });
    try {
      await new Outboxd({ pool, schema: t.schema }).migrate();
    } finally {
      await pool.end();
    }
  });

  it('the constructor wants exactly one of connectionString and pool, and a valid schema', () => {
    expect(() => new Outboxd({} as never)).toThrow(TypeError);
    expect(() => new Outboxd({ connectionString: t.url, pool: appPool } as never)).toThrow(TypeError);
    expect(() => new Outboxd({ connectionString: t.url, schema: 'Bad-Schema' })).toThrow(TypeError);
  });
});

describe('on a database not migrated yet', () => {
  const emptyDatabase = emptyDatabases();

  it('onSettled and startWorker say so, naming outboxd migrate, instead of "pg-boss is not installed"', async () => {
    const { url } = await emptyDatabase('outboxd_lib_unmigrated');
    const unmigrated = new Outboxd({ connectionString: url, onError: () => {} });
    try {
      const notMigrated = /^the database is not migrated \(pg-boss's schema pgboss is missing\): run `outboxd migrate` or Outboxd\.migrate\(\)$/;
      await expect(unmigrated.onSettled(() => {})).rejects.toThrow(notMigrated);
      await expect(unmigrated.startWorker({ concurrency: 1 })).rejects.toThrow(notMigrated);
    } finally {
      await unmigrated.stop();
    }
  });

  it('the request methods and getOperation say so, naming outboxd migrate, instead of PostgreSQL\'s "relation does not exist"', async () => {
    const { url, client } = await emptyDatabase('outboxd_lib_unmigrated_requests');
    const unmigrated = new Outboxd({ connectionString: url, onError: () => {} });
    const notMigrated = /^the database is not migrated \(relation "outboxd\.\w+" does not exist, schema outboxd\): run `outboxd migrate` or Outboxd\.migrate\(\)$/;
    const inTx = async (fn: () => Promise<unknown>) => {
      await client.query('begin');
      try {
        return await fn();
      } finally {
        await client.query('rollback');
      }
    };
    try {
      await expect(inTx(() => unmigrated.requestCharge(client, charge()))).rejects.toThrow(notMigrated);
      const chargeOperationId = randomUUID();
      await expect(inTx(() => unmigrated.requestRefund(client, { chargeOperationId, amount: 1, key: 'r' }))).rejects.toThrow(notMigrated);
      await expect(inTx(() => unmigrated.requestCapture(client, { chargeOperationId, key: 'c' }))).rejects.toThrow(notMigrated);
      await expect(inTx(() => unmigrated.requestCancel(client, { chargeOperationId, key: 'x' }))).rejects.toThrow(notMigrated);
      unmigrated.defineEffect('receipt', { policy: 'at-least-once', execute: () => null });
      await expect(inTx(() => unmigrated.requestEffect(client, 'receipt', { key: 'k', payload: {} }))).rejects.toThrow(notMigrated);
      await expect(unmigrated.getOperation(randomUUID())).rejects.toThrow(notMigrated);
    } finally {
      await unmigrated.stop();
    }
  });

  it('one whose pg-boss schema is older than this release says that', async () => {
    const { url, client } = await emptyDatabase('outboxd_lib_older');
    const older = new Outboxd({ connectionString: url, onError: () => {} });
    try {
      await older.migrate();
      await client.query('update pgboss.version set version = version - 1');
      await expect(older.onSettled(() => {})).rejects.toThrow(/^the database is not migrated \(pg-boss's schema pgboss is older than this release\): run `outboxd migrate`/);
    } finally {
      await older.stop();
    }
  });
});
