// The statements that take a batch (the dispatcher's claims and outcomes, the relay's passes over both
// outboxes) touch a few pages per row they take, whatever the size of the ledger and of the backlog, and
// whichever plan PostgreSQL keeps for them: a named statement runs a generic plan after five executions,
// an unnamed one a custom plan each time, and statistics lag a backlog that grew since the last analyze.
// Their input (an array, a JSON array, the rows a CTE took, a locking subquery's ids) tells the planner
// nothing of its size, and joined on it alone the outcomes hashed against every unsettled operation, or
// read the whole ledger, and the relay against its whole outbox, at each batch (src/sql/context.ts, byIds).
// The retention's batches read the rows they take too, not the rows inside the window, nor the ledger.
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KEY_WINDOW_SECONDS, callTable } from '../../src/engine/executor.ts';
import { createKindQueues, deadQueueFor, queueFor } from '../../src/outbox/outbox.ts';
import { bossSchemaFor, statementsFor } from '../../src/sql/statements.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
  // Statistics stay as each case leaves them: an analyze meanwhile would hide the lag being tested.
  for (const table of ['payment_operations', 'charge_outbox', 'settlement_outbox', 'operation_events', 'admin_audit', 'webhook_events', 'settlement_consumption']) await t.pool.query(`alter table outboxd.${table} set (autovacuum_enabled = off)`);
});
afterAll(() => t.close());

const BATCH = 5;
/** Pages an operation may touch: its primary key's and its row's own, and an entry in each index the outcome
 * writes: 17-21 measured on PostgreSQL 18, up to 26 on 15 (which descends an index once per element of
 * an array). A scan of the backlog or of the ledger here is 370 pages and more for the batch. */
const PAGES_PER_OPERATION = 40;

/** A backlog in both outboxes: operations to relay, and settlement events the relay copied already that
 * wait for the application's handlers. */
const addOutboxRows = async (n: number) => {
  await t.pool.query(`insert into outboxd.charge_outbox (operation_id) select gen_random_uuid() from generate_series(1, $1)`, [n]);
  await t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source, fanned_out) select gen_random_uuid(), 'call', true from generate_series(1, $1)`, [n]);
};

const addOperations = (n: number, settled: boolean) =>
  t.pool.query(
    `insert into outboxd.payment_operations (order_id, amount, currency, customer_id, payment_method, status, settled_at, external_id)
     select 'order-' || gen_random_uuid(), 1000, 'usd', 'cus_test', 'pm_card_visa',
       ${settled ? `'succeeded', now(), 'pi_' || md5(random()::text)` : `'pending', null, null`}
     from generate_series(1, $1)`,
    [n],
  );

/**
 * Pages (shared buffers hit or read) the statement's plan touched, run in a transaction rolled back. Under
 * `generic`, prepared and executed with the generic plan a named statement keeps; otherwise planned for
 * its values, as an unnamed statement is (EXPLAIN of a statement with values always is). The plan's top
 * node counts the reads that find the operations; the timeline and event rows, written by CTEs that the
 * final select does not read, are not counted.
 */
async function pagesTouched(statement: { text: string; values?: unknown[] }, generic: boolean) {
  const client = await t.pool.connect();
  const values = statement.values ?? [];
  try {
    await client.query('begin');
    let explained;
    if (generic) {
      await client.query(`set local plan_cache_mode = force_generic_plan`);
      await client.query(`prepare batch_plan_test as ${statement.text}`);
      // EXECUTE takes no parameters of its own statement: the values go in as literals.
      const literal = (v: unknown) => client.escapeLiteral(Array.isArray(v) ? `{${v.map((e) => JSON.stringify(e)).join(',')}}` : String(v));
      explained = await client.query(`explain (analyze, buffers, format json) execute batch_plan_test(${values.map(literal).join(', ')})`);
    } else {
      explained = await client.query({ text: `explain (analyze, buffers, format json) ${statement.text}`, values });
    }
    const plan = explained.rows[0]['QUERY PLAN'][0].Plan;
    return plan['Shared Hit Blocks'] + plan['Shared Read Blocks'];
  } finally {
    await client.query('rollback');
    if (generic) await client.query('deallocate batch_plan_test');
    client.release();
  }
}

async function batchPages() {
  const st = statementsFor(t.schema, true);
  const pending = (await t.pool.query(`select id, fence from outboxd.payment_operations where status = 'pending' order by created_at desc limit ${BATCH}`)).rows;
  const ids = pending.map((r) => r.id);
  await t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source) select unnest($1::uuid[]), 'call'`, [ids]);
  const statements = {
    claims: st.claimAttempts(ids, 'worker-a', 30_000, KEY_WINDOW_SECONDS, 'charge', 'idempotent-key', callTable('idempotent-key')),
    outcomes: st.recordOutcomes(JSON.stringify(pending.map((r, ord) => ({ ord, id: r.id, fence: Number(r.fence), status: 'succeeded', last_outcome: 'succeeded', external_id: `pi_${ord}`, source: 'call', event: { call: 'create', outcome: 'succeeded' } })))),
    'settlement events': st.takeSettlementBatch(500, 'outboxd.settled'),
    'outbox rows': st.takeOutboxBatch(BATCH),
  };
  const pages: Record<string, number> = {};
  for (const generic of [true, false]) {
    for (const [name, statement] of Object.entries(statements)) pages[`${name}, ${generic ? 'generic' : 'custom'} plan`] = await pagesTouched(statement, generic);
  }
  return pages;
}

const expectBounded = (pages: Record<string, number>) => {
  for (const [statement, n] of Object.entries(pages)) expect.soft(n, statement).toBeLessThanOrEqual(BATCH * PAGES_PER_OPERATION);
};

describe('the batch statements read by primary key', () => {
  it('a backlog of 10,000 on a new installation, never analyzed', async () => {
    await addOperations(10_000, false);
    await addOutboxRows(40_000);
    expectBounded(await batchPages());
  });

  it('a ledger of 20,000 settled operations analyzed before a backlog of 10,000 more arrived', async () => {
    await t.pool.query('truncate outboxd.payment_operations, outboxd.settlement_outbox, outboxd.charge_outbox cascade');
    await addOperations(20_000, true);
    await t.pool.query('analyze outboxd.payment_operations');
    await addOperations(10_000, false);
    await addOutboxRows(40_000);
    expectBounded(await batchPages());
  });
});

/** Rows a retention batch reads (src/outbox/retention.ts; 1,000 in production). */
const SCAN = 50;
/** Pages a row of a retention batch may touch: its index entries and its row, and its operation's: about 5
 * measured. A scan of a table's rows inside the window, or of the ledger, is over 650 pages here. */
const PAGES_PER_SCANNED_ROW = 10;

describe("the retention's batches read the rows they take", () => {
  it('in tables holding 60,000 rows inside their window, beside a ledger of 20,000', async () => {
    await t.pool.query('truncate outboxd.payment_operations, outboxd.settlement_outbox, outboxd.charge_outbox cascade');
    await addOperations(20_000, true);
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '400 days'`);
    await t.pool.query('vacuum analyze outboxd.payment_operations'); // the update's dead versions
    // Past every window: a batch's worth to delete; then rows inside it, which a batch must not read.
    const rows = async (n: number, age: string) => {
      const ofOperations = `with ops as (select array_agg(id) as ids from outboxd.payment_operations)
        select ids[1 + floor(random() * cardinality(ids))::int] as op, now() - interval '${age}' as at from ops, generate_series(1, $1)`;
      await t.pool.query(`insert into outboxd.operation_events (operation_id, at, type) select op, at, 'claimed' from (${ofOperations}) r`, [n]);
      await t.pool.query(`insert into outboxd.admin_audit (actor, action, operation_id, at) select 'test', 'requeue', op, at from (${ofOperations}) r`, [n]);
      await t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source, created_at) select op, 'call', at from (${ofOperations}) r`, [n]);
      await t.pool.query(`insert into outboxd.webhook_events (id, type, result, payload, received_at)
        select id, 'payment_intent.succeeded', 'settled', jsonb_build_object('id', id, 'type', 'payment_intent.succeeded', 'created', 1700000000,
          'livemode', false, 'payment_intent', jsonb_build_object('id', 'pi_' || md5(id), 'status', 'succeeded')), now() - interval '${age}'
        from (select 'evt_' || md5(random()::text) as id from generate_series(1, $1)) e`, [n]);
      await t.pool.query(`insert into outboxd.settlement_consumption (subscriber, operation_id, consumed_at)
        select 'sub-' || (i % 3), gen_random_uuid(), now() - interval '${age}' from generate_series(1, $1) i`, [n]);
    };
    await rows(SCAN, '400 days');
    await rows(60_000, '0 days');
    const st = statementsFor(t.schema, true);
    const statements = {
      timeline: st.pruneOperationEvents(90, 0, SCAN),
      audit: st.pruneAdminAudit(365, 0, SCAN),
      'settlement events': st.pruneSettlementOutbox(14, 0, SCAN),
      'webhook events': st.pruneWebhookEvents(30, SCAN),
      'settlement consumptions': st.pruneSettlementConsumption(60, SCAN),
    };
    for (const generic of [true, false]) {
      for (const [name, statement] of Object.entries(statements)) {
        expect.soft(await pagesTouched(statement, generic), `${name}, ${generic ? 'generic' : 'custom'} plan`).toBeLessThanOrEqual(SCAN * PAGES_PER_SCANNED_ROW);
      }
    }
  });
});

/** Pages a listing of LIST_PAGE operations may touch: an index descent per kind, then per kind and status,
 * and the page's rows: 18-50 measured; sorting the ledger, as they did, 866. The review queue's
 * listing may read the whole queue, HELD rows here (a generic plan sorts it: 259 pages measured), never
 * the ledger. */
const LIST_PAGE = 10;
const LIST_PAGES = 100;
const HELD = 300;

describe('the admin listings read pages of indexes, not the ledger', () => {
  it('a page from a ledger of 23,000 operations of two kinds and three statuses, 300 held for review, is the ledger sorted', async () => {
    await t.pool.query('truncate outboxd.payment_operations, outboxd.settlement_outbox, outboxd.charge_outbox cascade');
    await addOperations(20_000, true);
    await addOperations(2_000, false);
    await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, effect_key, status)
       select 'receipt_email', 'at-least-once', md5(i::text), 'unknown' from generate_series(1, 1000) i`,
    );
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'held' where id in (select id from outboxd.payment_operations order by random() limit ${HELD})`);
    await t.pool.query('vacuum analyze outboxd.payment_operations');
    const st = statementsFor(t.schema, true);
    for (const status of [null, 'pending', 'unknown', 'succeeded']) {
      for (const review of [false, true]) {
        for (const dir of ['asc', 'desc'] as const) {
          const statement = review ? (dir === 'asc' ? st.listReview : st.listReviewNewest) : dir === 'asc' ? st.listOperations : st.listOperationsNewest;
          const listed = statement(status, LIST_PAGE);
          const name = `status ${status ?? 'any'}, ${review ? 'held for review' : 'all'}, ${dir}`;
          const sorted = await t.pool.query(
            `select id from outboxd.payment_operations where ($1::text is null or status = $1) and (not $2 or review_reason is not null)
             order by created_at ${dir}, id ${dir} limit $3`,
            [status, review, LIST_PAGE],
          );
          expect((await t.pool.query(listed)).rows.map((r) => r.id), name).toEqual(sorted.rows.map((r) => r.id));
          for (const generic of [true, false]) {
            const bound = review ? HELD + LIST_PAGES : LIST_PAGES;
            expect.soft(await pagesTouched(listed, generic), `${name}, ${generic ? 'generic' : 'custom'} plan`).toBeLessThanOrEqual(bound);
          }
        }
      }
    }
  });
});

describe("an operation's live job is looked for among its queues' live jobs, not their history", () => {
  it('in a queue keeping 20,000 completed jobs (requeue, resolve and the sweep ask per operation)', async () => {
    const boss = bossSchemaFor(t.schema);
    const queue = queueFor('charge');
    await createKindQueues(t.boss, 'charge');
    const live = randomUUID();
    await t.pool.query(
      `insert into ${boss}.job (name, data, state, completed_on)
       select $1, jsonb_build_object('operationId', gen_random_uuid()), 'completed', now() from generate_series(1, 20000)`,
      [queue],
    );
    const jobId = await t.boss.send(queue, { operationId: live });
    await t.pool.query(`vacuum analyze ${boss}.job`);
    const st = statementsFor(t.schema, true);
    expect((await t.pool.query(st.liveJobOf([queue, deadQueueFor('charge')], live))).rows).toEqual([{ id: jobId, state: 'created' }]);
    for (const generic of [true, false]) {
      expect.soft(await pagesTouched(st.liveJobOf([queue, deadQueueFor('charge')], live), generic), generic ? 'generic plan' : 'custom plan').toBeLessThanOrEqual(LIST_PAGES);
    }
  });
});
