// Opens what a command needs from the Config: the database (DATABASE_URL or the embedded default,
// migrated on the fly since a developer's first run has no schema yet), a pool, and Stripe: the key's,
// or an emulator. The embedded defaults are one environment per data directory: one PostgreSQL, and one
// emulator ledger kept in it, shared by every process on that directory (docs/emulator.md).
import { ConfigError, type Config, type StripeMode } from './config.ts';
import { startEmbeddedPostgres } from '../db/embedded.ts';
import { migrate } from '../db/migrate.ts';
import { createPool, isPooled, ownSessions, type Pool, type Queryable } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import { AccountBudgets, Budget, budgetMetrics } from '../stripe/budget.ts';
import { BudgetedGateway, gatewayMetrics } from '../stripe/budgetedGateway.ts';
import { StripeGateway } from '../stripe/sdkGateway.ts';

export interface Database {
  url: string;
  /** A session connection (the migrations' lock, LISTEN): DATABASE_DIRECT_URL, else DATABASE_URL itself
   * (the contract's default: only a pooler's users need the direct one), the embedded cluster's own URL. */
  directUrl?: string | undefined;
  /** outboxd's schema in it (OUTBOXD_SCHEMA). */
  schema: string;
  /** An application's own pool (startWorker on `{ pool }`, url then empty): what needs a pool (the
   * Stripe budget) uses it rather than opening one of its own. */
  pool?: Queryable;
  embedded: boolean;
  /** Leaves the embedded cluster (the last process using it stops it). */
  close(): Promise<void>;
}

export async function openDatabase(config: Config, log: Logger): Promise<Database> {
  const { schema } = config;
  if (config.databaseUrl) {
    const directUrl = config.databaseDirectUrl ?? config.databaseUrl;
    // A pooler's URL given alone is refused before any loop starts (a worker's would retry it for ever);
    // a database not answering yet is left to the pools, which ask again.
    if (!isPooled(config.databaseUrl, directUrl)) {
      await ownSessions(config.databaseUrl).catch((err: unknown) => {
        if (err instanceof ConfigError) throw err;
      });
    }
    return { url: config.databaseUrl, directUrl, schema, embedded: false, close: async () => {} };
  }
  if (config.production) {
    throw new ConfigError('NODE_ENV=production and DATABASE_URL is unset: set DATABASE_URL to your PostgreSQL (the embedded database is for development only)');
  }
  const cluster = await startEmbeddedPostgres({ dataDir: config.dataDir, log });
  try {
    await migrate(cluster.url, schema);
  } catch (err) {
    await cluster.stop();
    throw err;
  }
  return { url: cluster.url, directUrl: cluster.url, schema, embedded: true, close: () => cluster.stop() };
}

export function openPool(db: Database, name: string, max = 10): Pool {
  return createPool(db.url, { schema: db.schema, max, applicationName: name, pooled: isPooled(db.url, db.directUrl) });
}

export const EMULATOR_KEY = 'sk_test_outboxd_emulator';

export interface GatewayHandle {
  /** Every call through the fleet's shared Stripe budget (STRIPE_RATE_LIMIT). */
  gateway: BudgetedGateway;
  mode: StripeMode;
  /** The built-in emulator this process serves (its control API is under /_emulator/). */
  emulatorUrl?: string;
  /** Whether its answers are evidence about every replica's charges: not so for an emulator whose ledger
   * is this process's alone (DATABASE_URL set, no key, no shared STRIPE_API_BASE). */
  evidence: boolean;
  /** Stops the emulator this process serves, if any. */
  close(): Promise<void>;
}

export interface ServedEmulator {
  url: string;
  close(): Promise<void>;
}

/**
 * Serves the built-in emulator from this process. On the embedded default its state lives in that
 * PostgreSQL (schema stripe_emulator), so every process on the data directory serves the same ledger,
 * keys, clock and faults, across restarts; otherwise (DATABASE_URL, or no database) it lives in this
 * process's memory: Stripe's make-believe is never written into a real database.
 */
export async function serveEmulator(
  db: Database | undefined,
  opts: { port?: number; host?: string; searchLagMs?: number; processingSettleMs?: number; rateLimit?: number } = {},
): Promise<ServedEmulator> {
  // Loaded only here, when a process serves it: the library's entry loads no emulator (test/unit/layout.test.ts).
  const { EmulatorServer, PgState, MemoryState } = await import('../emulator/index.ts');
  const state = db?.embedded ? await PgState.open(db.url) : new MemoryState();
  // A long-running process keeps the newest requests only; the ledger itself is complete.
  const server = new EmulatorServer(state, { requestLogLimit: 1_000, ...(opts.processingSettleMs !== undefined ? { processingSettleMs: opts.processingSettleMs } : {}) });
  const release = async () => {
    if (state instanceof PgState) await state.close();
  };
  try {
    if (opts.searchLagMs !== undefined) await state.configureSearch({ lagMs: opts.searchLagMs });
    if (opts.rateLimit !== undefined) await state.configureRateLimit(opts.rateLimit);
    const { url } = await server.listen(opts.port ?? 0, opts.host);
    return { url, close: async () => (await server.close(), await release()) };
  } catch (err) {
    await release();
    throw err;
  }
}

/** openGateway: Stripe as configured, every call through the fleet's shared budget. */
export async function openGateway(config: Config, log: Logger, db: Database, opts: { evidence?: boolean; accountWaiters?: number } = {}): Promise<GatewayHandle> {
  return withBudget(await openStripe(config, log, db, opts), config, db, log, opts.accountWaiters);
}

/**
 * STRIPE_RATE_LIMIT (and the Search limit, and each connected account's) as buckets in this database,
 * shared by every process on it. A call waits for its tokens at most config.stripe.budgetWaitMs.
 */
function withBudget(handle: Omit<GatewayHandle, 'gateway'> & { gateway: PaymentGateway }, config: Config, db: Database, log: Logger, accountWaiters?: number): GatewayHandle {
  const { rateLimit, searchRateLimit, accountRateLimit, budgetWaitMs } = config.stripe;
  const budgeted = rateLimit !== undefined || searchRateLimit !== undefined || accountRateLimit !== undefined;
  const own = budgeted && !db.pool ? openPool(db, 'outboxd-budget', 2) : undefined;
  const pool = budgeted ? (db.pool ?? own) : undefined;
  const metrics = budgetMetrics();
  const budget = (name: string, rate: number | undefined) => (pool && rate !== undefined ? new Budget(pool, { name, rate, log, metrics }) : undefined);
  const gateway = new BudgetedGateway(handle.gateway, {
    budgets: {
      requests: budget('stripe', rateLimit),
      search: budget('stripe_search', searchRateLimit),
      accounts: pool && accountRateLimit !== undefined ? new AccountBudgets(pool, { name: 'stripe', rate: accountRateLimit, log, metrics }) : undefined,
    },
    maxWaitMs: budgetWaitMs,
    metrics: gatewayMetrics(metrics),
    accountWaiters,
  });
  if (pool) {
    log.info(
      { rateLimit: rateLimit ?? 'off', searchRateLimit: searchRateLimit ?? 'off', accountRateLimit: accountRateLimit ?? 'the platform\'s' },
      'Stripe budget shared by every replica (STRIPE_RATE_LIMIT)',
    );
  }
  return {
    ...handle,
    gateway,
    close: async () => {
      gateway.close();
      await own?.end();
      await handle.close();
    },
  };
}

/**
 * STRIPE_SECRET_KEY set: Stripe (STRIPE_API_BASE only with a test key, see config.ts). Unset: an emulator,
 * never under NODE_ENV=production unless OUTBOXD_STRIPE_EMULATOR=true: the one at STRIPE_API_BASE (replicas
 * sharing a standalone `outboxd stripe-emulator`), else the built-in one (serveEmulator).
 * `evidence`: the command treats Stripe's answers as evidence (resolve, reconcile). With DATABASE_URL the
 * built-in emulator would be an empty one started just now, whose "no such charge" proves nothing: refused.
 */
async function openStripe(config: Config, log: Logger, db: Database, opts: { evidence?: boolean }) {
  const { secretKey, apiBase, timeoutMs, mode } = config.stripe;
  if (secretKey) {
    log.info({ stripeMode: mode, ...(apiBase ? { apiBase } : {}) }, `Stripe in ${mode} mode`);
    return { gateway: new StripeGateway({ secretKey, apiBase, timeoutMs }), mode, evidence: true, close: async () => {} };
  }
  if (config.production && !config.stripe.emulatorOptIn) {
    throw new ConfigError(
      'NODE_ENV=production and STRIPE_SECRET_KEY is unset or blank: set STRIPE_SECRET_KEY; ' +
        'the Stripe emulator (no money moves) runs in production only with OUTBOXD_STRIPE_EMULATOR=true, for a demo',
    );
  }
  const demo = config.production ? ' (NODE_ENV=production, OUTBOXD_STRIPE_EMULATOR=true: a demo)' : '';
  if (apiBase) {
    log.warn({ stripeMode: mode, apiBase }, `STRIPE_SECRET_KEY is unset: using the Stripe emulator at STRIPE_API_BASE; no real money moves${demo}`);
    return { gateway: new StripeGateway({ secretKey: EMULATOR_KEY, apiBase, timeoutMs }), mode, evidence: true, close: async () => {} };
  }
  if (opts.evidence && !db.embedded) {
    throw new ConfigError(
      'this command checks its evidence against Stripe, but STRIPE_SECRET_KEY is unset while DATABASE_URL is set, and a built-in emulator ' +
        'started now would know no charge: set STRIPE_SECRET_KEY, or STRIPE_API_BASE to the emulator the workers share',
    );
  }
  const emulator = await serveEmulator(db);
  log.warn(
    { stripeMode: mode, emulator: emulator.url, ledger: db.embedded ? `embedded database under ${config.dataDir}` : 'this process only' },
    `STRIPE_SECRET_KEY is unset: serving the built-in Stripe emulator (control API under /_emulator/); no real money moves${demo}`,
  );
  const gateway = new StripeGateway({ secretKey: EMULATOR_KEY, apiBase: emulator.url, timeoutMs });
  return { gateway, mode, emulatorUrl: emulator.url, evidence: db.embedded, close: emulator.close };
}
