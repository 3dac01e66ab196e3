// `outboxd worker`: one dispatcher replica, until SIGTERM/SIGINT (invariant 9).
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import type { Config } from '../config.ts';
import { adminRoutes } from '../http/admin.ts';
import { sendJson, startHttpServer } from '../http/server.ts';
import { webhookRoutes } from '../http/webhooks.ts';
import type { Logger } from '../log.ts';
import { createBoss } from '../outbox.ts';
import { openDatabase, openGateway, openPool } from '../runtime.ts';
import { Dispatcher } from './dispatcher.ts';
import { createMetrics, registerStripeMode } from './metrics.ts';

/** What a replica serves for its platform: deploy/ manifests are checked against these (test/deploy). */
export const PROBES = { liveness: '/healthz', readiness: '/readyz', metrics: '/metrics' } as const;

export async function runWorker(config: Config, baseLog: Logger): Promise<void> {
  const workerId = `${hostname()}:${process.pid}:${randomBytes(2).toString('hex')}`;
  const log = baseLog.child({ workerId });
  const db = await openDatabase(config, log);
  const gateway = await openGateway(config, log, db);
  // Calls hold no connection, so the pool only needs room for the short statements around them.
  const pool = openPool(db, 'outboxd-worker', Math.min(config.worker.concurrency, 16) + 2);
  // Every loop fetches and completes its jobs through pg-boss's own pool (plus heartbeats, supervision).
  const boss = createBoss(db.url, 'worker', config.worker.concurrency + 3);
  boss.on('error', (err) => log.error({ err }, 'pg-boss error'));
  await boss.start();
  const metrics = createMetrics({ db: pool, boss });
  registerStripeMode(metrics.registry, gateway.mode);
  const dispatcher = new Dispatcher(
    { boss, pool, gateway: gateway.gateway, log, metrics },
    {
      workerId,
      concurrency: config.worker.concurrency,
      leaseTtlMs: config.worker.leaseTtlMs,
      reconcileCron: config.worker.reconcileCron,
    },
  );
  await dispatcher.start();

  const http = await startHttpServer(config.worker.httpPort, [
    ['GET', PROBES.liveness, ({ res }) => sendJson(res, 200, { status: 'ok', workerId })],
    [
      'GET',
      PROBES.readiness,
      async ({ res }) => {
        const dbOk = await pool.query('select 1').then(() => true, () => false);
        const ready = dbOk && !dispatcher.isDraining;
        sendJson(res, ready ? 200 : 503, { ready, database: dbOk, draining: dispatcher.isDraining });
      },
    ],
    [
      'GET',
      PROBES.metrics,
      async ({ res }) => {
        const text = await metrics.registry.metrics();
        res.writeHead(200, { 'Content-Type': metrics.registry.contentType });
        res.end(text);
      },
    ],
    ...adminRoutes({ pool, boss, gateway: gateway.gateway, log, config, workerId }),
    ...webhookRoutes({ pool, log, secret: config.webhookSecret }),
  ]);
  log.info({ httpPort: http.port, concurrency: config.worker.concurrency, embeddedDatabase: db.embedded }, 'worker ready');

  const signal = await new Promise<NodeJS.Signals>((resolve) => {
    process.once('SIGTERM', () => resolve('SIGTERM'));
    process.once('SIGINT', () => resolve('SIGINT'));
  });
  // A second signal means "now": exit without waiting (leases expire, pg-boss retries the jobs).
  for (const s of ['SIGTERM', 'SIGINT'] as const) process.once(s, () => process.exit(128 + (s === 'SIGINT' ? 2 : 15)));
  log.info({ signal, graceMs: config.worker.shutdownGraceMs }, 'draining: no new claims, finishing in-flight operations');
  const { finished } = await dispatcher.drain(config.worker.shutdownGraceMs);
  await boss.stop({ graceful: true, timeout: 2_000 });
  await http.close();
  await pool.end();
  await gateway.close();
  await db.close();
  log.info({ finished }, 'worker stopped');
}
