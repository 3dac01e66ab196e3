// The overview's charts against PostgreSQL: each series equals what a brute-force reading of the same
// rows gives, minute by minute (the oldest-unsettled staircase above all), and each query reads only
// its window through an index, whatever the table holds before it. Links to Stripe's dashboard, by
// object.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CHART_HOURS, overviewCharts } from '../../src/console/queries.ts';
import { timeChart } from '../../src/console/views/charts.ts';
import { dashboardUrl, stripeLink } from '../../src/console/views/parts.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(async () => t?.close());

const MIN = 60_000;

/** A seeded generator, so a failure shows the same rows again. */
function random(seed: number): () => number {
  let s = seed >>> 0;
  return () => ((s = (Math.imul(s, 1664525) + 1013904223) >>> 0) / 2 ** 32);
}

interface Row {
  created: Date;
  settled: Date | null;
  status: 'succeeded' | 'failed' | 'pending' | 'unknown';
}

async function insert(rows: Row[]): Promise<void> {
  await t.pool.query(
    `insert into outboxd.payment_operations (kind, policy, effect_key, payload, status, created_at, settled_at)
     select 'chart_probe', 'at-least-once', gen_random_uuid()::text, '{}', status, created_at, settled_at
     from unnest($1::text[], $2::timestamptz[], $3::timestamptz[]) as r(status, created_at, settled_at)`,
    [rows.map((r) => r.status), rows.map((r) => r.created), rows.map((r) => r.settled)],
  );
}

/** PostgreSQL's percentile_cont: linear between the two nearest ranks. */
function percentile(sorted: number[], p: number): number {
  const at = p * (sorted.length - 1);
  const lo = Math.floor(at);
  return sorted[lo]! + (sorted[Math.min(lo + 1, sorted.length - 1)]! - sorted[lo]!) * (at - lo);
}

describe("the overview's charts", () => {
  it('equal a brute-force reading of the same rows, minute by minute', async () => {
    const { rows } = await t.pool.query('select now() as now');
    const now: Date = rows[0].now;
    const rand = random(20261203);
    const at = (minutesAgo: number) => new Date(Math.floor(now.getTime() - minutesAgo * MIN));
    const ops: Row[] = [];
    for (let i = 0; i < 400; i++) {
      const created = at(2 + rand() * 230); // some before the window, most in it
      const long = rand() < 0.15;
      const settled = new Date(Math.min(created.getTime() + (long ? rand() * 100 * MIN : rand() * 5000), now.getTime() - 2 * MIN));
      ops.push({ created, settled, status: rand() < 0.8 ? 'succeeded' : 'failed' });
    }
    ops.push({ created: at(600), settled: at(500), status: 'succeeded' }); // settled before the window: no part of it
    for (const ago of [150, 40, 7]) ops.push({ created: at(ago), settled: null, status: ago === 40 ? 'unknown' : 'pending' });
    await insert(ops);
    // The timeline: calls and their outcomes, some answered 429, some never sent (the budget refused them).
    const calls = Array.from({ length: 300 }, () => ({ at: at(2 + rand() * 170), answer: rand() < 0.2 ? '429' : rand() < 0.25 ? 'budget' : 'ok' }));
    const outcome = (c: (typeof calls)[number]) =>
      c.answer === '429' ? { outcome: 'rate_limited', error: 'RetryLater 429: Too many requests' }
      : c.answer === 'budget' ? { outcome: 'rate_limited', error: 'RetryLater: not sent: no token within 5000 ms' }
      : { outcome: 'succeeded', error: null };
    await t.pool.query(
      `insert into outboxd.operation_events (operation_id, type, at, details)
       select gen_random_uuid(), 'sent', at, '{}'::jsonb from unnest($1::timestamptz[]) at
       union all
       select gen_random_uuid(), 'outcome', at, details from unnest($1::timestamptz[], $2::jsonb[]) as o(at, details)`,
      [calls.map((c) => c.at), calls.map((c) => JSON.stringify(outcome(c)))],
    );
    // A 429 loop kept as one row: 7 answers, the first 100 minutes ago, the last 20 minutes ago.
    const loop = { first: at(100), last: at(20), repeats: 7 };
    await t.pool.query(
      `insert into outboxd.operation_events (operation_id, type, at, last_at, repeats, details)
       values (gen_random_uuid(), 'outcome', $1, $2, $3, '{"outcome":"rate_limited","error":"RetryLater 429: Too many requests"}')`,
      [loop.first, loop.last, loop.repeats],
    );
    const charts = await overviewCharts(t.pool, now);
    const minutes = CHART_HOURS * 60;
    expect(charts.succeeded).toHaveLength(minutes);
    const from = charts.from.getTime();
    const bucket = (d: Date) => Math.floor((d.getTime() - from) / MIN);
    const expected = {
      succeeded: Array<number>(minutes).fill(0),
      failed: Array<number>(minutes).fill(0),
      latencies: Array.from({ length: minutes }, () => [] as number[]),
      oldest: Array<number>(minutes).fill(0),
      calls: Array<number>(minutes).fill(0),
      limited: Array<number>(minutes).fill(0),
    };
    for (const op of ops) {
      if (!op.settled || op.settled.getTime() < from) continue;
      const i = bucket(op.settled);
      expected[op.status === 'succeeded' ? 'succeeded' : 'failed'][i]! += 1;
      expected.latencies[i]!.push(op.settled.getTime() - op.created.getTime());
    }
    for (let i = 0; i < minutes; i++) {
      const m = from + i * MIN;
      const active = ops.filter((op) => op.created.getTime() <= m && (op.settled === null || op.settled.getTime() > m));
      expected.oldest[i] = active.length ? (m - Math.min(...active.map((op) => op.created.getTime()))) / 1000 : 0;
    }
    for (const c of calls) {
      if (c.answer !== 'budget') expected.calls[bucket(c.at)]! += 1;
      if (c.answer === '429') expected.limited[bucket(c.at)]! += 1;
    }
    for (const [when, n] of [[loop.first, 1], [loop.last, loop.repeats - 1]] as const) {
      expected.calls[bucket(when)]! += n;
      expected.limited[bucket(when)]! += n;
    }
    expect(expected.limited.some((n) => n > 0) && calls.some((c) => c.answer === 'budget')).toBe(true);
    expect(charts.succeeded).toEqual(expected.succeeded);
    expect(charts.failed).toEqual(expected.failed);
    expect(charts.oldestUnsettled.map((s) => Math.round(s * 1000) / 1000)).toEqual(expected.oldest.map((s) => Math.round(s * 1000) / 1000));
    expect(charts.oldestUnsettled.filter((s) => s > 0).length).toBeGreaterThan(minutes / 2);
    expect(charts.gatewayCalls).toEqual(expected.calls);
    expect(charts.rateLimited).toEqual(expected.limited);
    for (let i = 0; i < minutes; i++) {
      const sorted = expected.latencies[i]!.sort((a, b) => a - b);
      if (sorted.length === 0) {
        expect(charts.p50Ms[i]).toBeNull();
        continue;
      }
      expect(charts.p50Ms[i]).toBeCloseTo(percentile(sorted, 0.5), 3);
      expect(charts.p95Ms[i]).toBeCloseTo(percentile(sorted, 0.95), 3);
    }
  });

  it('read only their window through an index, with a large history before it', async () => {
    await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, effect_key, payload, status, created_at, settled_at)
       select 'chart_probe', 'at-least-once', 'old-' || g, '{}', 'succeeded', now() - interval '30 days' + g * interval '1 second', now() - interval '30 days' + g * interval '1 second' + interval '1 second'
       from generate_series(1, 200000) g`,
    );
    await t.pool.query(
      `insert into outboxd.operation_events (operation_id, type, at, details)
       select gen_random_uuid(), 'sent', now() - interval '30 days' + g * interval '1 second', '{}' from generate_series(1, 200000) g`,
    );
    await t.pool.query('analyze outboxd.payment_operations, outboxd.operation_events');
    const from = new Date(Date.now() - CHART_HOURS * 3_600_000);
    const sql = t.pool.sql;
    for (const statement of [sql.settlementsByMinute(from), sql.oldestUnsettledByMinute(from), sql.gatewayCallsByMinute(from, 'x%')]) {
      // A connection of its own, dropped afterwards with what it prepared and set.
      const client = await t.pool.connect();
      try {
        // The plan for any parameter (a generic plan), not only for this one.
        await client.query('set plan_cache_mode = force_generic_plan');
        await client.query({ name: 'chart_probe', text: statement.text, values: statement.values as unknown[] });
        const literal = (v: unknown) => client.escapeLiteral(v instanceof Date ? v.toISOString() : String(v));
        const explained = await client.query(`explain (format json) execute chart_probe(${statement.values!.map(literal).join(', ')})`);
        const scans: { type: string; relation: string }[] = [];
        const walk = (node: Record<string, any>) => {
          if (node['Relation Name']) scans.push({ type: node['Node Type'], relation: node['Relation Name'] });
          for (const child of node.Plans ?? []) walk(child);
        };
        walk(explained.rows[0]['QUERY PLAN'][0].Plan);
        const big = scans.filter((x) => x.relation === 'payment_operations' || x.relation === 'operation_events');
        expect(big.length, statement.name).toBeGreaterThan(0);
        for (const scan of big) expect(scan.type, `${statement.name}: ${JSON.stringify(scans)}`).not.toBe('Seq Scan');
      } finally {
        client.release(true);
      }
    }
  });

  it('draw an empty window as such, and a column per minute with its numbers in its title', () => {
    const from = new Date('2026-12-03T09:00:00Z');
    const empty = String(timeChart({ title: 'Settlements per minute', from, format: String, empty: 'nothing settled', bars: [{ name: 'succeeded', cls: 's-good', values: [0, 0, 0] }] }));
    expect(empty).toContain('nothing settled');
    const drawn = String(timeChart({ title: 'Settlements per minute', from, format: String, empty: 'nothing settled',
      bars: [{ name: 'succeeded', cls: 's-good', values: [1, 0, 4] }, { name: 'failed', cls: 's-bad', values: [0, 2, 1] }] }));
    expect(drawn).not.toContain('nothing settled');
    expect(drawn).toContain('<title>09:02 UTC: succeeded 4, failed 1</title>');
    expect(drawn.match(/<rect class="s-good"/g)).toHaveLength(2);
    expect(drawn.match(/<rect class="s-bad"/g)).toHaveLength(2);
    expect(drawn).not.toMatch(/style=|<script/);
  });
});

describe("links to Stripe's dashboard", () => {
  it("open each object's page in a new tab, under /test in test mode", () => {
    const test = 'https://dashboard.stripe.com/test';
    expect(dashboardUrl(test, 'pi_123')).toBe('https://dashboard.stripe.com/test/payments/pi_123');
    expect(dashboardUrl(test, 're_123')).toBe('https://dashboard.stripe.com/test/refunds/re_123');
    expect(dashboardUrl(test, 'cus_123')).toBe('https://dashboard.stripe.com/test/customers/cus_123');
    expect(dashboardUrl('https://dashboard.stripe.com', 'pi_9')).toBe('https://dashboard.stripe.com/payments/pi_9');
    expect(dashboardUrl(test, 'pm_card_visa')).toBeUndefined();
    const link = String(stripeLink('pi_123', test));
    expect(link).toMatch(/^<a class="mono" href="https:\/\/dashboard\.stripe\.com\/test\/payments\/pi_123" rel="noopener noreferrer" target="_blank"/);
    expect(String(stripeLink('pi_123', undefined))).toBe('<span class="mono">pi_123</span>');
    expect(String(stripeLink('pi_"><script>', test))).not.toContain('<script>');
  });
});
