// `outboxd worker`: one dispatcher replica, until SIGTERM/SIGINT (invariant 9). With `--effects`, it
// carries out the application's own kinds of effect too (loadEffects).
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { ConfigError, type Config } from './config.ts';
import { validDefinition, type EffectDefinition, type EffectDefinitions } from '../kinds/application/definition.ts';
import { RESERVED_KINDS } from '../kinds/index.ts';
import { consoleRoutes } from '../console/routes.ts';
import { checkDatabase } from '../db/check.ts';
import { adminRoutes } from '../http/admin.ts';
import { accessTokens } from '../http/tokens.ts';
import { sendJson, startHttpServer, type HttpServer, type Route } from '../http/server.ts';
import { webhookRoutes } from '../http/webhooks.ts';
import type { Logger } from '../telemetry/log.ts';
import { sharedFor } from '../telemetry/metrics.ts';
import { openDatabase, openPool } from './open.ts';
import { composeReplica, newWorkerId } from './replica.ts';

/** What a replica serves for its platform: deploy/ manifests are checked against these (test/processes/deploy.test.ts). */
export const PROBES = { liveness: '/healthz', readiness: '/readyz', metrics: '/metrics' } as const;

/**
 * The application's kinds of effect from a module (`outboxd worker --effects ./effects.js`): its default
 * export (or its export `effects`) maps each kind to its definition, `{ policy, execute, check? }`, as
 * outboxd.defineEffect takes it. A module that cannot be loaded or defines nothing valid stops the worker.
 */
export async function loadEffects(file: string): Promise<EffectDefinitions> {
  let mod: { default?: unknown; effects?: unknown };
  try {
    mod = await import(pathToFileURL(path.resolve(file)).href);
  } catch (err) {
    throw new ConfigError(`--effects ${file}: cannot load it: ${(err as Error).message}`, { cause: err });
  }
  const table = mod.effects ?? mod.default;
  if (table === null || typeof table !== 'object') {
    throw new ConfigError(`--effects ${file}: export default (or export effects) an object of { kind: { policy, execute, check? } }`);
  }
  const effects = new Map<string, EffectDefinition>();
  for (const [kind, def] of Object.entries(table)) {
    try {
      effects.set(kind, validDefinition(kind, def, RESERVED_KINDS));
    } catch (err) {
      throw new ConfigError(`--effects ${file}: ${(err as Error).message}`);
    }
  }
  if (effects.size === 0) throw new ConfigError(`--effects ${file}: defines no effect`);
  return effects;
}

export async function runWorker(config: Config, baseLog: Logger, effects?: EffectDefinitions): Promise<void> {
  const workerId = newWorkerId();
  const log = baseLog.child({ workerId });
  const { db, gateway, pool, adminPool, boss, dispatcher, http, adminHttp, metrics } = await openReplica(config, log, workerId, effects);
  // The application's effects run in this process: a promise one of them leaves rejected and unhandled
  // (Node's default: exit) took the replica down with every charge in flight, and every replica that
  // retried the effect after it. Told and counted instead; what the effect returned is recorded as usual.
  if (effects) {
    process.on('unhandledRejection', (reason) => {
      metrics.unhandledRejections.inc();
      log.error({ err: reason }, 'a promise rejected with no handler (an --effects module\'s, most likely): the worker goes on');
    });
  }
  log.info(
    { httpPort: http.port, adminHttpPort: adminHttp?.port, concurrency: config.worker.concurrency, embeddedDatabase: db.embedded, kinds: dispatcher.kinds },
    'worker ready',
  );

  const signal = await new Promise<NodeJS.Signals>((resolve) => {
    process.once('SIGTERM', () => resolve('SIGTERM'));
    process.once('SIGINT', () => resolve('SIGINT'));
  });
  // A second signal means "now": exit without waiting (leases expire, pg-boss retries the jobs). Not one
  // a few milliseconds after the first: the same signal twice, to the process group and forwarded too (as
  // bin/outboxd.js forwards it to the process it runs the sources in, on Node 22.12–22.17).
  const first = performance.now();
  for (const s of ['SIGTERM', 'SIGINT'] as const) {
    process.on(s, () => {
      if (performance.now() - first >= SAME_SIGNAL_MS) process.exit(128 + (s === 'SIGINT' ? 2 : 15));
    });
  }
  log.info({ signal, graceMs: config.worker.shutdownGraceMs }, 'draining: no new claims, finishing in-flight operations');
  const { finished } = await dispatcher.drain(config.worker.shutdownGraceMs);
  await boss.stop({ graceful: true, timeout: 2_000 });
  await http.close();
  await adminHttp?.close();
  if (adminPool !== pool) await adminPool.end();
  await pool.end();
  await gateway.close();
  await db.close();
  log.info({ finished }, 'worker stopped');
}

/** A second signal this soon after the first is the first one delivered twice, not a person's "now". */
const SAME_SIGNAL_MS = 250;

/**
 * Everything a replica needs, in an order that fails early: the database answers and is migrated, the
 * listeners are bound, and only then does the dispatcher claim jobs (a replica without probes must not
 * dispatch). A failure closes what was opened, so the process exits at once, and says in one sentence
 * what is wrong.
 */
async function openReplica(config: Config, log: Logger, workerId: string, effects: EffectDefinitions | undefined) {
  const opened: (() => Promise<unknown>)[] = [];
  try {
    const db = await openDatabase(config, log);
    opened.push(() => db.close());
    await checkDatabase(db.url, config.schema);
    // Calls hold no connection, so the pool only needs room for the short statements around them.
    const pool = openPool(db, 'outboxd-worker', Math.min(config.worker.concurrency, 16) + 2);
    opened.push(() => pool.end());
    const replica = await composeReplica({ config, log, workerId, db, pool, bossConnection: db.url, concurrency: config.worker.concurrency, effects, opened });
    const { gateway, boss, metrics, dispatcher } = replica;
    let dispatching = false;

    // The admin API and the console on a small pool of their own: whatever anyone sends them (token
    // guesses, heavy pages) waits for these connections, never for the dispatcher's.
    const adminPool = accessTokens(config).length > 0 ? openPool(db, 'outboxd-admin', 4) : pool;
    if (adminPool !== pool) opened.push(() => adminPool.end());
    const adminDeps = { pool: adminPool, boss, gateway: gateway.evidence ? gateway.gateway : undefined, log, config, workerId, metrics };
    const admin = [...adminRoutes(adminDeps), ...consoleRoutes(adminDeps)];
    // ADMIN_HTTP_PORT moves the admin API and the console off the listener that Stripe (and so anyone) can reach.
    const ownAdminListener = config.admin.httpPort !== undefined;
    // Read once a second at most, whoever asks: the probe is on the listener anyone may reach (the
    // webhooks'), and a statement each on the dispatcher's own pool queued its claims behind a flood.
    const databaseAnswers = sharedFor(1_000, () => pool.query('select 1').then(() => true, () => false));
    const http = await listen('HTTP', config.worker.httpPort, config.worker.httpHost, log, [
      ['GET', PROBES.liveness, ({ res }) => sendJson(res, 200, { status: 'ok', workerId })],
      [
        'GET',
        PROBES.readiness,
        async ({ res }) => {
          const dbOk = await databaseAnswers();
          const ready = dispatching && dbOk && !dispatcher.isDraining;
          sendJson(res, ready ? 200 : 503, { ready, database: dbOk, dispatching, draining: dispatcher.isDraining });
        },
      ],
      [
        'GET',
        PROBES.metrics,
        async ({ res }) => {
          const text = await metrics.scrape();
          res.writeHead(200, { 'Content-Type': metrics.registry.contentType });
          res.end(text);
        },
      ],
      ...(ownAdminListener ? [] : admin),
      ...webhookRoutes({ pool, gateway: gateway.gateway, log, secrets: config.webhookSecrets, onMismatch: (result) => metrics.webhookMismatches.inc({ result }), onRefused: (reason) => metrics.webhookRefusals.inc({ reason }) }),
    ]);
    opened.push(() => http.close());
    const adminHttp =
      ownAdminListener && admin.length > 0
        ? await listen('ADMIN_HTTP', config.admin.httpPort!, config.admin.httpHost, log, admin)
        : undefined;
    if (adminHttp) opened.push(() => adminHttp.close());

    await replica.start();
    dispatching = true;
    return { db, gateway, pool, adminPool, boss, dispatcher, http, adminHttp, metrics };
  } catch (err) {
    for (const close of opened.reverse()) await close().catch(() => {});
    throw err;
  }
}

const LISTEN_FAILURES: Record<string, string> = {
  EADDRINUSE: 'the port is in use by another process',
  EACCES: 'permission denied (a port below 1024 needs privileges)',
  EADDRNOTAVAIL: 'the address is not one of this machine',
  ENOTFOUND: 'the host name does not resolve',
};

/** Binds one listener; a failure names the two variables that chose where. */
async function listen(name: 'HTTP' | 'ADMIN_HTTP', port: number, host: string, log: Logger, routes: Route[]): Promise<HttpServer> {
  try {
    return await startHttpServer(port, routes, host, log);
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    const why = LISTEN_FAILURES[e.code ?? ''] ?? e.message;
    throw new Error(`cannot listen on ${host}:${port} (${name}_HOST, ${name}_PORT): ${why}`, { cause: err });
  }
}
