// Configuration is read from the environment once, at the edge, and validated here. Everything below
// receives a typed Config; nothing else reads process.env.
import { z } from 'zod';
import { DEFAULT_SCHEMA, SCHEMA_NAME } from './sql/statements.ts';

const optionalString = z.string().trim().min(1).optional().catch(undefined);
const intInRange = (min: number, max: number, fallback: number) =>
  z.coerce.number().int().min(min).max(max).default(fallback);

export const envSchema = z.object({
  DATABASE_URL: optionalString,
  /** PostgreSQL schema of outboxd's tables (the application's own tables stay wherever it keeps them). */
  OUTBOXD_SCHEMA: z
    .string()
    .regex(SCHEMA_NAME, 'OUTBOXD_SCHEMA must be a lower-case identifier (a-z, 0-9, _) of at most 40 characters')
    .default(DEFAULT_SCHEMA),
  /** Where the embedded PostgreSQL keeps its cluster when DATABASE_URL is unset. */
  OUTBOXD_DATA_DIR: z.string().min(1).default('./.data'),
  STRIPE_SECRET_KEY: optionalString,
  STRIPE_API_BASE: z.url().optional(),
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

export interface Config {
  databaseUrl: string | undefined;
  schema: string;
  dataDir: string;
  stripe: { secretKey: string | undefined; apiBase: string | undefined; timeoutMs: number };
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
    databaseUrl: e.DATABASE_URL,
    schema: e.OUTBOXD_SCHEMA,
    dataDir: e.OUTBOXD_DATA_DIR,
    stripe: { secretKey: e.STRIPE_SECRET_KEY, apiBase: e.STRIPE_API_BASE, timeoutMs: e.STRIPE_TIMEOUT_MS },
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

/**
 * OUTBOXD_SCHEMA alone, for the library: an application embedding outboxd and `outboxd worker` beside
 * it agree on the schema through the same variable, without the library judging the worker's settings.
 */
export function schemaFromEnv(env: NodeJS.ProcessEnv = process.env): string {
  const parsed = envSchema.shape.OUTBOXD_SCHEMA.safeParse(env.OUTBOXD_SCHEMA);
  if (!parsed.success) throw new ConfigError(`invalid environment: OUTBOXD_SCHEMA: ${parsed.error.issues[0]!.message}`);
  return parsed.data;
}
