// Configuration is read from the environment once, at the edge, and validated here. Everything below
// receives a typed Config; nothing else reads process.env.
import { CronExpressionParser } from 'cron-parser';
import { z } from 'zod';
import { DEFAULT_SCHEMA, SCHEMA_NAME } from '../sql/statements.ts';

const optionalString = z.string().trim().min(1).optional().catch(undefined);
/** The longest onSettled delivery. pg-boss fails a subscriber's job 15 minutes after its delivery began,
 * whatever its heartbeat (the settled queues' expireInSeconds, src/outbox/settlements.ts), and retries it:
 * a handler still running then would run twice at once, and a transactional one's delivery be fenced out
 * at every attempt. A longer SETTLEMENT_HANDLER_TIMEOUT_MS (accepted up to an hour, as by earlier
 * releases, where it worked for handlers that return sooner) is taken as this one (src/outboxd.ts). */
export const MAX_SETTLEMENT_HANDLER_TIMEOUT_MS = 14 * 60_000;
/** A call's wait for its Stripe budget tokens can be no shorter: the budget's own round trip to its bucket
 * must fit in it, or every wait ends before its answer and the call is never sent. */
const MIN_BUDGET_WAIT_MS = 500;

const intInRange = (min: number, max: number, fallback: number) =>
  z.coerce.number().int().min(min).max(max).default(fallback);
const port = z.coerce.number().int().min(0).max(65_535);
/** A cron expression pg-boss's schedule() takes (it parses with cron-parser so, in UTC), refused here
 * where the variable is named; or a recurrence rule (FREQ=…), which pg-boss takes too and checks itself
 * when the dispatcher schedules it, before any work loop. */
const isCron = (text: string): boolean => {
  if (!text.trim()) return false;
  if (/(?:^|[\s;])FREQ=/im.test(text)) return true;
  try {
    CronExpressionParser.parse(text, { tz: 'UTC', strict: false });
    return true;
  } catch {
    return false;
  }
};
/** A bind address: an IP (0.0.0.0 and :: mean every interface) or a host name. */
const bindAddress = z.union([z.ipv4(), z.ipv6(), z.hostname()], { error: 'an IP address or a host name' });
const httpUrl = z.url({ protocol: /^https?$/, error: 'an http(s) URL' });
/** Requests per second, or `off`. */
const perSecond = { error: 'a number of requests per second, or off' };
const rateLimit = z.union([z.literal('off'), z.coerce.number(perSecond).positive(perSecond).max(100_000, perSecond)], perSecond);
/** The OTLP/HTTP encodings the worker ships exporters for (gRPC would need another exporter). */
const otlpProtocol = z.enum(['http/protobuf', 'http/json'], { error: 'only http/protobuf and http/json are supported' });

export const envSchema = z.object({
  DATABASE_URL: optionalString,
  /** A session connection for what a transaction pooler cannot carry (the migrations' lock, LISTEN), when
   * DATABASE_URL is a pooler's. Set: DATABASE_URL is taken to be one. */
  DATABASE_DIRECT_URL: optionalString,
  /** PostgreSQL schema of outboxd's tables (the application's own tables stay wherever it keeps them). */
  OUTBOXD_SCHEMA: z
    .string()
    .regex(SCHEMA_NAME, 'OUTBOXD_SCHEMA must be a lower-case identifier (a-z, 0-9, _) of at most 40 characters')
    .default(DEFAULT_SCHEMA),
  /** Where the embedded PostgreSQL keeps its cluster when DATABASE_URL is unset. */
  OUTBOXD_DATA_DIR: z.string().min(1).default('./.data'),
  STRIPE_SECRET_KEY: optionalString,
  STRIPE_API_BASE: z.url().optional(),
  /** Explicit opt-in to the Stripe emulator under NODE_ENV=production (a demo); never with a key. */
  OUTBOXD_STRIPE_EMULATOR: z.stringbool().default(false),
  /** Stripe requests/s for all replicas together, shared through PostgreSQL; `off`: no budget. */
  STRIPE_RATE_LIMIT: rateLimit.optional(),
  /** Stripe Search requests/s for all replicas together (they count against STRIPE_RATE_LIMIT too). */
  STRIPE_SEARCH_RATE_LIMIT: rateLimit.optional(),
  /** Stripe requests/s on each connected account (Stripe-Account) for all replicas together; they count
   * against STRIPE_RATE_LIMIT too. */
  STRIPE_ACCOUNT_RATE_LIMIT: rateLimit.optional(),
  /** Per-attempt timeout of a Stripe call (the SDK's `timeout`), as a deadline for the whole request
   * (src/stripe/boundedHttpClient.ts). */
  STRIPE_TIMEOUT_MS: intInRange(100, 120_000, 20_000),
  WORKER_CONCURRENCY: intInRange(1, 256, 8),
  /** Operation lease. Must outlive STRIPE_TIMEOUT_MS: it is renewed every third of it while a call runs. */
  LEASE_TTL_MS: intInRange(1_000, 600_000, 30_000),
  SHUTDOWN_GRACE_MS: intInRange(0, 600_000, 25_000),
  HTTP_PORT: intInRange(0, 65_535, 8080),
  HTTP_HOST: bindAddress.default('0.0.0.0'),
  /** Set: the admin API gets a listener of its own, and the main listener serves no admin route. */
  ADMIN_HTTP_PORT: port.optional(),
  /** The admin listener's address: loopback unless told, as it is meant for operators, not the world. */
  ADMIN_HTTP_HOST: bindAddress.optional(),
  /** cron of the reconcile sweep every worker schedules (pg-boss runs one at a time). */
  RECONCILE_CRON: z
    .string()
    .refine(isCron, 'RECONCILE_CRON must be a cron expression of 5 fields (6 with seconds), as pg-boss reads it (*/5 * * * *, say), or a recurrence rule (FREQ=MINUTELY;INTERVAL=5)')
    .default('*/5 * * * *'),
  /** Admin HTTP API bearer token; unset: the admin routes are off. */
  ADMIN_TOKEN: z.string().min(16, 'ADMIN_TOKEN must be at least 16 characters').optional(),
  /** Who the admin token acts as in the audit trail. */
  ADMIN_TOKEN_NAME: z.string().min(1).default('admin-api'),
  /** A token for the admin API and the console that reads everything and changes nothing. */
  ADMIN_READONLY_TOKEN: z.string().min(16, 'ADMIN_READONLY_TOKEN must be at least 16 characters').optional(),
  /** A console session ends after this long without a page view (and after 8 hours whatever happens). */
  CONSOLE_IDLE_MINUTES: intInRange(1, 480, 30),
  /** Stripe webhook signing secret; unset: POST /webhooks/stripe is off. */
  STRIPE_WEBHOOK_SECRET: optionalString,
  /** Days a received webhook event's (trimmed) payload is kept. */
  // Stripe retries a webhook for up to 3 days: a shorter memory would take a late retry for a new event.
  WEBHOOK_RETENTION_DAYS: intInRange(4, 3650, 30),
  /** Days an operation's timeline is kept once it settled (an unsettled one's is kept). */
  OPERATION_EVENTS_RETENTION_DAYS: intInRange(1, 36_500, 90),
  /** Days an admin action is kept (one about an unsettled operation is kept). */
  AUDIT_RETENTION_DAYS: intInRange(1, 36_500, 365),
  /** A failed resolution waits this long after the last create that may have executed: Stripe's search
   * normally lags under a minute, longer during incidents. */
  SEARCH_FRESHNESS_SECONDS: intInRange(0, 7 * 86_400, 3_600),
  /** A payment still `processing` (a refund `pending`) this many days after it first was is held for a
   * person; until then it waits, checked on a slowing schedule (src/engine/processing.ts). */
  PROCESSING_REVIEW_DAYS: intInRange(1, 365, 14),
  /** One onSettled delivery's time (the application's handler, and a transactional one's transaction)
   * before it counts as failed and is retried. Read by the library (settlementHandlerTimeoutFromEnv). */
  SETTLEMENT_HANDLER_TIMEOUT_MS: intInRange(100, 3_600_000, 30_000),
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
  // OpenTelemetry's standard variables (traces only). No endpoint: tracing is off and no SDK is started.
  OTEL_SDK_DISABLED: z.stringbool().default(false),
  /** Base URL of an OTLP/HTTP receiver; traces go to <it>/v1/traces. */
  OTEL_EXPORTER_OTLP_ENDPOINT: httpUrl.optional(),
  /** The traces URL as it is (takes precedence over OTEL_EXPORTER_OTLP_ENDPOINT). */
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: httpUrl.optional(),
  OTEL_EXPORTER_OTLP_PROTOCOL: otlpProtocol.default('http/protobuf'),
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: otlpProtocol.optional(),
  OTEL_SERVICE_NAME: z.string().min(1).default('outboxd'),
  OTEL_TRACES_SAMPLER: z
    .enum(['always_on', 'always_off', 'traceidratio', 'parentbased_always_on', 'parentbased_always_off', 'parentbased_traceidratio'], {
      error: 'OTEL_TRACES_SAMPLER must be always_on, always_off, traceidratio or parentbased_{always_on,always_off,traceidratio}',
    })
    .default('parentbased_always_on'),
  /** The ratio of a *traceidratio sampler. */
  OTEL_TRACES_SAMPLER_ARG: z.coerce.number().min(0).max(1).default(1),
});

export type Env = z.infer<typeof envSchema>;

/** Which Stripe the payments go to: the emulator (no key, no money), or the key's mode. */
export type StripeMode = 'emulator' | 'test' | 'live';

export interface Config {
  production: boolean;
  databaseUrl: string | undefined;
  databaseDirectUrl: string | undefined;
  schema: string;
  dataDir: string;
  stripe: {
    secretKey: string | undefined;
    apiBase: string | undefined;
    timeoutMs: number;
    /** The longest a call waits for its tokens of the fleet's Stripe budget: half of what the lease has
     * beyond the Stripe timeout, so that a caller that does not renew its lease (the reconcile sweep)
     * still holds it when its call ends. */
    budgetWaitMs: number;
    mode: StripeMode;
    emulatorOptIn: boolean;
    /** Requests/s for the fleet, and Search requests/s; undefined: no budget. */
    rateLimit: number | undefined;
    searchRateLimit: number | undefined;
    /** Requests/s on each connected account, when it needs a bucket of its own: undefined when it has no
     * limit, or one at or above rateLimit (its requests take from the platform's bucket too, which then
     * bounds them already: a bucket of its own could never refuse one, and would only cost statements). */
    accountRateLimit: number | undefined;
  };
  worker: { concurrency: number; leaseTtlMs: number; shutdownGraceMs: number; httpPort: number; httpHost: string; reconcileCron: string };
  /** httpPort unset: the admin routes are served on the main listener (worker.httpPort). */
  admin: {
    token: string | undefined;
    tokenName: string;
    /** Reads only: every route that changes something refuses it, on the server. */
    readonlyToken: string | undefined;
    consoleIdleSeconds: number;
    httpPort: number | undefined;
    httpHost: string;
  };
  /** STRIPE_WEBHOOK_SECRET's, each a webhook endpoint's (the platform's, the connected accounts'); none: no route. */
  webhookSecrets: string[];
  /** The timeline's, the audit trail's and the stored webhook events' (src/outbox/retention.ts). */
  retentionDays: { operationEvents: number; audit: number; webhookEvents: number };
  searchFreshnessSeconds: number;
  processingReviewDays: number;
  logLevel: Env['LOG_LEVEL'];
  /** Undefined: tracing is off (no endpoint, or OTEL_SDK_DISABLED). */
  tracing: TracingConfig | undefined;
}

export interface TracingConfig {
  /** Where spans are POSTed (…/v1/traces). */
  url: string;
  protocol: Env['OTEL_EXPORTER_OTLP_PROTOCOL'];
  serviceName: string;
  sampler: Env['OTEL_TRACES_SAMPLER'];
  samplerRatio: number;
}

export class ConfigError extends Error {
  override name = 'ConfigError';
}

export function loadConfig(env: NodeJS.ProcessEnv = process.env): Config {
  // An empty value means unset, as env files write it (`ADMIN_TOKEN=` in deploy/.env.example).
  const parsed = envSchema.safeParse(Object.fromEntries(Object.entries(env).filter(([, v]) => v?.trim())));
  if (!parsed.success) {
    const problems = parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ');
    throw new ConfigError(`invalid environment: ${problems}`);
  }
  const e = parsed.data;
  const budgetWaitMs = Math.floor((e.LEASE_TTL_MS - e.STRIPE_TIMEOUT_MS) / 2);
  if (budgetWaitMs < MIN_BUDGET_WAIT_MS) {
    throw new ConfigError(
      `LEASE_TTL_MS (${e.LEASE_TTL_MS}) must be at least ${2 * MIN_BUDGET_WAIT_MS} ms longer than STRIPE_TIMEOUT_MS (${e.STRIPE_TIMEOUT_MS}): ` +
        'a lease that ends before the call it covers lets a second replica call Stripe concurrently, and a call waits ' +
        `for its Stripe budget half the difference, which below ${MIN_BUDGET_WAIT_MS} ms can end before the budget answers, every time`,
    );
  }
  if (e.ADMIN_HTTP_PORT === undefined && e.ADMIN_HTTP_HOST !== undefined) {
    throw new ConfigError('ADMIN_HTTP_HOST is set but ADMIN_HTTP_PORT is not: the admin API has no listener of its own to bind');
  }
  if (e.ADMIN_HTTP_PORT !== undefined && e.ADMIN_HTTP_PORT !== 0 && e.ADMIN_HTTP_PORT === e.HTTP_PORT) {
    throw new ConfigError(`ADMIN_HTTP_PORT and HTTP_PORT are both ${e.HTTP_PORT}: the admin listener needs a port of its own`);
  }
  if (e.ADMIN_READONLY_TOKEN !== undefined && e.ADMIN_READONLY_TOKEN === e.ADMIN_TOKEN) {
    throw new ConfigError('ADMIN_READONLY_TOKEN is the same as ADMIN_TOKEN: a read-only operator would be able to act');
  }
  const mode = stripeMode(e);
  return {
    // Node's own variable, not outboxd's: production requires DATABASE_URL and STRIPE_SECRET_KEY.
    production: env.NODE_ENV === 'production',
    databaseUrl: e.DATABASE_URL,
    databaseDirectUrl: e.DATABASE_DIRECT_URL,
    schema: e.OUTBOXD_SCHEMA,
    dataDir: e.OUTBOXD_DATA_DIR,
    stripe: {
      secretKey: e.STRIPE_SECRET_KEY,
      apiBase: e.STRIPE_API_BASE,
      timeoutMs: e.STRIPE_TIMEOUT_MS,
      budgetWaitMs,
      mode,
      emulatorOptIn: e.OUTBOXD_STRIPE_EMULATOR,
      ...rateLimits(e, mode),
    },
    worker: {
      concurrency: e.WORKER_CONCURRENCY,
      leaseTtlMs: e.LEASE_TTL_MS,
      shutdownGraceMs: e.SHUTDOWN_GRACE_MS,
      httpPort: e.HTTP_PORT,
      httpHost: e.HTTP_HOST,
      reconcileCron: e.RECONCILE_CRON,
    },
    admin: {
      token: e.ADMIN_TOKEN,
      tokenName: e.ADMIN_TOKEN_NAME,
      readonlyToken: e.ADMIN_READONLY_TOKEN,
      consoleIdleSeconds: e.CONSOLE_IDLE_MINUTES * 60,
      httpPort: e.ADMIN_HTTP_PORT,
      httpHost: e.ADMIN_HTTP_HOST ?? '127.0.0.1',
    },
    webhookSecrets: e.STRIPE_WEBHOOK_SECRET?.split(',').map((s) => s.trim()).filter(Boolean) ?? [],
    retentionDays: { operationEvents: e.OPERATION_EVENTS_RETENTION_DAYS, audit: e.AUDIT_RETENTION_DAYS, webhookEvents: e.WEBHOOK_RETENTION_DAYS },
    searchFreshnessSeconds: e.SEARCH_FRESHNESS_SECONDS,
    processingReviewDays: e.PROCESSING_REVIEW_DAYS,
    logLevel: e.LOG_LEVEL,
    tracing: tracingConfig(e),
  };
}

function tracingConfig(e: Env): TracingConfig | undefined {
  const url = e.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT ?? (e.OTEL_EXPORTER_OTLP_ENDPOINT && `${e.OTEL_EXPORTER_OTLP_ENDPOINT.replace(/\/+$/, '')}/v1/traces`);
  if (!url || e.OTEL_SDK_DISABLED) return undefined;
  return {
    url,
    protocol: e.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL ?? e.OTEL_EXPORTER_OTLP_PROTOCOL,
    serviceName: e.OTEL_SERVICE_NAME,
    sampler: e.OTEL_TRACES_SAMPLER,
    samplerRatio: e.OTEL_TRACES_SAMPLER_ARG,
  };
}

/** What a worker inside the application (startWorker) never reads: the listeners, the admin API and
 * console, webhooks, and tracing (the application's own OpenTelemetry SDK takes its spans). */
const NOT_READ_IN_PROCESS = /^(OTEL_|HTTP_|ADMIN_|CONSOLE_)|^STRIPE_WEBHOOK_SECRET$/;

/** loadConfig for a worker inside the application, whose process may set the variables it never reads
 * for itself, with values of its own (an OTLP exporter over gRPC, say): they are not judged. */
export function loadInProcessConfig(env: NodeJS.ProcessEnv = process.env): Config {
  const read = Object.entries(env).filter(([name]) => !NOT_READ_IN_PROCESS.test(name));
  // The application's own LOG_LEVEL may name a level of its logger's (`warning`, `verbose`): the worker's
  // log then keeps its default rather than refuse to start.
  const ours = (name: string, value: string | undefined) => name !== 'LOG_LEVEL' || envSchema.shape.LOG_LEVEL.safeParse(value).success;
  return loadConfig(Object.fromEntries(read.filter(([name, value]) => ours(name, value))));
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

/** SETTLEMENT_HANDLER_TIMEOUT_MS alone, for the library (as schemaFromEnv). */
export function settlementHandlerTimeoutFromEnv(env: NodeJS.ProcessEnv = process.env): number {
  const parsed = envSchema.shape.SETTLEMENT_HANDLER_TIMEOUT_MS.safeParse(env.SETTLEMENT_HANDLER_TIMEOUT_MS?.trim() || undefined);
  if (!parsed.success) throw new ConfigError(`invalid environment: SETTLEMENT_HANDLER_TIMEOUT_MS: ${parsed.error.issues[0]!.message}`);
  return parsed.data;
}

/** Stripe's published limits per account: live 100 requests/s, test mode 25, Search 20. The emulator
 * has none unless told (STRIPE_RATE_LIMIT, and its own control API). */
const DEFAULT_RATE_LIMIT: Record<StripeMode, number | undefined> = { live: 100, test: 25, emulator: undefined };
const DEFAULT_SEARCH_RATE_LIMIT = 20;

/**
 * A connected account's limit is, by default, what Stripe documents for every account in the key's mode
 * (STRIPE_RATE_LIMIT's own default), whatever STRIPE_RATE_LIMIT says: a platform whose limit Stripe
 * raised keeps its accounts at theirs. With the emulator, which documents none, it is STRIPE_RATE_LIMIT.
 */
function rateLimits(e: Env, mode: StripeMode): { rateLimit: number | undefined; searchRateLimit: number | undefined; accountRateLimit: number | undefined } {
  const rateLimit = e.STRIPE_RATE_LIMIT === 'off' ? undefined : (e.STRIPE_RATE_LIMIT ?? DEFAULT_RATE_LIMIT[mode]);
  const search = e.STRIPE_SEARCH_RATE_LIMIT ?? (rateLimit === undefined ? 'off' : DEFAULT_SEARCH_RATE_LIMIT);
  const account = e.STRIPE_ACCOUNT_RATE_LIMIT ?? (rateLimit === undefined ? 'off' : (DEFAULT_RATE_LIMIT[mode] ?? rateLimit));
  const ownBucket = account !== 'off' && (rateLimit === undefined || account < rateLimit);
  return { rateLimit, searchRateLimit: search === 'off' ? undefined : search, accountRateLimit: ownBucket ? account : undefined };
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
