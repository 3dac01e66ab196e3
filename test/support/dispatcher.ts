import type { PgBoss } from 'pg-boss';
import { Dispatcher } from '../../src/dispatcher/dispatcher.ts';
import { createMetrics, type Metrics } from '../../src/telemetry/metrics.ts';
import type { EffectDefinitions } from '../../src/kinds/application/definition.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { createLogger, type Logger } from '../../src/telemetry/log.ts';
import { createBoss } from '../../src/outbox/outbox.ts';
import type { PaymentGateway } from '../../src/stripe/gateway.ts';
import type { Pool } from '../../src/db/pool.ts';
import type { TestDb } from './db.ts';

export interface InProcessReplica {
  dispatcher: Dispatcher;
  boss: PgBoss;
  metrics: Metrics;
  stop(): Promise<void>;
}

/** A dispatcher replica inside the test process, with its own pg-boss (supervising, listening) and, as
 * outboxd's replicas have, its relay's LISTEN (unless `listen: false`). */
export async function startDispatcher(
  t: TestDb,
  gateway: PaymentGateway,
  workerId: string,
  opts: { leaseTtlMs?: number; concurrency?: number; fetchBatch?: number; log?: Logger; effects?: EffectDefinitions; beforeStart?: (boss: PgBoss) => void; pruneCron?: string; processingReviewDays?: number; relayIntervalMs?: number; listen?: boolean; pool?: Pool } = {},
): Promise<InProcessReplica> {
  const boss = createBoss(t.url, 'worker', 3, t.schema, t.url);
  boss.on('error', () => {});
  await boss.start();
  opts.beforeStart?.(boss);
  const metrics = createMetrics({ db: t.pool, boss });
  const dispatcher = new Dispatcher(
    { boss, pool: opts.pool ?? t.pool, gateway, log: opts.log ?? createLogger('silent'), metrics, kinds: kindsFor(gateway, opts.effects), ...(opts.listen === false ? {} : { listener: boss.getDb() }) },
    { workerId, concurrency: opts.concurrency ?? 2, leaseTtlMs: opts.leaseTtlMs ?? 12_000, ...(opts.fetchBatch ? { fetchBatch: opts.fetchBatch } : {}), ...(opts.relayIntervalMs ? { relayIntervalMs: opts.relayIntervalMs } : {}), ...(opts.pruneCron ? { pruneCron: opts.pruneCron } : {}), ...(opts.processingReviewDays ? { processingReviewDays: opts.processingReviewDays } : {}) },
  );
  await dispatcher.start();
  // Draining ends the relay loop too: left running, it would keep taking later tests' outbox rows.
  const stop = async () => {
    await dispatcher.drain(0);
    await boss.stop({ graceful: false });
  };
  return { dispatcher, boss, metrics, stop };
}
