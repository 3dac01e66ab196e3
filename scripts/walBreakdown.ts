// `npm run bench:wal`: where the WAL of a settled charge goes (issue 25). Drains a backlog with one replica (as the bench's
// growth section does), then lets an unnamed onSettled handler take the settlement events, then runs the peer, each from a checkpoint, and reads the WAL of each window back with
// pg_walinspect: bytes per settled operation by relation, record type and step (the transaction that wrote
// it, classified by the relations it touched), full-page images apart. WAL_FPW=off repeats it with
// full_page_writes off (what is left without FPIs). Prints markdown; writes bench/results/wal-<time>.json.
import { randomUUID } from 'node:crypto';
import { execFileSync } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { confirmOrder } from '../src/exampleApp/confirm.ts';
import { bossDb } from '../src/db/pool.ts';
import { Outboxd } from '../src/outboxd.ts';
import { EMULATOR_KEY } from '../src/runtime/open.ts';
import { PEER_QUEUE, startPeer, type PeerJob } from '../harness/peer.ts';
import { waitUntil } from '../harness/replica.ts';
import { DEPLOYED_NODE_ARGS, startWorld, type World } from '../harness/world.ts';

const N = Number(process.env.WAL_BACKLOG ?? 1500);
const FPW = process.env.WAL_FPW ?? 'on';
const say = (s: string) => process.stderr.write(`${s}\n`);
const order = (n: number) => ({ orderId: `wal-${randomUUID()}-${n}`, amount: 1000, currency: 'eur', customer: 'cus_bench', paymentMethod: 'pm_card_visa' });

const lsn = async (w: World) => (await w.pool.query(`select pg_current_wal_lsn()::text as l`)).rows[0].l as string;
const one = async (w: World, sql: string) => Number((await w.pool.query(sql)).rows[0].n);

interface Window { name: string; from: string; to: string }

/** Per record: its transaction, its first block's relation, its bytes, its FPI bytes by relation. */
async function inspect(w: World, win: Window) {
  const c = new pg.Client({ connectionString: w.url });
  await c.connect();
  try {
    await c.query('set statement_timeout = 0');
    const { rows: recs } = await c.query(
      `select start_lsn::text, xid::text as xid, resource_manager as rm, record_type as rt, record_length as len, fpi_length as fpi
       from pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) order by start_lsn`, [win.from, win.to]);
    const { rows: blks } = await c.query(
      `with b as (select * from pg_get_wal_block_info($1::pg_lsn, $2::pg_lsn, false)),
       names as (select distinct reltablespace, reldatabase, relfilenode from b)
       select b.start_lsn::text, b.block_id, b.relforknumber as fork, b.block_fpi_length as fpi, n.rel
       from b join (select reltablespace, reldatabase, relfilenode,
                      coalesce(pg_filenode_relation(case when reltablespace = 1663 then 0 else reltablespace end, relfilenode)::regclass::text,
                               case when reldatabase = 0 then 'shared catalog' else 'rel ' || relfilenode end) as rel from names) n
         using (reltablespace, reldatabase, relfilenode)
       order by b.start_lsn, b.block_id`, [win.from, win.to]);
    const byLsn = new Map<string, { rel: string; fpi: number }[]>();
    for (const b of blks) {
      const rel = b.fork === 0 ? b.rel : `${b.rel} (fork ${b.fork})`;
      (byLsn.get(b.start_lsn) ?? byLsn.set(b.start_lsn, []).get(b.start_lsn)!).push({ rel, fpi: Number(b.fpi ?? 0) });
    }
    return recs.map((r) => {
      const bs = byLsn.get(r.start_lsn) ?? [];
      return { ...r, len: Number(r.len), fpi: Number(r.fpi), rel: bs[0]?.rel ?? '-', fpis: bs.filter((b) => b.fpi > 0) };
    }) as { start_lsn: string; xid: string; rm: string; rt: string; len: number; fpi: number; rel: string; fpis: { rel: string; fpi: number }[] }[];
  } finally {
    await c.end();
  }
}

/** A transaction's step, from the set of relations it wrote. */
function step(rels: Set<string>): string {
  const has = (s: string) => [...rels].some((r) => r.includes(s));
  if (has('orders')) return 'confirm (order + operation + outbox)';
  if (has('charge_outbox') && has('job')) return 'relay (outbox → charge job)';
  if (has('settlement_outbox') && has('job')) return 'settlement relay (→ a subscriber\'s job)';
  if (has('settlement_outbox') && has('payment_operations')) return 'outcome (fenced, + settlement event)';
  if (has('settlement_outbox')) return 'onSettled delivery (lease, delete)';
  if (has('payment_operations')) return 'claim (+ attempt)';
  if (has('job')) return 'pg-boss (insert/fetch/complete/maintain)';
  if (rels.size === 0) return 'no relation (commit-only / running xacts)';
  return 'other';
}

async function analyse(w: World, win: Window, ops: number) {
  const recs = await inspect(w, win);
  const relsOf = new Map<string, Set<string>>();
  for (const r of recs) {
    if (r.xid === '0') continue;
    const set = relsOf.get(r.xid) ?? relsOf.set(r.xid, new Set()).get(r.xid)!;
    if (r.rel !== '-') set.add(r.rel);
    for (const f of r.fpis) set.add(f.rel);
  }
  const byRel = new Map<string, { rec: number; fpi: number; n: number }>();
  const byRelType = new Map<string, { rec: number; fpi: number; n: number }>();
  const byStep = new Map<string, { rec: number; fpi: number; n: number; tx: Set<string> }>();
  const add = <T extends { rec: number; fpi: number; n: number }>(m: Map<string, T>, k: string, rec: number, fpi: number, init: () => T) => {
    const e = m.get(k) ?? m.set(k, init()).get(k)!;
    e.rec += rec;
    e.fpi += fpi;
    e.n += rec > 0 ? 1 : 0;
    return e;
  };
  let total = 0;
  let checkpoints = 0;
  for (const r of recs) {
    total += r.len;
    if (r.rt.startsWith('CHECKPOINT')) checkpoints++;
    const nonFpi = r.len - r.fpi;
    const rel = r.rel === '-' ? `(${r.rm})` : r.rel;
    add(byRel, rel, nonFpi, 0, () => ({ rec: 0, fpi: 0, n: 0 }));
    add(byRelType, `${rel} | ${r.rm}/${r.rt}`, nonFpi, 0, () => ({ rec: 0, fpi: 0, n: 0 }));
    for (const f of r.fpis) {
      add(byRel, f.rel, 0, f.fpi, () => ({ rec: 0, fpi: 0, n: 0 }));
      add(byRelType, `${f.rel} | ${r.rm}/${r.rt}`, 0, f.fpi, () => ({ rec: 0, fpi: 0, n: 0 }));
    }
    const st = r.xid === '0' ? `no transaction (${r.rm})` : step(relsOf.get(r.xid)!);
    add(byStep, st, r.len - r.fpi, r.fpi, () => ({ rec: 0, fpi: 0, n: 0, tx: new Set<string>() })).tx.add(r.xid);
  }
  const per = (x: number) => x / ops;
  const table = (m: Map<string, { rec: number; fpi: number; n: number }>, title: string) => {
    const lines = [`| ${title} | records/op | bytes/op (no FPI) | FPI bytes/op | total/op |`, '|---|---|---|---|---|'];
    for (const [k, v] of [...m].sort((a, b) => b[1].rec + b[1].fpi - a[1].rec - a[1].fpi)) {
      if ((v.rec + v.fpi) / ops < 1) continue;
      lines.push(`| ${k} | ${per(v.n).toFixed(2)} | ${per(v.rec).toFixed(0)} | ${per(v.fpi).toFixed(0)} | ${per(v.rec + v.fpi).toFixed(0)} |`);
    }
    return lines.join('\n');
  };
  const fpiTotal = recs.reduce((s, r) => s + r.fpi, 0);
  return {
    name: win.name,
    totalPerOp: total / ops,
    fpiPerOp: fpiTotal / ops,
    checkpoints,
    byRel: Object.fromEntries([...byRel].map(([k, v]) => [k, { rec: per(v.rec), fpi: per(v.fpi), n: per(v.n) }])),
    byStep: Object.fromEntries([...byStep].map(([k, v]) => [k, { rec: per(v.rec), fpi: per(v.fpi), n: per(v.n), tx: v.tx.size / ops }])),
    md: [
      `### ${win.name}: ${(total / ops).toFixed(0)} B/op (FPI ${(fpiTotal / ops).toFixed(0)} B/op), checkpoints inside the window: ${checkpoints}`,
      '',
      table(byRel, 'relation'),
      '',
      table(byStep, 'step (transaction)'),
      '',
      table(byRelType, 'relation | rmgr/record'),
    ].join('\n'),
  };
}

execFileSync('npx', ['tsc', '-p', 'tsconfig.build.json'], { stdio: 'inherit' });
const w = await startWorld({ name: 'wal', replicaEntry: fileURLToPath(new URL('../dist/cli/main.js', import.meta.url)) });
try {
  await w.pool.query('create extension if not exists pg_walinspect');
  await w.pool.query(`alter system set full_page_writes = ${FPW === 'off' ? 'off' : 'on'}`);
  // Keep every segment of the windows through the later checkpoints, until they are read back.
  await w.pool.query(`alter system set wal_keep_size = '4GB'`);
  await w.pool.query('select pg_reload_conf()');
  await new Promise((r) => setTimeout(r, 300));
  say(`full_page_writes = ${(await w.pool.query('show full_page_writes')).rows[0].full_page_writes}`);
  const md: string[] = [];
  const out: Record<string, unknown> = {};

  // An experiment on the schema, before any row is written (a knob, not a migration).
  if (process.env.WAL_FILLFACTOR) await w.pool.query(`alter table outboxd.payment_operations set (fillfactor = ${Number(process.env.WAL_FILLFACTOR)})`);

  // outboxd: confirmation, then one replica draining it (relay, claim, call, outcome, completion, settlement relay).
  await w.pool.query('checkpoint');
  const a0 = await lsn(w);
  await Promise.all(Array.from({ length: 16 }, async (_, c) => {
    for (let i = c; i < N; i += 16) await confirmOrder(w.pool, order(i));
  }));
  const a1 = await lsn(w);
  const r = await w.startReplica({ WORKER_CONCURRENCY: '8', LOG_LEVEL: 'warn' });
  await waitUntil(async () => (await one(w, `select count(*) as n from outboxd.payment_operations where settled_at is not null`)) >= N
    && (await one(w, `select count(*) as n from outboxd.settlement_outbox`)) >= N
    && (await one(w, `select count(*) as n from pgboss.job where name = 'charge' and state = 'completed'`)) >= N, 300_000, 'drained');
  r.kill('SIGTERM');
  await r.exited;
  w.replicas.length = 0;
  const a2 = await lsn(w);
  const rowsOurs = await one(w, `select (select count(*) from outboxd.payment_operations) + (select count(*) from outboxd.operation_events)
      + (select count(*) from outboxd.charge_outbox) + (select count(*) from outboxd.settlement_outbox)
      + (select count(*) from pgboss.job where name in ('charge', 'settled')) as n`);
  const events = (await w.pool.query(`select type, count(*)::int as n from outboxd.operation_events group by type order by type`)).rows;

  // An application's unnamed onSettled handler takes every event (a lease and a delete each).
  const app = new Outboxd({ connectionString: w.url, onError: (err) => say(`onSettled: ${err.message}`) });
  await app.onSettled(() => {});
  await waitUntil(async () => (await one(w, `select count(*) as n from outboxd.settlement_outbox`)) === 0, 300_000, 'events taken');
  await app.stop();
  const a3 = await lsn(w);
  const hot = (await w.pool.query(`select relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del from pg_stat_user_tables
     where relname in ('payment_operations', 'operation_events', 'charge_outbox', 'settlement_outbox') or schemaname = 'pgboss' order by relname`)).rows;

  // The peer: its jobs' insert, then one process (8 loops × batch 1) working them.
  await w.boss.createQueue(PEER_QUEUE, { notify: true });
  await w.pool.query('checkpoint');
  const b0 = await lsn(w);
  const o = order(0);
  const job = (i: number): { data: PeerJob } => ({ data: { amount: o.amount, currency: o.currency, customer: o.customer, payment_method: o.paymentMethod, metadata: { order_id: `peer-${i}` } } });
  for (let i = 0; i < N; i += 500) await w.boss.insert(PEER_QUEUE, Array.from({ length: Math.min(500, N - i) }, (_, k) => job(i + k)), { db: bossDb(w.pool) });
  const b1 = await lsn(w);
  const p = await startPeer({ DATABASE_URL: w.url, STRIPE_API_BASE: w.emulatorUrl, STRIPE_SECRET_KEY: EMULATOR_KEY, PEER_SLOTS: '8', PEER_BATCH: '1' }, DEPLOYED_NODE_ARGS);
  await waitUntil(async () => (await one(w, `select count(*) as n from pgboss.job where name = '${PEER_QUEUE}' and state = 'completed'`)) >= N, 300_000, 'peer drained');
  p.kill('SIGTERM');
  await p.exited;
  const b2 = await lsn(w);

  const wins: [Window, number][] = [
    [{ name: 'outboxd, whole (confirm → settled, its event waiting)', from: a0, to: a2 }, N],
    [{ name: 'outboxd, confirmation only', from: a0, to: a1 }, N],
    [{ name: 'outboxd, worker only', from: a1, to: a2 }, N],
    [{ name: 'outboxd, an onSettled handler taking the events', from: a2, to: a3 }, N],
    [{ name: 'peer, whole (insert → completed)', from: b0, to: b2 }, N],
  ];
  for (const [win, ops] of wins) {
    const res = await analyse(w, win, ops);
    md.push(res.md, '');
    out[win.name] = res;
    say(`${win.name}: ${res.totalPerOp.toFixed(0)} B/op, FPI ${res.fpiPerOp.toFixed(0)}`);
  }
  md.push('timeline rows per op: ' + events.map((e) => `${e.type} ${(e.n / N).toFixed(2)}`).join(', '));
  md.push(`rows per op (bench's count): ${(rowsOurs / N).toFixed(2)}`);
  md.push('', '| table | ins | upd | hot upd | del |', '|---|---|---|---|---|', ...hot.map((h) => `| ${h.relname} | ${h.n_tup_ins} | ${h.n_tup_upd} | ${h.n_tup_hot_upd} | ${h.n_tup_del} |`));
  out.events = events;
  out.hot = hot;
  const text = `# WAL breakdown, ${N} operations, full_page_writes=${FPW}\n\n${md.join('\n')}\n`;
  process.stdout.write(text);
  mkdirSync('bench/results', { recursive: true });
  const stamp = new Date().toISOString().replace(/[:.]/g, '-');
  writeFileSync(`bench/results/wal-${FPW}-${stamp}.json`, JSON.stringify(out, null, 1));
  writeFileSync(`bench/results/wal-${FPW}-${stamp}.md`, text);
} finally {
  await w.close();
}
