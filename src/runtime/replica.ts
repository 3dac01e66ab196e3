// The composition root: the one place a dispatcher replica is put together, for `outboxd worker`
// (src/runtime/worker.ts, which adds its HTTP listeners) and outboxd.startWorker (src/runtime/inProcess.ts,
// inside the application's process). Stripe as configured, the kinds registered on it (the built-in ones
// and the application's, alike), pg-boss, the metrics, and the dispatcher that drives them.
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import type pg from 'pg';
import type { PgBoss } from 'pg-boss';
import type { Pool } from '../db/pool.ts';
import { Dispatcher } from '../dispatcher/dispatcher.ts';
import type { Kinds } from '../engine/kinds.ts';
import type { EffectDefinitions } from '../kinds/application/definition.ts';
import { kindsFor } from '../kinds/index.ts';
import { createBoss, listensOn, onBossWarnings, startBoss } from '../outbox/outbox.ts';
import { PRUNE_CRON } from '../outbox/retention.ts';
import type { Logger } from '../telemetry/log.ts';
import { createMetrics, registerStripeMode, type Metrics } from '../telemetry/metrics.ts';
import type { Config } from './config.ts';
import { openGateway, type Database, type GatewayHandle } from './open.ts';

/** A replica's name as its leases carry it (lease_owner). Its draining releases every lease of that name,
 * so no two replicas may share one: two containers can have the same host name and pid (1), and their
 * random part must then differ, beyond a birthday's odds (64 bits). */
export const newWorkerId = (): string => `${hostname()}:${process.pid}:${randomBytes(8).toString('hex')}`;

export interface Replica {
  gateway: GatewayHandle;
  boss: PgBoss;
  kinds: Kinds;
  metrics: Metrics;
  dispatcher: Dispatcher;
  /** Starts pg-boss, then the dispatcher's claims. */
  start(): Promise<void>;
}

/**
 * Everything a replica dispatches with, on `pool` (outboxd's statements) and `bossConnection` (pg-boss's:
 * a URL, or the application's pool). What it opens is pushed onto `opened`, for the caller to close in
 * reverse order when a later step fails or the replica stops.
 */
export async function composeReplica(o: {
  config: Config;
  log: Logger;
  workerId: string;
  db: Database;
  pool: Pool;
  bossConnection: string | pg.Pool;
  concurrency: number;
  effects?: EffectDefinitions | undefined;
  opened: (() => Promise<unknown>)[];
}): Promise<Replica> {
  const { config, log, db, pool, concurrency, opened } = o;
  // One connected account's calls wait for its own bucket in at most a quarter of the slots.
  const gateway = await openGateway(config, log, db, { accountWaiters: Math.max(1, Math.floor(concurrency / 4)) });
  opened.push(() => gateway.close());
  // Every loop fetches and completes its jobs through pg-boss's own pool (plus heartbeats, supervision).
  const boss = createBoss(o.bossConnection, 'worker', concurrency + 3, db.schema, db.directUrl);
  boss.on('error', (err) => log.error({ err }, 'pg-boss error'));
  onBossWarnings(boss, (message, data) => log.warn({ bossWarning: data }, message));
  const kinds = kindsFor(gateway.gateway, o.effects);
  const metrics = createMetrics({ db: pool, boss, kinds: kinds.names });
  registerStripeMode(metrics.registry, gateway.mode);
  gateway.gateway.registerMetrics(metrics.registry);
  const dispatcher = new Dispatcher(
    // The relay LISTENs through pg-boss's own listener, which reconnects and keeps a heartbeat.
    { boss, pool, gateway: gateway.gateway, log, metrics, kinds, ...(listensOn(db.directUrl) ? { listener: boss.getDb() } : {}) },
    {
      workerId: o.workerId,
      concurrency,
      leaseTtlMs: config.worker.leaseTtlMs,
      reconcileCron: config.worker.reconcileCron,
      pruneCron: PRUNE_CRON,
      retentionDays: config.retentionDays,
      processingReviewDays: config.processingReviewDays,
    },
  );
  return {
    gateway,
    boss,
    kinds,
    metrics,
    dispatcher,
    async start() {
      // Registered first: a start that fails halfway leaves pg-boss timers that only stop() clears.
      opened.push(() => boss.stop({ graceful: false }));
      await startBoss(boss, db.schema);
      await dispatcher.start();
    },
  };
}
