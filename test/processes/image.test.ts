// The container image as shipped, on a real Docker engine: built from the working tree with
// deploy/Dockerfile (on the official node:24-slim, or the stand-in deploy/base-image/build.sh makes where no
// registry can be reached), run against the run's PostgreSQL on 127.0.0.1 (--network host) the way
// compose.yaml and the Kubernetes manifests run it: a non-root user, a read-only root filesystem, every
// capability dropped. Skipped, saying so, when no Docker engine answers; .ci/run starts one and sets
// OUTBOXD_REQUIRE_DOCKER=1, which turns the skip into a failure.
import { execFile, execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { writeFile, mkdtemp, rm, chmod } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import { parse } from 'yaml';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { freePort } from '../../src/db/embedded.ts';
import { connectedEmptyDatabase } from '../support/db.ts';
import { waitUntil } from '../../harness/replica.ts';
import { PROBES } from '../../src/runtime/worker.ts';
import { checkConsole } from '../support/consoleCheck.ts';
import { HARDENED_DOCKER_FLAGS, RUN_AS_USER, WORKER_TMP_FLAGS } from '../support/hardening.ts';
import { ROOT } from '../support/release.ts';

const exec = promisify(execFile);
const IMAGE = 'outboxd:image-test';
const BASE = 'node:24-slim';
const docker = async (...args: string[]) => (await exec('docker', args, { cwd: ROOT, maxBuffer: 64 * 1024 * 1024 })).stdout.trim();

function engineAnswers(): boolean {
  try {
    execFileSync('docker', ['info'], { stdio: 'ignore', timeout: 20_000 });
    return true;
  } catch {
    return false;
  }
}
const engine = engineAnswers();
if (!engine) {
  if (process.env.OUTBOXD_REQUIRE_DOCKER === '1') throw new Error('OUTBOXD_REQUIRE_DOCKER=1 but `docker info` fails: no Docker engine to test the image on');
  console.warn('test/processes/image.test.ts SKIPPED: no Docker engine answers `docker info` (start dockerd as root, as .ci/run does)');
}

/** As the Kubernetes manifests run it (test/support/hardening.ts); the worker has a /tmp, as its Deployment does. */
const HARDENED = ['--network', 'host', ...HARDENED_DOCKER_FLAGS];
const WORKER = WORKER_TMP_FLAGS;
const started: string[] = [];
const drops: (() => Promise<void>)[] = [];
let work: string;

const envArgs = (env: Record<string, string>) => Object.entries(env).flatMap(([k, v]) => ['-e', `${k}=${v}`]);

/** A container run to its end (--rm): its stdout. */
const runOnce = (env: Record<string, string>, args: string[], extra: string[] = []) => docker('run', '--rm', ...HARDENED, ...extra, ...envArgs(env), IMAGE, ...args);

/** A long-running container, removed after the file. */
async function runDetached(name: string, env: Record<string, string>, args: string[], extra: string[] = []): Promise<string> {
  const fullName = `outboxd-image-test-${name}-${process.pid}`;
  started.push(fullName);
  await docker('run', '-d', '--name', fullName, ...HARDENED, ...extra, ...envArgs(env), IMAGE, ...args);
  return fullName;
}

async function logLines(container: string): Promise<Record<string, any>[]> {
  const { stdout, stderr } = await exec('docker', ['logs', container], { maxBuffer: 64 * 1024 * 1024 });
  return `${stdout}\n${stderr}`
    .split('\n')
    .filter((l) => l.startsWith('{'))
    .map((l) => JSON.parse(l));
}
const inspect = async (container: string, format: string) => docker('inspect', '--format', format, container);

const database = (prefix: string) => connectedEmptyDatabase(prefix, drops);

/** The emulator as compose's stripe-emulator service runs it (its own container), on a free port. */
async function emulatorContainer(name: string): Promise<string> {
  const port = await freePort();
  const command = (compose.services['stripe-emulator'].command as string[]).map((a, i, all) => (all[i - 1] === '--port' ? String(port) : a));
  await runDetached(name, {}, command);
  const url = `http://127.0.0.1:${port}`;
  await waitUntil(() => fetch(`${url}/_emulator/ledger`).then((r) => r.ok, () => false), 60_000, 'the emulator container');
  return url;
}

/** compose.yaml as Compose reads it: YAML merge keys (`<<: *outboxd`) resolved. */
const compose = parse(readFileSync(path.join(ROOT, 'deploy/compose.yaml'), 'utf8'), { merge: true });

async function settled(client: pg.Client): Promise<Record<string, number>> {
  const { rows } = await client.query(`select status, count(*)::int as n from outboxd.payment_operations group by status`);
  return Object.fromEntries(rows.map((r) => [r.status, r.n]));
}

async function ledger(emulatorUrl: string): Promise<{ paymentIntent: { id: string; metadata: Record<string, string>; status: string } }[]> {
  return (await fetch(`${emulatorUrl}/_emulator/ledger`)).json() as never;
}

describe.skipIf(!engine)('the container image as shipped', () => {
  beforeAll(async () => {
    work = await mkdtemp(path.join(tmpdir(), 'outboxd-image-'));
    await chmod(work, 0o755);
    // No-op when node:24-slim is present or can be pulled.
    const base = await exec('bash', [path.join(ROOT, 'deploy/base-image/build.sh'), BASE], { cwd: ROOT, maxBuffer: 16 * 1024 * 1024 });
    console.log(base.stdout.trim());
    const t0 = Date.now();
    // A proxy the machine's npm and apt go through, handed to the build as Docker's predefined build args.
    const proxies = ['http_proxy', 'https_proxy', 'no_proxy', 'HTTP_PROXY', 'HTTPS_PROXY', 'NO_PROXY'].filter((k) => process.env[k]).flatMap((k) => ['--build-arg', `${k}=${process.env[k]}`]);
    await exec('docker', ['build', '--network', 'host', ...proxies, '-f', 'deploy/Dockerfile', '-t', IMAGE, '.'], { cwd: ROOT, maxBuffer: 64 * 1024 * 1024 });
    console.log(`docker build: ${((Date.now() - t0) / 1000).toFixed(0)} s`);
  }, 30 * 60_000);

  afterAll(async () => {
    for (const c of started) await exec('docker', ['rm', '-f', c]).catch(() => undefined);
    for (const d of drops.reverse()) await d();
    if (work) await rm(work, { recursive: true, force: true });
  }, 120_000);

  it('reports its size above the base, layer by layer', async () => {
    const size = Number(await inspect(IMAGE, '{{.Size}}'));
    const base = Number(await inspect(BASE, '{{.Size}}'));
    const layers = (await docker('history', '--no-trunc', '--format', '{{.Size}}\t{{.CreatedBy}}', IMAGE)).split('\n').slice(0, 12);
    console.log(`image ${(size / 1e6).toFixed(0)} MB, base ${(base / 1e6).toFixed(0)} MB, above the base ${((size - base) / 1e6).toFixed(0)} MB; top layers:\n${layers.map((l) => '  ' + l.slice(0, 160)).join('\n')}`);
    const largest = await docker('run', '--rm', '--entrypoint', 'sh', IMAGE, '-c', 'du -sk /app/node_modules/* /app/node_modules/@*/* /app/dist /usr/bin/tini 2>/dev/null | sort -rn | head -12');
    console.log(`largest under /app (kB):\n${largest}`);
    expect(await inspect(IMAGE, '{{.Config.User}}')).toBe('node');
  });

  it('migrate; worker with ADMIN_TOKEN serves the console; order confirm in a second container settles; healthy; docker stop drains and exits 0', async () => {
    const { url, client } = await database('image_main');
    const emulator = await emulatorContainer('emu-main');
    const stripe = { STRIPE_API_BASE: emulator, OUTBOXD_STRIPE_EMULATOR: 'true' };
    await runOnce({ DATABASE_URL: url }, ['migrate']);
    expect((await client.query(`select count(*)::int as n from information_schema.tables where table_schema = 'outboxd'`)).rows[0].n).toBeGreaterThan(3);

    const port = await freePort();
    const token = 'image-test-admin-token-'.padEnd(40, 'x');
    const worker = await runDetached('worker', { DATABASE_URL: url, ...stripe, HTTP_PORT: String(port), ADMIN_TOKEN: token, SHUTDOWN_GRACE_MS: '20000' }, ['worker'], WORKER);
    await waitUntil(async () => (await logLines(worker)).some((l) => l.msg === 'worker ready') || (await inspect(worker, '{{.State.Running}}')) !== 'true', 60_000, 'the worker container');
    expect(await inspect(worker, '{{.State.Running}}'), JSON.stringify((await logLines(worker)).slice(-3))).toBe('true');
    await checkConsole(`http://127.0.0.1:${port}`, token);

    // Not root, and nothing on the root filesystem can be written.
    expect(await docker('exec', worker, 'id', '-u')).toBe(String(RUN_AS_USER));
    // What the Kubernetes probes and Prometheus ask for.
    for (const p of Object.values(PROBES)) expect((await fetch(`http://127.0.0.1:${port}${p}`)).status, p).toBe(200);
    await expect(docker('exec', worker, 'sh', '-c', 'touch /app/x')).rejects.toThrow(/Read-only file system/);

    const confirmed = JSON.parse(
      await runOnce({ DATABASE_URL: url }, ['order', 'confirm', '--order-id', 'image-1', '--amount', '1500', '--currency', 'eur', '--customer', 'cus_image', '--payment-method', 'pm_card_visa', '--json']),
    );
    await waitUntil(async () => (await settled(client)).succeeded === 1, 60_000, 'the order settled by the worker container');
    const charges = (await ledger(emulator)).filter((l) => l.paymentIntent.metadata.operation_id === confirmed.operationId);
    expect(charges.map((c) => c.paymentIntent.status)).toEqual(['succeeded']);

    // The image's HEALTHCHECK (every 15 s) against /healthz.
    await waitUntil(async () => (await inspect(worker, '{{.State.Health.Status}}')) === 'healthy', 90_000, 'the HEALTHCHECK to report healthy');

    // docker stop while a charge is in flight (the emulator holds it 4 s): tini hands SIGTERM to node, the
    // call finishes and is recorded, then the worker exits 0, all before compose's stop_grace_period.
    await fetch(`${emulator}/_emulator/faults`, { method: 'POST', body: JSON.stringify({ fault: { kind: 'latency', ms: 4000 }, endpoint: 'create' }) });
    const inFlight = JSON.parse(
      await runOnce({ DATABASE_URL: url }, ['order', 'confirm', '--order-id', 'image-2', '--amount', '1600', '--currency', 'eur', '--customer', 'cus_image', '--payment-method', 'pm_card_visa', '--json']),
    );
    const attempted = async () => (await client.query(`select first_attempted_at from outboxd.payment_operations where id = $1`, [inFlight.operationId])).rows[0].first_attempted_at;
    await waitUntil(attempted, 30_000, 'the second charge sent');
    const grace = Number(compose.services.worker.stop_grace_period.replace(/s$/, ''));
    const t0 = Date.now();
    await docker('stop', '-t', String(grace), worker);
    expect(Date.now() - t0).toBeLessThan(grace * 1000);
    expect(await inspect(worker, '{{.State.ExitCode}}')).toBe('0');
    expect((await logLines(worker)).find((l) => l.msg === 'worker stopped')).toMatchObject({ finished: true });
    expect((await client.query(`select status from outboxd.payment_operations where id = $1`, [inFlight.operationId])).rows[0].status).toBe('succeeded');
  }, 240_000);

  it('compose’s services by their command and environment (.env.example, then compose’s own): migrate, three workers, a backlog; docker kill of one loses nothing; the others stop with exit 0', async () => {
    const { url, client } = await database('image_compose');
    const emulator = await emulatorContainer('emu-compose');
    const envFile = ['--env-file', path.join(ROOT, 'deploy/.env.example')];
    // compose's environment, with DATABASE_URL at this run's PostgreSQL instead of compose's postgres service;
    // the emulator opt-in as compose.yaml's header says; ports apart (host networking shares them); short leases
    // and timeouts so a killed replica's operations come back within seconds.
    const serviceEnv = (service: string) => ({
      ...compose.services[service].environment,
      DATABASE_URL: url,
      STRIPE_API_BASE: emulator,
      OUTBOXD_STRIPE_EMULATOR: 'true',
      STRIPE_TIMEOUT_MS: '4000',
      LEASE_TTL_MS: '6000',
      WORKER_CONCURRENCY: '2',
    });
    await runOnce(serviceEnv('migrate'), compose.services.migrate.command, envFile);

    // Each create waits 1.5 s at the emulator: the backlog is still there when a replica is killed.
    const orders = 24;
    await fetch(`${emulator}/_emulator/faults`, { method: 'POST', body: JSON.stringify({ fault: { kind: 'latency', ms: 1500 }, count: 1000, endpoint: 'create' }) });
    await writeFile(
      path.join(work, 'orders.jsonl'),
      Array.from({ length: orders }, (_, i) => JSON.stringify({ orderId: `compose-${i}`, amount: 1000 + i, currency: 'eur', customer: 'cus_compose', paymentMethod: 'pm_card_visa' })).join('\n') + '\n',
    );
    await chmod(path.join(work, 'orders.jsonl'), 0o644);
    const summary = JSON.parse(await runOnce(serviceEnv('migrate'), ['order', 'confirm', '--from-file', '/orders/orders.jsonl', '--json'], ['-v', `${work}:/orders:ro`]));
    expect(summary).toMatchObject({ failed: 0 });

    const workers: string[] = [];
    for (let i = 0; i < 3; i++) {
      const [http, admin] = [await freePort(), await freePort()];
      workers.push(await runDetached(`compose-worker-${i}`, { ...serviceEnv('worker'), HTTP_PORT: String(http), ADMIN_HTTP_PORT: String(admin) }, compose.services.worker.command, [...envFile, ...WORKER]));
    }
    await waitUntil(async () => ((await settled(client)).succeeded ?? 0) >= 3, 90_000, 'the first charges');
    await docker('kill', workers[0]!);
    expect((await settled(client)).succeeded ?? 0).toBeLessThan(orders);

    await waitUntil(async () => (await settled(client)).succeeded === orders, 180_000, 'every operation settled by the two replicas left');
    expect(await settled(client)).toEqual({ succeeded: orders });
    // One PaymentIntent per operation: the killed replica's calls were finished under the same key.
    const byOp = new Map<string, number>();
    for (const l of await ledger(emulator)) byOp.set(l.paymentIntent.metadata.operation_id!, (byOp.get(l.paymentIntent.metadata.operation_id!) ?? 0) + 1);
    expect(byOp.size).toBe(orders);
    expect([...byOp.values()].every((n) => n === 1)).toBe(true);
    // The killed replica held operations: another claimed them after their leases expired (a larger fence).
    expect((await client.query(`select count(*)::int as n from outboxd.payment_operations where fence > 1`)).rows[0].n).toBeGreaterThan(0);

    const grace = Number(compose.services.worker.stop_grace_period.replace(/s$/, ''));
    await docker('stop', '-t', String(grace), workers[1]!, workers[2]!);
    for (const w of workers.slice(1)) expect(await inspect(w, '{{.State.ExitCode}}')).toBe('0');
    expect(await inspect(workers[0]!, '{{.State.ExitCode}}')).toBe('137');
  }, 420_000);
});
