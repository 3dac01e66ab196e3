// The gauges a scrape reads from PostgreSQL: right, and read from the partial indexes, not the table
// (Prometheus scrapes every replica every few seconds, and the table keeps every operation ever made).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createMetrics } from '../src/dispatcher/metrics.ts';
import { createTestDatabase, type TestDb } from './support/db.ts';
import { confirm } from './support/fixtures.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(async () => {
  await t?.close();
});

const gauge = async (metrics: ReturnType<typeof createMetrics>, name: string) =>
  (await metrics.registry.getSingleMetric(name)!.get()).values[0]!.value;

describe('operation health gauges', () => {
  it('count what waits for a person and age the oldest unsettled operation, settled ones aside', async () => {
    const [old, flagged, settled] = [await confirm(t), await confirm(t), await confirm(t)];
    await t.pool.query(`update outboxd.payment_operations set created_at = now() - interval '1 hour' where id = $1`, [old]);
    await t.pool.query(`update outboxd.payment_operations set created_at = now() - interval '2 hours', status = 'succeeded', settled_at = now() where id = $1`, [settled]);
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'a person must look' where id = $1`, [flagged]);
    const metrics = createMetrics({ db: t.pool, boss: t.boss });
    expect(await gauge(metrics, 'outboxd_needs_review')).toBe(1);
    const age = await gauge(metrics, 'outboxd_oldest_unsettled_age_seconds');
    expect(age).toBeGreaterThanOrEqual(3600);
    expect(age).toBeLessThan(3600 + 60);
  });

  it('read their partial indexes, never the whole table', async () => {
    const client = await t.pool.connect();
    try {
      // Small tables are cheaper to scan: tell the planner to prefer any index that serves, so the plan
      // shows which ones can.
      await client.query('set enable_seqscan = off');
      const { text } = t.pool.sql.operationHealth();
      const { rows } = await client.query(`explain (format json) ${text}`);
      const plan = JSON.stringify(rows[0]['QUERY PLAN']);
      expect(plan).toContain('payment_operations_review_idx');
      expect(plan).toContain('payment_operations_unsettled_idx');
      expect(plan).not.toContain('payment_operations_pkey');
      expect(plan).not.toContain('Seq Scan');
    } finally {
      await client.query('reset enable_seqscan');
      client.release();
    }
  });
});
