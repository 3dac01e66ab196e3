// The console's lists read what they show of each operation, not its JSON: an effect's payload and
// result (up to 64 KiB each) and a charge's metadata are its own page's. A page of 500 read them whole
// (tens of megabytes), and four at once took a replica past its heap.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { listPage, operationRecord, overview, reviewQueue, search } from '../../src/console/queries.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(async () => t?.close());

const BIG = { blob: 'x'.repeat(60_000) };
const JSON_COLUMNS = ['metadata', 'payload', 'result'];

describe("the console's lists", () => {
  it('read no payload, result or metadata, nor do the related operations on its page', async () => {
    const { rows } = await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, order_id, effect_key, payload, result, status, review_reason, settled_at, external_id)
       select 'bulky_effect', 'at-least-once', 'bulky-order', 'key-' || n, $1::jsonb, $1::jsonb,
              case when n = 1 then 'unknown' else 'succeeded' end, case when n = 1 then 'a person looks' end,
              case when n = 1 then null else now() end, 'ext_bulky' || n
       from generate_series(1, 3) n
       returning id`,
      [JSON.stringify(BIG)],
    );
    const page = await listPage(t.pool, { kind: 'bulky_effect' }, 50, undefined, ['bulky_effect']);
    const review = await listPage(t.pool, { needsReview: true }, 50, undefined, ['bulky_effect']);
    const found = await search(t.pool, 'bulky-order');
    const byStripeId = await search(t.pool, 'ext_bulky2');
    const summary = await overview(t.pool, t.boss, { rateLimit: undefined, searchRateLimit: undefined });
    const listed = [...page.rows, ...review.rows, ...found.matches, ...byStripeId.matches, ...(await reviewQueue(t.pool, 5)), ...summary.recent];
    expect(page.rows).toHaveLength(3);
    expect(review.rows).toHaveLength(1);
    expect(found.matches).toHaveLength(3);
    for (const row of listed) for (const column of JSON_COLUMNS) expect(row, column).not.toHaveProperty(column);
    const op = (await t.pool.query(`select * from outboxd.payment_operations where id = $1`, [rows[0].id])).rows[0];
    const record = await operationRecord(t.pool, op);
    expect(record.related).toHaveLength(2);
    for (const row of record.related) for (const column of JSON_COLUMNS) expect(row, column).not.toHaveProperty(column);
  });
});
