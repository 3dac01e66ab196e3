// Opens what a command needs from the Config: the database (DATABASE_URL or the embedded default,
// migrated on the fly since a developer's first run has no schema yet) and a pool.
import type { Config } from './config.ts';
import { startEmbeddedPostgres } from './db/embedded.ts';
import { migrate } from './db/migrate.ts';
import { createPool, type Pool } from './db/pool.ts';
import type { Logger } from './log.ts';
import type { PaymentGateway } from './payments/gateway.ts';
import { StripeEmulator } from './stripe/emulator/emulator.ts';
import { StripeGateway } from './stripe/gateway.ts';

export interface Database {
  url: string;
  /** outboxd's schema in it (OUTBOXD_SCHEMA). */
  schema: string;
  embedded: boolean;
  /** Stops the embedded cluster if this process started it. */
  close(): Promise<void>;
}

export async function openDatabase(config: Config, log: Logger): Promise<Database> {
  const { schema } = config;
  if (config.databaseUrl) return { url: config.databaseUrl, schema, embedded: false, close: async () => {} };
  const cluster = await startEmbeddedPostgres({ dataDir: config.dataDir, log });
  await migrate(cluster.url, schema);
  return { url: cluster.url, schema, embedded: true, close: () => cluster.stop() };
}

export function openPool(db: Database, name: string, max = 10): Pool {
  return createPool(db.url, { schema: db.schema, max, applicationName: name });
}

export const EMULATOR_KEY = 'sk_test_outboxd_emulator';

export interface GatewayHandle {
  gateway: PaymentGateway;
  /** Stops the built-in emulator if this process started it. */
  close(): Promise<void>;
}

/**
 * STRIPE_SECRET_KEY set: real Stripe (or STRIPE_API_BASE). Unset: the built-in emulator, started here
 * unless STRIPE_API_BASE points at a running one (replicas sharing a standalone `outboxd stripe-emulator`).
 */
export async function openGateway(config: Config, log: Logger): Promise<GatewayHandle> {
  const { secretKey, apiBase, timeoutMs } = config.stripe;
  if (secretKey) return { gateway: new StripeGateway({ secretKey, apiBase, timeoutMs }), close: async () => {} };
  if (apiBase) {
    log.warn({ apiBase }, 'STRIPE_SECRET_KEY is unset: using the Stripe emulator at STRIPE_API_BASE; no real money moves');
    return { gateway: new StripeGateway({ secretKey: EMULATOR_KEY, apiBase, timeoutMs }), close: async () => {} };
  }
  const emulator = new StripeEmulator({ processingSettleMs: 30_000 });
  const { url } = await emulator.listen(0);
  log.warn({ emulator: url }, 'STRIPE_SECRET_KEY is unset: started the built-in Stripe emulator; no real money moves');
  return {
    gateway: new StripeGateway({ secretKey: EMULATOR_KEY, apiBase: url, timeoutMs }),
    close: () => emulator.close(),
  };
}
