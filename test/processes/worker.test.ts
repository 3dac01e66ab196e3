// `outboxd worker` as a real process: startup failures stop it at once with one clear line, the admin
// API can listen apart from the webhook/probe port, and its logs and metrics name each thing once.
import { spawn } from 'node:child_process';
import { createServer, type Server } from 'node:net';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { parseDocument } from 'yaml';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { databaseUrl, freePort } from '../../src/db/embedded.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation, outboxRows } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
const TOKEN = 'worker-test-admin-token-0123';

interface Run {
  /** Every stderr line as written. */
  lines: string[];
  exited: Promise<{ code: number | null; ms: number }>;
  ready: Promise<{ httpPort: number; adminHttpPort?: number }>;
  stop(): Promise<void>;
}

function runWorker(env: Record<string, string>): Run {
  const started = Date.now();
  const proc = spawn(process.execPath, [BIN, 'worker'], {
    env: { ...process.env, HTTP_HOST: '127.0.0.1', HTTP_PORT: '0', LOG_LEVEL: 'info', ...env },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const lines: string[] = [];
  let partial = '';
  let onReady: (v: { httpPort: number; adminHttpPort?: number }) => void;
  const ready = new Promise<{ httpPort: number; adminHttpPort?: number }>((resolve) => (onReady = resolve));
  proc.stderr.on('data', (d: Buffer) => {
    const parts = (partial + d.toString()).split('\n');
    partial = parts.pop()!;
    for (const line of parts) {
      lines.push(line);
      if (line.includes('"worker ready"')) onReady(JSON.parse(line));
    }
  });
  const exited = new Promise<{ code: number | null; ms: number }>((resolve) =>
    proc.once('exit', (code) => {
      if (partial) lines.push(partial);
      resolve({ code, ms: Date.now() - started });
    }),
  );
  // Bounded: a worker that does not stop is killed, and the test sees a null code.
  const guard = setTimeout(() => proc.kill('SIGKILL'), 30_000);
  void exited.then(() => clearTimeout(guard));
  return {
    lines,
    exited,
    ready,
    stop: async () => {
      proc.kill('SIGTERM');
      await exited;
    },
  };
}

/** The lines that are not pino's JSON: what a person reads. */
const prose = (lines: string[]) => lines.filter((l) => l.trim() && !l.startsWith('{'));

async function listening(port: number): Promise<Server> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
  return server;
}

let t: TestDb;
let e: RunningEmulator;
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});

describe('a startup failure stops the worker with one clear line', () => {
  it('schema not migrated: says to run `outboxd migrate`', async () => {
    const admin = new pg.Client({ connectionString: inject('adminUrl') });
    await admin.connect();
    const name = `unmigrated_${process.pid}`;
    await admin.query(`drop database if exists ${name}`);
    await admin.query(`create database ${name}`);
    try {
      const run = runWorker({ DATABASE_URL: databaseUrl(inject('adminUrl'), name), STRIPE_API_BASE: e.url });
      const { code } = await run.exited;
      expect(code).toBe(1);
      expect(prose(run.lines)).toEqual([expect.stringMatching(new RegExp(`^outboxd: the database at .+/${name} is not migrated: run \`outboxd migrate\`$`))]);
    } finally {
      await admin.query(`drop database if exists ${name} with (force)`);
      await admin.end();
    }
  });

  it('database unreachable: fails within seconds naming host and port, never the password', async () => {
    const refusedPort = await freePort();
    // A port that accepts connections and never answers: the case that hung before.
    const silent = createServer(() => {});
    await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
    const silentPort = (silent.address() as { port: number }).port;
    try {
      const [refused, mute] = [
        runWorker({ DATABASE_URL: `postgres://outboxd:s3cret-pw@127.0.0.1:${refusedPort}/outboxd`, STRIPE_API_BASE: e.url }),
        runWorker({ DATABASE_URL: `postgres://outboxd:s3cret-pw@127.0.0.1:${silentPort}/outboxd`, STRIPE_API_BASE: e.url }),
      ];
      const [r1, r2] = await Promise.all([refused.exited, mute.exited]);
      expect(r1.code).toBe(1);
      expect(prose(refused.lines)).toEqual([`outboxd: cannot reach the database at 127.0.0.1:${refusedPort}/outboxd (ECONNREFUSED): check DATABASE_URL`]);
      expect(r2.code).toBe(1);
      expect(prose(mute.lines)).toEqual([`outboxd: cannot reach the database at 127.0.0.1:${silentPort}/outboxd (no answer within 5 s): check DATABASE_URL`]);
      for (const run of [refused, mute]) expect(run.lines.join('\n')).not.toContain('s3cret-pw');
    } finally {
      silent.close();
    }
  });

  it('HTTP port in use: exits before it claims anything (no probes, no dispatching)', async () => {
    const op = await confirm(t);
    const busy = await listening(0);
    const busyPort = (busy.address() as { port: number }).port;
    const requestsBefore = e.emulator.requests().length;
    try {
      const run = runWorker({ DATABASE_URL: t.url, STRIPE_API_BASE: e.url, HTTP_PORT: String(busyPort) });
      expect((await run.exited).code).toBe(1);
      expect(prose(run.lines)).toEqual([`outboxd: cannot listen on 127.0.0.1:${busyPort} (HTTP_HOST, HTTP_PORT): the port is in use by another process`]);

      const admin = runWorker({ DATABASE_URL: t.url, STRIPE_API_BASE: e.url, ADMIN_TOKEN: TOKEN, ADMIN_HTTP_PORT: String(busyPort) });
      expect((await admin.exited).code).toBe(1);
      expect(prose(admin.lines)).toEqual([`outboxd: cannot listen on 127.0.0.1:${busyPort} (ADMIN_HTTP_HOST, ADMIN_HTTP_PORT): the port is in use by another process`]);
    } finally {
      busy.close();
    }
    // Nothing was relayed, claimed or sent.
    expect(await outboxRows(t, op)).toBe(1);
    expect(await operation(t, op)).toMatchObject({ status: 'pending', attempts: 0, fence: 0 });
    expect(e.emulator.requests().length).toBe(requestsBefore);
  });
});

describe('a running worker', () => {
  let run: Run;
  let ports: { httpPort: number; adminHttpPort?: number };
  beforeAll(async () => {
    run = runWorker({
      DATABASE_URL: t.url,
      STRIPE_API_BASE: e.url,
      STRIPE_WEBHOOK_SECRET: 'whsec_worker_test',
      ADMIN_TOKEN: TOKEN,
      ADMIN_HTTP_PORT: '0',
    });
    ports = await Promise.race([run.ready, run.exited.then(() => Promise.reject(new Error(run.lines.join('\n'))))]);
  });
  afterAll(() => run.stop());

  const get = (port: number, path: string, init: RequestInit = {}) => fetch(`http://127.0.0.1:${port}${path}`, init);
  const auth = { headers: { Authorization: `Bearer ${TOKEN}` } };

  it('serves the admin API on ADMIN_HTTP_PORT only; probes and webhooks on HTTP_PORT only', async () => {
    const { httpPort, adminHttpPort } = ports;
    expect(adminHttpPort).toBeGreaterThan(0);
    expect(adminHttpPort).not.toBe(httpPort);
    expect((await get(adminHttpPort!, '/admin/operations', auth)).status).toBe(200);
    expect((await get(httpPort, '/admin/operations', auth)).status).toBe(404);
    expect((await get(httpPort, '/admin/reconcile', { ...auth, method: 'POST' })).status).toBe(404);
    expect((await get(httpPort, '/healthz')).status).toBe(200);
    expect((await get(adminHttpPort!, '/healthz')).status).toBe(404);
    expect((await get(httpPort, '/webhooks/stripe', { method: 'POST', body: '{}' })).status).toBe(400); // bad signature
    expect((await get(adminHttpPort!, '/webhooks/stripe', { method: 'POST', body: '{}' })).status).toBe(404);
  });

  it("logs pg-boss's warnings (here a queue's backlog past its threshold), the same one once a minute", { timeout: 30_000 }, async () => {
    // The dead letter of settlement events, which nobody works, with a threshold of one job.
    await t.boss.updateQueue('settled_dead', { warningQueueSize: 1 });
    await t.boss.insert('settled_dead', [{ data: { operationId: 'a' } }, { data: { operationId: 'b' } }]);
    const backlog = () => run.lines.filter((l) => l.includes('"level":40') && l.includes('large queue backlog') && l.includes('settled_dead'));
    try {
      await waitUntil(() => backlog().length > 0, 15_000, 'the backlog warning');
      // pg-boss says it again at each monitor pass (every 5 s): two more passes, no second line.
      await new Promise((r) => setTimeout(r, 11_000));
      expect(backlog()).toHaveLength(1);
    } finally {
      await t.pool.query(`delete from pgboss.job where name = 'settled_dead'`);
      await t.boss.updateQueue('settled_dead', { warningQueueSize: null as unknown as number });
    }
  });

  it('log lines carry each key once, and metric names carry the prefix once', async () => {
    const op = await confirm(t);
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'the charge settles');
    await waitUntil(() => run.lines.some((l) => l.includes('"gateway call finished"') && l.includes(op)), 5_000, 'its log line');
    const json = run.lines.filter((l) => l.startsWith('{'));
    expect(json.length).toBeGreaterThan(3);
    for (const line of json) {
      const duplicates = parseDocument(line, { uniqueKeys: true }).errors.filter((err) => err.code === 'DUPLICATE_KEY');
      expect(duplicates, line).toEqual([]);
    }
    const finished = JSON.parse(json.find((l) => l.includes('"gateway call finished"') && l.includes(op))!);
    expect(finished).toMatchObject({ operationId: op, attempt: 1, jobRetry: 0 });

    const metrics = await (await get(ports.httpPort, '/metrics')).text();
    const names = [...metrics.matchAll(/^# TYPE (\S+) /gm)].map((m) => m[1]!);
    expect(names).toContain('outboxd_process_cpu_user_seconds_total');
    for (const name of names) {
      expect(name).toMatch(/^outboxd_/);
      expect(name, 'a doubled word').not.toMatch(/(^|_)([a-z]+)_\2_/);
    }
  });
});

describe('/readyz, on the listener anyone may reach (the webhooks\')', () => {
  /** What a worker commits from its start to its stop (its sessions report their counts as they end),
   * with `during` run once it is ready. */
  const committedBy = async (during: (httpPort: number) => Promise<void>) => {
    const commits = async () => Number((await t.pool.query(`select xact_commit from pg_stat_database where datname = current_database()`)).rows[0].xact_commit);
    await new Promise((r) => setTimeout(r, 1_100)); // the test's own session reports at most once a second
    const before = await commits();
    const run = runWorker({ DATABASE_URL: t.url, STRIPE_API_BASE: e.url });
    const { httpPort } = await Promise.race([run.ready, run.exited.then(() => Promise.reject(new Error(run.lines.join('\n'))))]);
    await during(httpPort);
    await run.stop();
    await new Promise((r) => setTimeout(r, 1_100));
    return (await commits()) - before;
  };

  it('a flood of it costs the database a statement a second, not one each: they queued the claims behind them on the dispatcher\'s pool', async () => {
    const flood = async (port: number) => {
      for (let round = 0; round < 20; round++) {
        const answers = await Promise.all(Array.from({ length: 50 }, () => fetch(`http://127.0.0.1:${port}/readyz`).then((r) => r.status)));
        expect(answers.every((status) => status === 200)).toBe(true);
      }
    };
    const flooded = await committedBy(flood);
    const idle = await committedBy(() => new Promise((r) => setTimeout(r, 1_000)));
    // 1,000 probes, against a worker idle for about as long.
    expect(flooded - idle).toBeLessThan(200);
  });
});
