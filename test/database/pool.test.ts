// A connection that dies inside a transaction (a PostgreSQL restart, pg_terminate_backend) must fail
// that transaction, not the process: found by chaos, where it crashed the process that confirmed orders.
import { afterAll, beforeAll, expect, it } from 'vitest';
import { createPool, inTransaction, type Pool } from '../../src/db/pool.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';

let t: TestDb;
let pool: Pool;
beforeAll(async () => {
  t = await createTestDatabase();
  pool = createPool(t.url, { schema: t.schema, max: 1, applicationName: 'pool-under-test' });
});
afterAll(async () => {
  await pool.end();
  await t.close();
});

it('a backend terminated between two statements rejects the transaction and is not pooled again', async () => {
  const err = await inTransaction(pool, async (tx) => {
    const { rows } = await tx.query('select pg_backend_pid() as pid');
    await t.pool.query('select pg_terminate_backend($1)', [rows[0].pid]);
    await new Promise((r) => setTimeout(r, 200)); // the reset arrives while no statement runs
    await tx.query('select 1');
  }).catch((e: unknown) => e);
  expect(err).toBeInstanceOf(Error);
  // The one pooled connection was discarded: the next statement gets a fresh, working one.
  expect((await pool.query('select 1 as ok')).rows[0].ok).toBe(1);
});
