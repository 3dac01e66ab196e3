// `npm run bench`: what the dispatcher costs against the raw limits of PostgreSQL on the same machine,
// measured side by side in one run (these machines are shared and noisy: ratios, not absolutes).
// Prints a markdown table and writes bench/results/<time>.json and bench/results/latest.md.
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { readFileSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import { PgBoss } from 'pg-boss';
import { bossDb, inTransaction } from '../src/db/pool.ts';
import { confirmOrder } from '../src/orders/confirm.ts';
import { withSpan } from '../src/tracing.ts';
import { runFleet } from './lib/budget.ts';
import { waitUntil, type Replica } from './lib/replica.ts';
import { DEPLOYED_NODE_OPTIONS, startWorld, type World } from './lib/world.ts';

const SECONDS = Number(process.env.BENCH_SECONDS ?? 3);
const BACKLOG = Number(process.env.BENCH_BACKLOG ?? 1500);
const CONCURRENCY = 8;
/** BENCH_ONLY=confirm,dispatch,noop,latency,pickup,tracing,budget runs a subset (while tuning one figure). */
const ONLY = new Set((process.env.BENCH_ONLY ?? 'confirm,dispatch,noop,latency,pickup,tracing,budget').split(','));
const rows: { section: string; measure: string; value: string; reference: string; ratio: string }[] = [];
const results: Record<string, unknown> = {};
const say = (s: string) => process.stderr.write(`${s}\n`);
const fmt = (n: number) => (n >= 100 ? n.toFixed(0) : n.toFixed(1));
const pct = (a: number, b: number) => `${((100 * a) / b).toFixed(0)} %`;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Runs `fn` on `clients` concurrent loops for `seconds`; transactions per second. */
async function rate(clients: number, seconds: number, fn: (i: number) => Promise<unknown>): Promise<number> {
  let done = 0;
  const until = Date.now() + seconds * 1000;
  const started = Date.now();
  await Promise.all(
    Array.from({ length: clients }, async (_, c) => {
      for (let i = 0; Date.now() < until; i++) {
        await fn(c * 1e7 + i);
        done++;
      }
    }),
  );
  return done / ((Date.now() - started) / 1000);
}

const order = (n: number) => ({ orderId: `bench-${randomUUID()}-${n}`, amount: 1000, currency: 'eur', customer: 'cus_bench', paymentMethod: 'pm_card_visa' });
const settledCount = async (w: World) => (await w.pool.query(`select count(*)::int as n from outboxd.payment_operations where settled_at is not null`)).rows[0].n as number;

async function confirmSection(w: World) {
  await w.pool.query(`create table bench_outbox (id bigserial primary key, operation_id uuid not null, created_at timestamptz not null default now())`);
  const raw = (n: number) =>
    inTransaction(w.pool, async (tx) => {
      const o = order(n);
      await tx.query(`insert into outboxd.orders (id, amount, currency, customer_id, payment_method) values ($1, $2, $3, $4, $5)`, [o.orderId, o.amount, o.currency, o.customer, o.paymentMethod]);
      const { rows: op } = await tx.query(
        `insert into outboxd.payment_operations (order_id, amount, currency, customer_id, payment_method) values ($1, $2, $3, $4, $5) returning id`,
        [o.orderId, o.amount, o.currency, o.customer, o.paymentMethod],
      );
      await tx.query(`insert into bench_outbox (operation_id) values ($1)`, [op[0].id]);
    });
  const out: Record<string, unknown> = {};
  for (const clients of [1, 4, 16]) {
    const ours = await rate(clients, SECONDS, (n) => confirmOrder(w.pool, order(n)));
    const base = await rate(clients, SECONDS, raw);
    out[clients] = { confirmOrder: ours, rawThreeInserts: base, ratio: ours / base };
    rows.push({ section: '1. confirm-order', measure: `confirmOrder tx/s, ${clients} client(s)`, value: fmt(ours), reference: `${fmt(base)} (raw 3 inserts)`, ratio: pct(ours, base) });
    say(`confirm ${clients} clients: ${fmt(ours)} vs raw ${fmt(base)}`);
  }
  results.confirm = out;
  // These orders were confirmed to be measured, not dispatched: left in the outbox, they would become a
  // backlog that every later section (and the "idle" pickup) quietly works through.
  await w.pool.query(`truncate bench_outbox, outboxd.charge_outbox, outboxd.payment_operations, outboxd.orders cascade`);
}

async function backlog(w: World, n: number) {
  const before = await settledCount(w);
  await Promise.all(Array.from({ length: 16 }, async (_, c) => {
    for (let i = c; i < n; i += 16) await confirmOrder(w.pool, order(i));
  }));
  return before;
}

/** Drains a backlog with `replicas` fresh replicas; settled operations per second once all are ready. */
async function drain(w: World, replicas: number, n: number, env: Record<string, string>) {
  const before = await backlog(w, n);
  const started: Replica[] = await Promise.all(Array.from({ length: replicas }, () => w.startReplica({ WORKER_CONCURRENCY: String(CONCURRENCY), LOG_LEVEL: 'warn', ...env })));
  const t0 = Date.now();
  const n0 = await settledCount(w);
  let peakConnections = 0;
  let heldDuringCalls = 0;
  const sampler = setInterval(async () => {
    const { rows: r } = await w.pool.query(
      // A worker session inside a transaction while nothing runs in it would be a connection held across
      // a call (invariant 3); sessions running a statement at the sampled instant are not that.
      `select count(*)::int as total,
              count(*) filter (where application_name = 'outboxd-worker' and state like 'idle in transaction%'
                                 and now() - state_change > interval '50 milliseconds')::int as busy
       from pg_stat_activity where datname = current_database()`,
    ).catch(() => ({ rows: [{ total: 0, busy: 0 }] }));
    peakConnections = Math.max(peakConnections, r[0].total);
    heldDuringCalls = Math.max(heldDuringCalls, r[0].busy);
  }, 100);
  await waitUntil(async () => (await settledCount(w)) >= before + n, 300_000, 'the backlog to drain');
  clearInterval(sampler);
  const seconds = (Date.now() - t0) / 1000;
  const rss = started.map((r) => Number(/VmHWM:\s+(\d+)/.exec(readFileSync(`/proc/${r.proc.pid}/status`, 'utf8'))?.[1] ?? 0) / 1024);
  for (const r of started) {
    r.kill('SIGTERM');
    await r.exited;
  }
  w.replicas.length = 0;
  return { rate: (before + n - n0) / seconds, peakConnections, heldDuringCalls, rssMb: rss };
}

/** The commit ceiling: `perOp` short write transactions per operation on the same pool, `clients` at once. */
async function commitCeiling(w: World, clients: number, perOp: number) {
  await w.pool.query(`create table if not exists bench_rows (id int primary key, n bigint not null default 0)`);
  await w.pool.query(`insert into bench_rows (id) select g from generate_series(0, 999) g on conflict do nothing`);
  const txPerSecond = await rate(clients, SECONDS, (i) => w.pool.query(`update bench_rows set n = n + 1 where id = $1`, [i % 1000]));
  return txPerSecond / perOp;
}

async function noopWorker(w: World, best: boolean, n: number) {
  const boss = new PgBoss({ connectionString: w.url, max: 10, useListenNotify: best });
  boss.on('error', () => {});
  await boss.start();
  const queue = `bench_noop_${best ? 'best' : 'default'}`;
  await boss.createQueue(queue, { notify: best });
  await boss.insert(queue, Array.from({ length: n }, () => ({ data: {} })));
  let done = 0;
  const t0 = Date.now();
  if (best) {
    for (let i = 0; i < CONCURRENCY; i++) {
      let id: string | undefined;
      id = await boss.work(queue, { batchSize: 1 }, async () => {
        done++;
        if (id) boss.notifyWorker(id);
      });
    }
  } else {
    await boss.work(queue, async () => void done++);
  }
  await waitUntil(() => done >= n, 300_000, 'no-op jobs');
  const r = n / ((Date.now() - t0) / 1000);
  await boss.stop({ graceful: false });
  return r;
}

/**
 * What tracing costs: the same drain with tracing off (no endpoint, so no SDK) and on (every span
 * exported over OTLP/HTTP protobuf to a receiver here that discards it), alternated twice; and the
 * price of one span where no SDK is registered (the API's no-op), against the time a payment takes.
 */
async function tracingSection(w: World) {
  let exported = 0;
  const sink = createServer((req, res) => {
    req.on('data', (d: Buffer) => (exported += d.length));
    req.on('end', () => res.writeHead(200, { 'Content-Type': 'application/x-protobuf' }).end());
  });
  sink.listen(0, '127.0.0.1');
  await once(sink, 'listening');
  const endpoint = `http://127.0.0.1:${(sink.address() as AddressInfo).port}`;
  const off: number[] = [];
  const on: number[] = [];
  for (let round = 0; round < 2; round++) {
    off.push((await drain(w, 1, BACKLOG, {})).rate);
    on.push((await drain(w, 1, BACKLOG, { OTEL_EXPORTER_OTLP_ENDPOINT: endpoint })).rate);
  }
  sink.close();
  const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
  rows.push({ section: '6. tracing', measure: `settled/s, 1 replica × ${CONCURRENCY}, tracing on (OTLP http/protobuf to a local sink)`, value: fmt(mean(on)), reference: `${fmt(mean(off))} (tracing off)`, ratio: pct(mean(on), mean(off)) });

  const calls = 200_000;
  const noop = async () => {};
  let t0 = performance.now();
  for (let i = 0; i < calls; i++) await noop();
  const bare = performance.now() - t0;
  t0 = performance.now();
  for (let i = 0; i < calls; i++) await withSpan('bench', { 'outboxd.operation_id': 'x' }, noop);
  const perSpanNs = ((performance.now() - t0 - bare) / calls) * 1e6;
  // A payment makes about ten spans (dispatch, claim, gateway, HTTP, outcome, pg-boss's own).
  const perPaymentUs = 1e6 / mean(off);
  rows.push({ section: '6. tracing', measure: "tracing off: 10 no-op spans (no SDK registered) per payment, µs, against the replica's time per payment (1 s / settled/s)", value: ((10 * perSpanNs) / 1000).toFixed(2), reference: `${fmt(perPaymentUs)} µs`, ratio: `${((100 * 10 * perSpanNs) / 1000 / perPaymentUs).toFixed(3)} %` });
  results.tracing = { off, on, exportedBytes: exported, noopSpanNs: perSpanNs };
  say(`tracing: off ${off.map(fmt).join(', ')} /s, on ${on.map(fmt).join(', ')} /s; a no-op span ${perSpanNs.toFixed(0)} ns`);
}

async function latencySection(w: World) {
  await sleep(500);
  w.emulator.clearFaults();
  w.emulator.addFault({ fault: { kind: 'latency', ms: 100 }, count: Infinity });
  const replicas = 2;
  const res = await drain(w, replicas, 800, {});
  const ideal = (replicas * CONCURRENCY) / 0.1;
  rows.push({ section: '3. latency-bound', measure: `settled/s at 100 ms Stripe latency, ${replicas}×${CONCURRENCY}`, value: fmt(res.rate), reference: `${fmt(ideal)} (ideal)`, ratio: pct(res.rate, ideal) });
  rows.push({ section: '5. resources', measure: "worker sessions 'idle in transaction' for > 50 ms while 100 ms calls are in flight (max sampled)", value: String(res.heldDuringCalls), reference: '0', ratio: '' });
  results.latencyBound = { ...res, ideal };
  w.emulator.clearFaults();
}

async function pickupSection(w: World) {
  const replica = await w.startReplica({ WORKER_CONCURRENCY: String(CONCURRENCY), LOG_LEVEL: 'warn' });
  await sleep(1_000);
  const samples: number[] = [];
  const slow: unknown[] = [];
  for (let i = 0; i < 60; i++) {
    const { operationId } = await confirmOrder(w.pool, order(i));
    const t0 = Date.now();
    let activity: unknown;
    await waitUntil(async () => {
      if (!activity && Date.now() - t0 > 3_000) {
        // Slow: what are the sessions doing while this job waits?
        activity = {
          sessions: (await w.pool.query(`select application_name, state, wait_event_type, wait_event, left(query, 120) as query, now() - state_change as for
                                         from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid()`)).rows,
          waitingLocks: (await w.pool.query(`select locktype, mode, relation::regclass::text as rel, pid from pg_locks where not granted`)).rows,
          outbox: (await w.pool.query(`select count(*)::int as n from outboxd.charge_outbox`)).rows[0].n,
        };
      }
      return (await w.pool.query(`select settled_at from outboxd.payment_operations where id = $1`, [operationId])).rows[0].settled_at;
    }, 60_000, 'settled');
    // The database's own clock, not this loop's 50 ms polling: from the confirming transaction to the
    // transaction that recorded the outcome.
    const { rows: timing } = await w.pool.query(
      `select (extract(epoch from settled_at - created_at) * 1000)::float8 as ms from outboxd.payment_operations where id = $1`,
      [operationId],
    );
    samples.push(Math.round(timing[0].ms));
    if (Date.now() - t0 > 2_000) {
      // Keep what a slow one looked like: the explanation belongs next to the number.
      const { rows: op } = await w.pool.query(`select status, attempts, fence, last_error, created_at, settled_at, updated_at from outboxd.payment_operations where id = $1`, [operationId]);
      const jobs = await w.boss.findJobs('charge', { data: { operationId } });
      slow.push({ ms: Date.now() - t0, operation: op[0], jobs: jobs.map((j) => ({ state: j.state, retryCount: j.retryCount, createdOn: j.createdOn, startedOn: j.startedOn, output: j.output })), activity });
    }
    await sleep(150);
  }
  replica.kill('SIGTERM');
  await replica.exited;
  w.replicas.length = 0;
  samples.sort((a, b) => a - b);
  const q = (p: number) => samples[Math.min(samples.length - 1, Math.floor((p / 100) * samples.length))]!;
  results.pickup = { p50: q(50), p95: q(95), p99: q(99), slow };
  for (const x of slow) say(`slow pickup: ${JSON.stringify(x)}`);
  rows.push({ section: '4. end-to-end', measure: 'confirm → settled on an idle worker (database clock), p50 / p95 / p99 (ms)', value: `${q(50)} / ${q(95)} / ${q(99)}`, reference: '≤ 100 (p50 target)', ratio: '' });
}

/**
 * Stripe's rate limit as the fleet's budget (issue 14): 3 replicas × 16 slots against an emulator that
 * enforces test mode's 25 requests/s at 50 ms a call, with STRIPE_RATE_LIMIT=25 and, for reference,
 * without a budget (each replica sends as fast as its slots allow and meets 429s).
 */
async function budgetSection(w: World) {
  const fleet = { replicas: 3, concurrency: 16, limit: 25, latencyMs: 50 };
  const deps = { pool: w.pool, emulator: w.emulator, startReplica: (env: Record<string, string>) => w.startReplica(env) };
  const on = await runFleet(deps, { ...fleet, backlog: 600, budget: 25 });
  w.replicas.length = 0;
  const off = await runFleet(deps, { ...fleet, backlog: 300, budget: undefined });
  w.replicas.length = 0;
  const of = `3 × 16 slots, emulator enforcing 25 requests/s at 50 ms`;
  rows.push({ section: '7. Stripe budget', measure: `requests accepted/s over the limit while a backlog exists, ${of}, STRIPE_RATE_LIMIT=25`, value: on.budgetUse.toFixed(2), reference: `≥ 0.90 (goal); ${off.budgetUse.toFixed(2)} without a budget`, ratio: '' });
  rows.push({ section: '7. Stripe budget', measure: 'calls answered 429', value: `${(100 * on.rateLimitedShare).toFixed(1)} %`, reference: `< 2 % (goal); ${(100 * off.rateLimitedShare).toFixed(0)} % without a budget`, ratio: '' });
  rows.push({ section: '7. Stripe budget', measure: 'statements against the shared bucket per Stripe call; mean wait for a token (ms)', value: `${on.statementsPerRequest.toFixed(2)}; ${fmt(on.meanWaitMs)}`, reference: '', ratio: '' });
  rows.push({ section: '7. Stripe budget', measure: 'operations lost or charged twice (emulator ledger)', value: String(on.notOnce + on.violations.length), reference: '0', ratio: '' });
  results.budget = { on, off };
  say(`budget: use ${on.budgetUse.toFixed(2)} (off ${off.budgetUse.toFixed(2)}), 429 ${(100 * on.rateLimitedShare).toFixed(1)} % (off ${(100 * off.rateLimitedShare).toFixed(0)} %)`);
}

const world = await startWorld({ name: 'bench' });
try {
  say(`bench on ${os.cpus().length} × ${os.cpus()[0]?.model ?? 'cpu'}, ${(os.totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}`);
  if (ONLY.has('confirm')) await confirmSection(world);

  const dispatch: Record<string, unknown> = {};
  let rss: number[] = [];
  let peak = 0;
  for (const replicas of ONLY.has('dispatch') ? [1, 2, 4] : []) {
    const res = await drain(world, replicas, BACKLOG, {});
    const ceiling = await commitCeiling(world, replicas * CONCURRENCY, 4);
    dispatch[replicas] = { ...res, commitCeiling: ceiling, ratio: res.rate / ceiling };
    rss = rss.concat(res.rssMb);
    peak = Math.max(peak, res.peakConnections);
    rows.push({ section: '2. dispatch', measure: `settled/s, ${replicas} replica(s) × ${CONCURRENCY}, emulator at 0 ms`, value: fmt(res.rate), reference: `${fmt(ceiling)} (4 commits/op ceiling)`, ratio: pct(res.rate, ceiling) });
    say(`dispatch ${replicas}: ${fmt(res.rate)}/s vs ceiling ${fmt(ceiling)}`);
  }
  results.dispatch = dispatch;
  if (ONLY.has('noop')) {
    // Default options poll every 2 s after each job: a handful of jobs is enough to see the rate.
    const noopDefault = await noopWorker(world, false, 10);
    const noopBest = await noopWorker(world, true, BACKLOG);
    results.noop = { default: noopDefault, best: noopBest };
    rows.push({ section: '2. dispatch', measure: 'context: pg-boss no-op worker, default work() options (jobs/s)', value: fmt(noopDefault), reference: '', ratio: '' });
    rows.push({ section: '2. dispatch', measure: `context: pg-boss no-op worker, ${CONCURRENCY} self-waking loops + NOTIFY (jobs/s)`, value: fmt(noopBest), reference: '', ratio: '' });
  }
  if (ONLY.has('tracing')) await tracingSection(world);
  if (ONLY.has('latency')) await latencySection(world);
  if (ONLY.has('pickup')) await pickupSection(world);
  if (ONLY.has('budget')) await budgetSection(world);
  if (rss.length) rows.push({ section: '5. resources', measure: `peak RSS per replica (MB), NODE_OPTIONS=${DEPLOYED_NODE_OPTIONS}`, value: fmt(Math.max(...rss)), reference: '150 (target)', ratio: '' });
  if (rss.length) rows.push({ section: '5. resources', measure: 'peak DB connections (bench database, all replicas)', value: String(peak), reference: '', ratio: '' });
  results.resources = { peakRssMb: Math.max(...rss), peakConnections: peak };
} finally {
  await world.close();
}

const machine = `${os.cpus().length} × ${os.cpus()[0]?.model ?? 'cpu'}, ${(os.totalmem() / 2 ** 30).toFixed(0)} GiB RAM, Node ${process.version}, ${new Date().toISOString().slice(0, 10)}`;
const table = [
  `Machine: ${machine}`,
  '',
  '| section | measure | outboxd | reference | ratio |',
  '|---|---|---|---|---|',
  ...rows.map((r) => `| ${r.section} | ${r.measure} | ${r.value} | ${r.reference} | ${r.ratio} |`),
].join('\n');
console.log(table);
const stamp = new Date().toISOString().replace(/[:.]/g, '-');
writeFileSync(`bench/results/${stamp}.json`, JSON.stringify({ machine, results }, null, 2));
writeFileSync('bench/results/latest.md', `${table}\n`);
