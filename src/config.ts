// Configuration is read from the environment once, at the edge, and validated here. Everything below
// receives a typed Config; nothing else reads process.env.
import { z } from 'zod';

const optionalString = z.string().trim().min(1).optional().catch(undefined);
const intInRange = (min: number, max: number, fallback: number) =>
  z.coerce.number().int().min(min).max(max).default(fallback);

export const envSchema = z.object({
  DATABASE_URL: optionalString,
  /** Where the embedded PostgreSQL keeps its cluster when DATABASE_URL is unset. */
  OUTBOXD_DATA_DIR: z.string().min(1).default('./.data'),
  STRIPE_SECRET_KEY: optionalString,
  STRIPE_API_BASE: z.url().optional(),
  /** Explicit opt-in to the Stripe emulator under NODE_ENV=production (a demo); never with a key. */
  OUTBOXD_STRIPE_EMULATOR: z.stringbool().default(false),
  /** Per-attempt client timeout of a Stripe call (the SDK's `timeout`). */
  STRIPE_TIMEOUT_MS: intInRange(100, 120_000, 20_000),
  WORKER_CONCURRENCY: intInRange(1, 256, 8),
  /** Operation lease. Must outlive STRIPE_TIMEOUT_MS: it is renewed every third of it while a call runs. */
  LEASE_TTL_MS: intInRange(1_000, 600_000, 30_000),
  SHUTDOWN_GRACE_MS: intInRange(0, 600_000, 25_000),
  HTTP_PORT: intInRange(0, 65_535, 8080),
  /** cron of the reconcile sweep every worker schedules (pg-boss runs one at a time). */
  RECONCILE_CRON: z.string().min(9).default('*/5 * * * *'),
  /** Admin HTTP API bearer token; unset: the admin routes are off. */
  ADMIN_TOKEN: z.string().min(16, 'ADMIN_TOKEN must be at least 16 characters').optional(),
  /** Who the admin token acts as in the audit trail. */
  ADMIN_TOKEN_NAME: z.string().min(1).default('admin-api'),
  /** Stripe webhook signing secret; unset: POST /webhooks/stripe is off. */
  STRIPE_WEBHOOK_SECRET: optionalString,
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
});

export type Env = z.infer<typeof envSchema>;

/** Which Stripe the payments go to: the emulator (no key, no money), or the key's mode. */
export type StripeMode = 'emulator' | 'test' | 'live';

export interface Config {
  production: boolean;
  databaseUrl: string | undefined;
  dataDir: string;
  stripe: { secretKey: string | undefined; apiBase: string | undefined; timeoutMs: number; mode: StripeMode; emulatorOptIn: boolean };
  worker: { concurrency: number; leaseTtlMs: number; shutdownGraceMs: number; httpPort: number; reconcileCron: string };
  admin: { token: string | undefined; tokenName: string };
  webhookSecret: string | undefined;
  logLevel: Env['LOG_LEVEL'];
}

export class ConfigError extends Error {
  override name = 'ConfigError';
}

export function loadConfig(env: NodeJS.ProcessEnv = process.env): Config {
  const parsed = envSchema.safeParse(env);
  if (!parsed.success) {
    const problems = parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ');
    throw new ConfigError(`invalid environment: ${problems}`);
  }
  const e = parsed.data;
  if (e.LEASE_TTL_MS <= e.STRIPE_TIMEOUT_MS) {
    throw new ConfigError(
      `LEASE_TTL_MS (${e.LEASE_TTL_MS}) must be longer than STRIPE_TIMEOUT_MS (${e.STRIPE_TIMEOUT_MS}): ` +
        'a lease that ends before the call it covers lets a second replica call Stripe concurrently',
    );
  }
  return {
    // Node's own variable, not outboxd's: production requires DATABASE_URL and STRIPE_SECRET_KEY.
    production: env.NODE_ENV === 'production',
    databaseUrl: e.DATABASE_URL,
    dataDir: e.OUTBOXD_DATA_DIR,
    stripe: {
      secretKey: e.STRIPE_SECRET_KEY,
      apiBase: e.STRIPE_API_BASE,
      timeoutMs: e.STRIPE_TIMEOUT_MS,
      mode: stripeMode(e),
      emulatorOptIn: e.OUTBOXD_STRIPE_EMULATOR,
    },
    worker: {
      concurrency: e.WORKER_CONCURRENCY,
      leaseTtlMs: e.LEASE_TTL_MS,
      shutdownGraceMs: e.SHUTDOWN_GRACE_MS,
      httpPort: e.HTTP_PORT,
      reconcileCron: e.RECONCILE_CRON,
    },
    admin: { token: e.ADMIN_TOKEN, tokenName: e.ADMIN_TOKEN_NAME },
    webhookSecret: e.STRIPE_WEBHOOK_SECRET,
    logLevel: e.LOG_LEVEL,
  };
}

/** Fails closed: a key of no known mode, a live key sent anywhere but Stripe, or an emulator opt-in beside a key. */
function stripeMode(e: Env): StripeMode {
  const key = e.STRIPE_SECRET_KEY;
  if (!key) return 'emulator';
  if (e.OUTBOXD_STRIPE_EMULATOR) {
    throw new ConfigError('OUTBOXD_STRIPE_EMULATOR and STRIPE_SECRET_KEY are both set: unset one (the emulator opt-in is for demos without a key)');
  }
  const mode = /^[sr]k_live_/.test(key) ? 'live' : /^[sr]k_test_/.test(key) ? 'test' : undefined;
  if (!mode) throw new ConfigError('STRIPE_SECRET_KEY is not a Stripe secret or restricted key (sk_live_…, sk_test_…, rk_live_…, rk_test_…)');
  if (mode === 'live' && e.STRIPE_API_BASE) {
    throw new ConfigError(`STRIPE_API_BASE (${e.STRIPE_API_BASE}) is set with a live STRIPE_SECRET_KEY: a live key is only ever sent to Stripe; unset STRIPE_API_BASE, or use a test key`);
  }
  return mode;
}
