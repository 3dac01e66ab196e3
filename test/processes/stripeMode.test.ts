// Fail closed on the Stripe configuration: real processes, started as an operator or a container would.
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { startReplica, type Replica } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm } from '../support/fixtures.ts';

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
let t: TestDb;
let e: RunningEmulator;
const replicas: Replica[] = [];
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
afterEach(async () => {
  for (const r of replicas.splice(0)) {
    r.kill('SIGKILL');
    await r.exited;
  }
});

type Env = Record<string, string | undefined>;
const base = (): Env => ({ DATABASE_URL: t.url, NODE_ENV: 'development', STRIPE_SECRET_KEY: undefined, STRIPE_API_BASE: undefined, OUTBOXD_STRIPE_EMULATOR: undefined, LOG_LEVEL: 'warn', HTTP_PORT: '0' });

function run(args: string[], over: Env): Promise<{ code: number | null; stdout: string; stderr: string }> {
  const env: NodeJS.ProcessEnv = { ...process.env };
  for (const [k, v] of Object.entries({ ...base(), ...over })) {
    if (v === undefined) delete env[k];
    else env[k] = v;
  }
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { env });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), 30_000); // a worker that started anyway
    child.on('exit', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

const oneLine = (stderr: string) => stderr.trim().split('\n');

describe('production never pays through an emulator by accident', () => {
  it.each([
    ['missing', undefined],
    ['blank', '   '],
  ])('STRIPE_SECRET_KEY %s under NODE_ENV=production: the worker refuses to start, naming it (exit 2)', async (_, key) => {
    for (const apiBase of [undefined, e.url]) {
      const res = await run(['worker'], { NODE_ENV: 'production', STRIPE_SECRET_KEY: key, STRIPE_API_BASE: apiBase });
      expect(res.code).toBe(2);
      expect(oneLine(res.stderr)).toHaveLength(1);
      expect(res.stderr).toMatch(/STRIPE_SECRET_KEY/);
      expect(res.stderr).toMatch(/OUTBOXD_STRIPE_EMULATOR/);
    }
    expect(e.emulator.requests()).toHaveLength(0);
  });

  it('OUTBOXD_STRIPE_EMULATOR=true opts a production demo into the emulator, which says so; /metrics shows the mode', async () => {
    const demo = await startReplica({ DATABASE_URL: t.url, NODE_ENV: 'production', OUTBOXD_STRIPE_EMULATOR: 'true', STRIPE_SECRET_KEY: '' });
    replicas.push(demo);
    expect(demo.logs.find((l) => String(l.msg).includes('no real money moves'))).toMatchObject({ level: 40, stripeMode: 'emulator' });
    expect(await demo.metric('outboxd_stripe_mode{mode="emulator"}')).toBe(1);
    expect(await demo.metric('outboxd_stripe_mode{mode="live"}')).toBe(0);

    const test = await startReplica({ DATABASE_URL: t.url, NODE_ENV: 'production', STRIPE_SECRET_KEY: 'sk_test_outboxd', STRIPE_API_BASE: e.url });
    replicas.push(test);
    expect(await test.metric('outboxd_stripe_mode{mode="test"}')).toBe(1);
    expect(await test.metric('outboxd_stripe_mode{mode="emulator"}')).toBe(0);
  });

  it('the opt-in beside a key, or a key of no known mode, is refused', async () => {
    const both = await run(['reconcile', '--report'], { OUTBOXD_STRIPE_EMULATOR: 'true', STRIPE_SECRET_KEY: 'sk_test_outboxd', STRIPE_API_BASE: e.url });
    expect(both.code).toBe(2);
    expect(both.stderr).toMatch(/OUTBOXD_STRIPE_EMULATOR and STRIPE_SECRET_KEY/);
    const odd = await run(['reconcile', '--report'], { STRIPE_SECRET_KEY: 'pk_live_publishable', STRIPE_API_BASE: e.url });
    expect(odd.code).toBe(2);
    expect(odd.stderr).toMatch(/STRIPE_SECRET_KEY/);
  });

  it('a live key is never sent to a host other than Stripe: STRIPE_API_BASE with sk_live_ is refused at startup', async () => {
    for (const args of [['worker'], ['reconcile', '--report']]) {
      const res = await run(args, { STRIPE_SECRET_KEY: 'sk_live_not_for_emulators', STRIPE_API_BASE: e.url });
      expect(res.code).toBe(2);
      expect(oneLine(res.stderr)).toHaveLength(1);
      expect(res.stderr).toMatch(/STRIPE_API_BASE/);
      expect(res.stderr).toMatch(/STRIPE_SECRET_KEY/);
    }
    expect(e.emulator.requests()).toHaveLength(0);
  });
});

describe('evidence is never an emulator that knows nothing', () => {
  it.each([
    [['reconcile', '--report']],
    [['reconcile']],
    [['ops', 'resolve', 'OP', '--failed', '--reason', 'no charge']],
  ])('%j with DATABASE_URL and no STRIPE_SECRET_KEY: refused in one line naming STRIPE_SECRET_KEY and STRIPE_API_BASE', async (args) => {
    // An operation that exists: one that does not is said first, before Stripe is opened.
    const op = args.includes('OP') ? await confirm(t) : undefined;
    const res = await run(args.map((a) => (a === 'OP' ? op! : a)), {});
    expect(res.code).toBe(2);
    expect(oneLine(res.stderr)).toHaveLength(1);
    expect(res.stderr).toMatch(/STRIPE_SECRET_KEY/);
    expect(res.stderr).toMatch(/STRIPE_API_BASE/);
  });

  it('with STRIPE_API_BASE at the emulator the workers share, the same command runs', async () => {
    const res = await run(['reconcile', '--report', '--json'], { STRIPE_API_BASE: e.url });
    expect(res.code, res.stderr).toBe(0);
    expect(JSON.parse(res.stdout)).toMatchObject({ drift: [] });
  });
});
