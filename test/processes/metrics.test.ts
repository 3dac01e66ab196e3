// The gauges a scrape reads from PostgreSQL: right, and read from the partial indexes, not the table
// (Prometheus scrapes every replica every few seconds, and the table keeps every operation ever made).
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { createMetrics, sharedFor } from '../../src/telemetry/metrics.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { counting } from '../support/counting.ts';
import { confirm } from '../support/fixtures.ts';

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
      expect(plan).toContain('payment_operations_review_created_idx');
      expect(plan).toContain('payment_operations_unsettled_idx');
      expect(plan).not.toContain('payment_operations_pkey');
      expect(plan).not.toContain('Seq Scan');
    } finally {
      await client.query('reset enable_seqscan');
      client.release();
    }
  });
});

describe('host database health gauges', () => {
  it("age the transaction holding the xmin horizon back, and count the dead rows of outboxd's tables", async () => {
    const holder = new pg.Client({ connectionString: t.url });
    await holder.connect();
    try {
      // An application's long transaction with a snapshot: nothing written after it can be vacuumed.
      await holder.query('begin isolation level repeatable read');
      await holder.query('select 1');
      const began = performance.now();
      const ops = [await confirm(t), await confirm(t), await confirm(t)];
      await t.pool.query(`update outboxd.payment_operations set attempts = attempts + 1 where id = any($1::uuid[])`, [ops]);
      await waitUntil(() => performance.now() - began > 2_000, 10_000, 'two seconds');
      const metrics = createMetrics({ db: t.pool, boss: t.boss });
      expect(await gauge(metrics, 'outboxd_db_oldest_xmin_seconds')).toBeGreaterThanOrEqual(2);
      expect(await gauge(metrics, 'outboxd_db_oldest_xmin_age_transactions')).toBeGreaterThanOrEqual(3);
      // PostgreSQL's statistics arrive within a second or so of the commit.
      const dead = async (table: string) => {
        const { values } = await createMetrics({ db: t.pool, boss: t.boss }).registry.getSingleMetric('outboxd_db_dead_tuples')!.get();
        return values.find((v) => v.labels.table === table)?.value ?? 0;
      };
      await waitUntil(async () => (await dead('payment_operations')) >= 3, 20_000, 'the updated rows counted dead');
      const { values } = await metrics.registry.getSingleMetric('outboxd_db_live_tuples')!.get();
      expect(values.map((v) => v.labels.table)).toEqual(expect.arrayContaining(['payment_operations', 'operation_events', 'pg-boss']));
    } finally {
      await holder.query('rollback');
      await holder.end();
    }
    await waitUntil(async () => (await gauge(createMetrics({ db: t.pool, boss: t.boss }), 'outboxd_db_oldest_xmin_seconds')) < 2, 20_000, 'the horizon to move on');
  });
});

describe('a scrape', () => {
  it('is read once for concurrent requests: a flood of /metrics does not fill the pools the dispatcher works on', async () => {
    const statementsOfScrapes = async (n: number) => {
      const counted = counting(t.pool);
      const metrics = createMetrics({ db: counted.pool, boss: t.boss });
      const texts = await Promise.all(Array.from({ length: n }, () => metrics.scrape()));
      expect(new Set(texts).size).toBe(1);
      return counted.statements();
    };
    const one = await statementsOfScrapes(1);
    expect(one).toBeGreaterThan(0);
    expect(await statementsOfScrapes(40)).toBe(one);
  });

  it('counts an outbox backlog up to 100,000 rows, not a backlog of millions at every scrape', async () => {
    await t.pool.query(`insert into outboxd.charge_outbox (operation_id) select gen_random_uuid() from generate_series(1, 100_050)`);
    try {
      expect(await gauge(createMetrics({ db: t.pool, boss: t.boss }), 'outboxd_outbox_rows')).toBe(100_000);
    } finally {
      await t.pool.query('truncate outboxd.charge_outbox');
    }
  });
});

describe('a shared reading', () => {
  it('a scrape whose database read hangs holds up the scrapes that share it, not the next one after its wait (10 s)', { timeout: 30_000 }, async () => {
    let hang = true;
    const db = {
      sql: t.pool.sql,
      query: ((q: unknown, v?: unknown) => {
        if (hang && (q as { name?: string }).name === t.pool.sql.operationHealth().name) {
          hang = false;
          return new Promise(() => {}); // a dead connection's answer
        }
        return t.pool.query(q as never, v as never);
      }) as typeof t.pool.query,
    };
    const metrics = createMetrics({ db, boss: t.boss });
    let first = false;
    void metrics.scrape().then(() => (first = true));
    await new Promise((resolve) => setTimeout(resolve, 10_500));
    expect(first).toBe(false);
    expect(await metrics.scrape()).toContain('outboxd_needs_review');
  });


  it('that never ends is shared no longer than its wait: the next scrape reads again', async () => {
    let reads = 0;
    const read = sharedFor(1_000, () => (++reads === 1 ? new Promise<string>(() => {}) : Promise.resolve(`reading ${reads}`)), 200);
    void read(); // hangs
    expect(reads).toBe(1);
    void read(); // shared with the one that hangs
    expect(reads).toBe(1);
    await new Promise((resolve) => setTimeout(resolve, 300));
    expect(await read()).toBe('reading 2');
    expect(await read()).toBe('reading 2'); // and shared for a second after it ended
  });
});
