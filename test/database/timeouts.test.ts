// outboxd's own statements wait for an application's lock a few seconds at most (lock_timeout), on its
// direct connections and behind a pooler alike, without a startup parameter and without touching the
// settings of the application's own session.
import net from 'node:net';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createPool, IDLE_IN_TRANSACTION_MS, inTransaction, LOCK_TIMEOUT_MS, withClient, type Pool } from '../../src/db/pool.ts';
import { Outboxd } from '../../src/outboxd.ts';
import { createTestDatabase, inAppTransaction, type TestDb } from '../support/db.ts';
import { confirm } from '../support/fixtures.ts';

let t: TestDb;
let appPool: pg.Pool;
const pools: Pool[] = [];
beforeAll(async () => {
  t = await createTestDatabase();
  appPool = new pg.Pool({ connectionString: t.url, max: 2 });
});
afterAll(async () => {
  for (const p of pools) await p.end();
  await appPool.end();
  await t.close();
});

const open = (pooled: boolean) => {
  const pool = createPool(t.url, { schema: t.schema, max: 1, applicationName: 'timeouts-under-test', pooled });
  pools.push(pool);
  return pool;
};

describe.each([
  ['on a direct connection', false],
  ['behind a pooler (no session setting)', true],
])('outboxd’s statements %s', (_, pooled) => {
  it('fail after the lock timeout behind an application’s row lock, instead of waiting for its transaction', async () => {
    const pool = open(pooled);
    const id = await confirm(t, { orderId: `timeouts-${pooled}` });
    const holder = await appPool.connect();
    try {
      await holder.query('begin');
      await holder.query(`select id from "${t.schema}".payment_operations where id = $1 for update`, [id]);
      const started = Date.now();
      const outcome = await Promise.race([
        pool.query(pool.sql.flagDiscrepancy(id, 'checked while the application holds the row')).then(() => 'done', (err: { code?: string }) => err.code),
        new Promise((resolve) => setTimeout(() => resolve('still waiting after 30 s'), 30_000)),
      ]);
      expect(outcome).toBe('55P03');
      expect(Date.now() - started).toBeGreaterThanOrEqual(LOCK_TIMEOUT_MS - 100);
    } finally {
      await holder.query('rollback');
      holder.release();
    }
    // Behind a pooler the session itself is left as it was: the timeout was its transaction's.
    const { rows } = await withClient(pool, (client) => client.query('show lock_timeout'));
    expect(rows[0].lock_timeout).toBe(pooled ? '0' : `${LOCK_TIMEOUT_MS / 1000}s`);
  }, 60_000);

  it('a transaction of its own left idle (its process frozen inside it) is ended by the server, its rows free again', async () => {
    const pool = open(pooled);
    const { rows } = await inTransaction(pool, (tx) => tx.query('show idle_in_transaction_session_timeout'));
    expect(rows[0].idle_in_transaction_session_timeout).toBe(`${IDLE_IN_TRANSACTION_MS / 1000}s`);
  });
});

it('requestCharge leaves the application’s session settings as they were', async () => {
  const app = new Outboxd({ connectionString: t.url, schema: t.schema });
  try {
    const settings = await inAppTransaction(appPool, async (client) => {
      await app.requestCharge(client, { orderId: 'timeouts-app', amount: 100, currency: 'eur', customer: 'cus_1', paymentMethod: 'pm_card_visa' });
      return (await client.query(`select current_setting('lock_timeout') as lock, current_setting('statement_timeout') as statement`)).rows[0];
    });
    expect(settings).toEqual({ lock: '0', statement: '0' });
  } finally {
    await app.stop();
  }
});

it('a statement whose answer never comes (a peer gone silent) gives its connection up, and the pool reconnects', async () => {
  // A TCP relay to PostgreSQL that can go silent: bytes stop flowing both ways, and nobody closes anything.
  const target = new URL(t.url);
  const relayed: net.Socket[] = [];
  let silent = false;
  const relay = net.createServer((client) => {
    const server = net.connect(Number(target.port), target.hostname);
    relayed.push(client, server);
    client.on('data', (d) => silent || server.write(d));
    server.on('data', (d) => silent || client.write(d));
    client.on('error', () => {});
    server.on('error', () => {});
  });
  await new Promise<void>((resolve) => relay.listen(0, '127.0.0.1', resolve));
  const url = new URL(t.url);
  url.port = String((relay.address() as net.AddressInfo).port);
  const pool = createPool(url.toString(), { schema: t.schema, max: 1, applicationName: 'silent-peer', queryTimeoutMs: 2_000 });
  pools.push(pool);
  try {
    expect((await pool.query('select 1 as ok')).rows[0].ok).toBe(1);
    silent = true;
    const outcome = await Promise.race([
      pool.query('select 1 as ok').then(() => 'answered', (err: Error) => err.message),
      new Promise((resolve) => setTimeout(() => resolve('still waiting after 20 s'), 20_000)),
    ]);
    expect(outcome).toMatch(/timeout/i);
    // The connection was discarded, not pooled again: the pool's only slot serves a new one.
    silent = false;
    expect((await pool.query('select 2 as ok')).rows[0].ok).toBe(2);
  } finally {
    for (const s of relayed) s.destroy();
    relay.close();
  }
}, 60_000);
