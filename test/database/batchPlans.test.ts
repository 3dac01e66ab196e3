// The dispatcher's two batch statements (claims, outcomes) each touch a few pages per operation, whatever
// the size of the ledger and of the backlog, and whichever plan PostgreSQL keeps for them: a prepared
// statement runs a generic plan after five executions, and statistics lag a backlog that grew since the
// last analyze. Their input (an array, a JSON array) tells the planner nothing of its size, and joined
// on it alone the outcomes hashed against every unsettled operation, or read the whole ledger, at each
// outcome (src/sql/operations.ts, byIds).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KEY_WINDOW_SECONDS, callTable } from '../../src/engine/executor.ts';
import { statementsFor } from '../../src/sql/statements.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

const BATCH = 5;
/** Pages an operation may touch: its primary key's and its row's own, an entry in each index the outcome
 * writes, its timeline row and settlement event (17-21 measured here; a scan of the backlog is hundreds). */
const PAGES_PER_OPERATION = 25;

const addOperations = (n: number, settled: boolean) =>
  t.pool.query(
    `insert into outboxd.payment_operations (order_id, amount, currency, customer_id, payment_method, status, settled_at, external_id)
     select 'order-' || gen_random_uuid(), 1000, 'usd', 'cus_test', 'pm_card_visa',
       ${settled ? `'succeeded', now(), 'pi_' || md5(random()::text)` : `'pending', null, null`}
     from generate_series(1, $1)`,
    [n],
  );

/** Pages (shared buffers hit or read) the statement touched, run in a transaction rolled back, under `mode`. */
async function pagesTouched(statement: { text: string; values?: unknown[] }, mode: 'force_generic_plan' | 'force_custom_plan') {
  const client = await t.pool.connect();
  try {
    await client.query('begin');
    await client.query(`set local plan_cache_mode = ${mode}`);
    const { rows } = await client.query({ text: `explain (analyze, buffers, format json) ${statement.text}`, values: statement.values ?? [] });
    const plan = rows[0]['QUERY PLAN'][0].Plan;
    return plan['Shared Hit Blocks'] + plan['Shared Read Blocks'];
  } finally {
    await client.query('rollback');
    client.release();
  }
}

async function batchPages() {
  const st = statementsFor(t.schema, true);
  const pending = (await t.pool.query(`select id, fence from outboxd.payment_operations where status = 'pending' order by created_at desc limit ${BATCH}`)).rows;
  const claim = st.claimAttempts(pending.map((r) => r.id), 'worker-a', 30_000, KEY_WINDOW_SECONDS, 'charge', 'idempotent-key', callTable('idempotent-key'));
  const outcomes = st.recordOutcomes(JSON.stringify(pending.map((r, ord) => ({ ord, id: r.id, fence: Number(r.fence), status: 'succeeded', last_outcome: 'succeeded', external_id: `pi_${ord}`, source: 'call', event: { call: 'create', outcome: 'succeeded' } }))));
  const pages: Record<string, number> = {};
  for (const mode of ['force_generic_plan', 'force_custom_plan'] as const) {
    pages[`claims, ${mode}`] = await pagesTouched(claim, mode);
    pages[`outcomes, ${mode}`] = await pagesTouched(outcomes, mode);
  }
  return pages;
}

const expectBounded = (pages: Record<string, number>) => {
  for (const [statement, n] of Object.entries(pages)) expect.soft(n, statement).toBeLessThanOrEqual(BATCH * PAGES_PER_OPERATION);
};

describe('the batch statements read by primary key', () => {
  it('a backlog of 10,000 on a new installation, never analyzed', async () => {
    await addOperations(10_000, false);
    const all = await batchPages(); for (const [statement, pages] of Object.entries(all)) expect.soft(pages, statement).toBeLessThanOrEqual(BATCH * PAGES_PER_OPERATION);
  });

  it('a ledger of 20,000 settled operations analyzed before a backlog of 10,000 more arrived', async () => {
    await t.pool.query('truncate outboxd.payment_operations cascade');
    await addOperations(20_000, true);
    await t.pool.query('analyze outboxd.payment_operations');
    await addOperations(10_000, false);
    const all = await batchPages(); for (const [statement, pages] of Object.entries(all)) expect.soft(pages, statement).toBeLessThanOrEqual(BATCH * PAGES_PER_OPERATION);
  });
});
