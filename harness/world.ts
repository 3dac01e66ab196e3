// A whole outboxd deployment on this machine, for the demo, chaos and the benchmark: a PostgreSQL
// (embedded, restartable; or DATABASE_URL), a fresh migrated database, the Stripe emulator in this
// process, and worker replicas as OS processes pointed at both.
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type { PgBoss } from 'pg-boss';
import { freePort, startEmbeddedPostgres, type EmbeddedCluster } from '../src/db/embedded.ts';
import { createPool, type Pool } from '../src/db/pool.ts';
import { createLogger } from '../src/telemetry/log.ts';
import { createBoss } from '../src/outbox/outbox.ts';
import { EMULATOR_KEY } from '../src/runtime/open.ts';
import { DEFAULT_SCHEMA } from '../src/sql/statements.ts';
import { StripeEmulator, type EmulatorOptions } from '../src/emulator/index.ts';
import { StripeGateway } from '../src/stripe/sdkGateway.ts';
import { createMigratedDatabase } from './database.ts';
import { startReplica, type Replica } from './replica.ts';

/**
 * The V8 limits the deployment runs the worker with (deploy/Dockerfile, deploy/k8s): the smallest young
 * generation (2 MB instead of 7.5 under load, with no CPU cost measurable here) and a bounded old space.
 * The live heap is 20-30 MB; most of a replica's RSS is Node and its libraries before any work (about
 * 100 MB for the compiled worker: Node 47, pg-boss 13, the stripe SDK 13, pg 7), measured module by module.
 */
export const DEPLOYED_NODE_OPTIONS = '--max-semi-space-size=1 --max-old-space-size=96';

/**
 * The flags of the deployment's node command line (deploy/Dockerfile's ENTRYPOINT; V8 takes them there,
 * not in NODE_OPTIONS). Without Maglev, V8's middle compiler tier, a replica's peak RSS under load fell
 * from 126 to 111 MB (the peer's from 120 to 107) for 8 % fewer settlements per second at 0 ms Stripe
 * latency and none at 100 ms, measured side by side with npm run bench: its compiler's code and zone
 * memory are most of what the JIT adds, and a worker waiting on Stripe has CPU to spare.
 */
export const DEPLOYED_NODE_ARGS: readonly string[] = ['--no-maglev'];

/**
 * The rest of the deployment's environment that shapes a replica's memory (deploy/Dockerfile, deploy/k8s).
 * glibc gives each thread that allocates (V8's compiler and GC helpers, libuv's pool) an arena of its own,
 * up to 8 per core, whose freed pages stay resident; two arenas took 2-3 MB off a replica's peak RSS (109
 * against 111-112 MB, six runs alternating) at no settlement rate npm run bench could tell apart.
 */
export const DEPLOYED_ENV: Readonly<Record<string, string>> = { MALLOC_ARENA_MAX: '2' };

export interface World {
  url: string;
  pool: Pool;
  boss: PgBoss;
  emulator: StripeEmulator;
  emulatorUrl: string;
  gateway: StripeGateway;
  replicas: Replica[];
  /** Whether restartPostgres() can do anything (only the embedded cluster is ours to restart). */
  canRestartPostgres: boolean;
  startReplica(env?: Record<string, string>, onLog?: (entry: Record<string, unknown>) => void): Promise<Replica>;
  restartPostgres(downMs?: number): Promise<void>;
  close(): Promise<void>;
}

export async function startWorld(opts: {
  name: string;
  emulator?: EmulatorOptions;
  replicaEnv?: Record<string, string>;
  /** What replicas run instead of bin/outboxd.js (harness/replica.ts). */
  replicaEntry?: string;
}): Promise<World> {
  const log = createLogger(process.env.LOG_LEVEL ?? 'warn');
  let cluster: EmbeddedCluster | undefined;
  let dataDir: string | undefined;
  let port: number | undefined;
  let admin = process.env.DATABASE_URL;
  if (!admin) {
    dataDir = await mkdtemp(path.join(tmpdir(), `outboxd-${opts.name}-`));
    port = await freePort();
    cluster = await startEmbeddedPostgres({ dataDir, port, log });
    admin = cluster.url;
  }
  const database = await createMigratedDatabase(admin, `outboxd_${opts.name}`);
  const { url } = database;
  const pool = createPool(url, { schema: DEFAULT_SCHEMA, max: 20, applicationName: `outboxd-${opts.name}` });
  const boss = createBoss(url, 'client', 4, DEFAULT_SCHEMA);
  boss.on('error', () => {});
  await boss.start();
  const emulator = new StripeEmulator(opts.emulator);
  const { url: emulatorUrl } = await emulator.listen(0);
  const replicas: Replica[] = [];

  const world: World = {
    url,
    pool,
    boss,
    emulator,
    emulatorUrl,
    gateway: new StripeGateway({ secretKey: EMULATOR_KEY, apiBase: emulatorUrl, timeoutMs: 5_000 }),
    replicas,
    canRestartPostgres: !!cluster,
    async startReplica(env = {}, onLog) {
      const r = await startReplica(
        { DATABASE_URL: url, DATABASE_DIRECT_URL: url, STRIPE_API_BASE: emulatorUrl, STRIPE_SECRET_KEY: '', NODE_OPTIONS: DEPLOYED_NODE_OPTIONS, ...DEPLOYED_ENV, ...opts.replicaEnv, ...env },
        { nodeArgs: DEPLOYED_NODE_ARGS, ...(onLog ? { onLog } : {}), ...(opts.replicaEntry ? { entry: opts.replicaEntry } : {}) },
      );
      replicas.push(r);
      return r;
    },
    async restartPostgres(downMs = 1_000) {
      if (!cluster || !dataDir) return;
      await cluster.stop();
      await new Promise((r) => setTimeout(r, downMs));
      cluster = await startEmbeddedPostgres({ dataDir, port: port!, log });
    },
    async close() {
      for (const r of replicas) {
        if (r.proc.exitCode === null && r.proc.signalCode === null) {
          r.kill('SIGCONT');
          r.kill('SIGKILL');
          await r.exited;
        }
      }
      await boss.stop({ graceful: false }).catch(() => {});
      await pool.end().catch(() => {});
      await emulator.close();
      if (cluster) await cluster.stop();
      if (dataDir) await rm(dataDir, { recursive: true, force: true });
      else await database.drop();
    },
  };
  return world;
}
