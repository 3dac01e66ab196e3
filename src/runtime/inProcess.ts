// outboxd.startWorker: a dispatcher replica inside the application's process, carrying out the built-in
// kinds and the application's own, with the same leases, fences, retries, review and metrics as an
// `outboxd worker`. It reads the worker's settings from the environment, as `outboxd worker` does
// (STRIPE_SECRET_KEY, LEASE_TTL_MS, RECONCILE_CRON, …); it serves no HTTP: metrics() gives their text.
import type pg from 'pg';
import { loadInProcessConfig } from './config.ts';
import { createPool, isPooled, type Pool } from '../db/pool.ts';
import type { EffectDefinitions } from '../kinds/application/definition.ts';
import { createLogger } from '../telemetry/log.ts';
import type { Statements } from '../sql/statements.ts';
import { composeReplica, newWorkerId } from './replica.ts';

export interface EffectWorker {
  /** Prometheus text of this worker's metrics, for the application to serve. */
  metrics(): Promise<string>;
  /** Stops claiming, lets calls in flight finish within SHUTDOWN_GRACE_MS, gives its leases back. */
  stop(): Promise<void>;
}

export async function startInProcessWorker(opts: {
  connection: string | pg.Pool;
  /** A session connection for LISTEN (directConnectionString); the connection is then a pooler's. */
  directUrl: string | undefined;
  schema: string;
  sql: Statements;
  concurrency: number;
  effects: EffectDefinitions;
}): Promise<EffectWorker> {
  const config = loadInProcessConfig();
  const workerId = newWorkerId();
  const log = createLogger(config.logLevel, { component: 'outboxd-worker', workerId });
  const { connection, schema, concurrency } = opts;
  const url = typeof connection === 'string' ? connection : undefined;
  // Calls hold no connection, so outboxd's own pool only needs room for the short statements around them.
  const pooled = url !== undefined && isPooled(url, opts.directUrl);
  const pool: Pool = url
    ? createPool(url, { schema, max: Math.min(concurrency, 16) + 2, applicationName: 'outboxd-worker', pooled })
    : onApplicationPool(connection as pg.Pool, opts.sql);
  // On the application's pool there is no URL: the Stripe budget shares that pool too.
  const db = { url: url ?? '', directUrl: opts.directUrl, schema, embedded: false, close: async () => {}, ...(url ? {} : { pool }) };
  const opened: (() => Promise<unknown>)[] = url ? [() => pool.end()] : [];
  const close = async () => {
    for (const step of opened.reverse()) await step().catch(() => {});
  };
  let replica;
  try {
    replica = await composeReplica({ config, log, workerId, db, pool, bossConnection: connection, concurrency, effects: opts.effects, opened });
    await replica.start();
  } catch (err) {
    await close();
    throw err;
  }
  const { boss, dispatcher, metrics, gateway } = replica;
  log.info({ concurrency, kinds: dispatcher.kinds }, 'worker started in the application');
  // One drain, whoever asks and however often (a SIGTERM handler, then outboxd.stop() in a finally): a
  // second would end the pool twice, which pg throws on.
  let stopped: Promise<void> | undefined;
  return {
    metrics: () => metrics.scrape(),
    stop: () =>
      (stopped ??= (async () => {
        await dispatcher.drain(config.worker.shutdownGraceMs);
        await boss.stop({ graceful: true, timeout: 2_000 });
        if (url) await pool.end();
        await gateway.close();
        log.info('worker stopped');
      })()),
  };
}

/** The application's own pool, with outboxd's statements beside it: what outboxd needs of a pool (query
 * and connect), never end(), which is the application's to call. */
function onApplicationPool(pool: pg.Pool, sql: Statements): Pool {
  return { sql, query: pool.query.bind(pool), connect: pool.connect.bind(pool) } as unknown as Pool;
}
