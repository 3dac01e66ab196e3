// Group commit (src/db/coalesce.ts) on real PostgreSQL: the calls made in one turn share one statement,
// and a call the server refuses fails alone instead of failing the calls it travelled with.
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { afterAll, beforeAll, beforeEach, expect, it } from 'vitest';
import { coalesced } from '../../src/db/coalesce.ts';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';

let t: TestDb;
let pool: Pool;
beforeAll(async () => {
  t = await createTestDatabase();
  pool = createPool(t.url, { schema: t.schema, applicationName: 'coalesce-under-test' });
});
afterAll(async () => {
  await pool.end();
  await t.close();
});

/** Every statement sent, by its inputs. */
const sent: string[][] = [];
beforeEach(() => {
  sent.length = 0;
});
/** Casts each input to a uuid, in one statement per batch; `sleep` holds the statement open. */
const cast = (key: string, sleepSeconds = 0) =>
  coalesced(pool, key, async (inputs: string[]) => {
    sent.push(inputs);
    const { rows } = await pool.query(
      `select x::uuid::text as id from unnest($1::text[]) with ordinality u(x, n), pg_sleep($2) order by n`, [inputs, sleepSeconds]);
    return rows.map((r) => r.id as string);
  });

it('the calls of one turn share one statement, each with its own answer', async () => {
  const ids = [randomUUID(), randomUUID(), randomUUID()];
  expect(await Promise.all(ids.map(cast('shared')))).toEqual(ids);
  expect(sent).toEqual([ids]);
});

it('a call the server refuses fails alone: the others, sent again one by one, get their answers', async () => {
  const [a, b] = [randomUUID(), randomUUID()];
  const [first, bad, last] = await Promise.allSettled([a, 'not-a-uuid', b].map(cast('poison')));
  expect(first).toEqual({ status: 'fulfilled', value: a });
  expect(last).toEqual({ status: 'fulfilled', value: b });
  expect(bad).toMatchObject({ status: 'rejected', reason: expect.objectContaining({ code: '22P02' }) });
  expect((bad as PromiseRejectedResult).reason).toBeInstanceOf(pg.DatabaseError);
  expect(sent).toEqual([[a, 'not-a-uuid', b], [a], ['not-a-uuid'], [b]]);
});

it('a statement whose connection the server ended (57P01) is not sent again: it may have committed', async () => {
  const ids = [randomUUID(), randomUUID()];
  const calls = Promise.allSettled(ids.map(cast('terminated', 2)));
  const terminate = async () =>
    (await t.pool.query(`select pg_terminate_backend(pid) as done from pg_stat_activity
      where application_name = 'coalesce-under-test' and state = 'active' and query like '%pg_sleep%'`)).rows.length;
  const deadline = Date.now() + 10_000;
  while ((await terminate()) === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
  const results = await calls;
  expect(results.map((r) => r.status)).toEqual(['rejected', 'rejected']);
  expect(sent).toEqual([ids]);
});
