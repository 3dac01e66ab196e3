// The environment as operators write it: env files leave optional values empty, and listeners are
// placed by port and address.
import { describe, expect, it } from 'vitest';
import { ConfigError, envSchema, loadConfig, MAX_SETTLEMENT_HANDLER_TIMEOUT_MS, settlementHandlerTimeoutFromEnv } from '../../src/runtime/config.ts';
import { settledQueueOptions } from '../../src/outbox/settlements.ts';

describe('loadConfig', () => {
  it('an empty or blank value of any variable means unset', () => {
    const defaults = loadConfig({});
    for (const key of Object.keys(envSchema.shape)) {
      expect(loadConfig({ [key]: '' }), key).toEqual(defaults);
      expect(loadConfig({ [key]: '  ' }), key).toEqual(defaults);
    }
  });

  it('places the admin API on its own listener only when ADMIN_HTTP_PORT is set', () => {
    expect(loadConfig({}).admin).toMatchObject({ httpPort: undefined });
    expect(loadConfig({}).worker.httpHost).toBe('0.0.0.0');
    expect(loadConfig({ ADMIN_HTTP_PORT: '8081' }).admin).toMatchObject({ httpPort: 8081, httpHost: '127.0.0.1' });
    expect(loadConfig({ ADMIN_HTTP_PORT: '8081', ADMIN_HTTP_HOST: '0.0.0.0', HTTP_HOST: '::' })).toMatchObject({
      admin: { httpPort: 8081, httpHost: '0.0.0.0' },
      worker: { httpHost: '::' },
    });
  });

  it('refuses listener settings that cannot be meant, naming the variable', () => {
    expect(() => loadConfig({ ADMIN_HTTP_HOST: '0.0.0.0' })).toThrow(/ADMIN_HTTP_HOST is set but ADMIN_HTTP_PORT is not/);
    expect(() => loadConfig({ ADMIN_HTTP_PORT: '8080' })).toThrow(/ADMIN_HTTP_PORT and HTTP_PORT are both 8080/);
    expect(() => loadConfig({ ADMIN_HTTP_PORT: '70000' })).toThrow(/ADMIN_HTTP_PORT/);
    expect(() => loadConfig({ HTTP_HOST: 'not an address' })).toThrow(ConfigError);
    expect(() => loadConfig({ HTTP_HOST: 'not an address' })).toThrow(/HTTP_HOST/);
    // Two listeners on "any free port" (tests) do not collide.
    expect(loadConfig({ HTTP_PORT: '0', ADMIN_HTTP_PORT: '0' }).admin.httpPort).toBe(0);
  });
});

describe('RECONCILE_CRON', () => {
  it("is refused at the edge, naming the variable, when pg-boss's schedule would refuse it: after the work loops began to claim", () => {
    for (const cron of ['*/5 * * * * * *', 'every five minutes', '61 * * * *', '* * * * 8']) {
      expect(() => loadConfig({ RECONCILE_CRON: cron }), cron).toThrow(/RECONCILE_CRON must be a cron expression/);
    }
    expect(loadConfig({}).worker.reconcileCron).toBe('*/5 * * * *');
    expect(loadConfig({ RECONCILE_CRON: '0 0 1 1 *' }).worker.reconcileCron).toBe('0 0 1 1 *');
    expect(loadConfig({ RECONCILE_CRON: '*/30 * * * * *' }).worker.reconcileCron).toBe('*/30 * * * * *');
    // pg-boss takes recurrence rules too, and checks them when the dispatcher schedules, before its loops.
    expect(loadConfig({ RECONCILE_CRON: 'FREQ=MINUTELY;INTERVAL=5' }).worker.reconcileCron).toBe('FREQ=MINUTELY;INTERVAL=5');
  });
});

describe('SETTLEMENT_HANDLER_TIMEOUT_MS', () => {
  it("is taken at most as a delivery that ends before pg-boss fails a subscriber's job, whatever its heartbeat, and retries it", () => {
    expect(MAX_SETTLEMENT_HANDLER_TIMEOUT_MS + 60_000).toBeLessThanOrEqual(settledQueueOptions.expireInSeconds! * 1000);
  });

  it('is accepted up to an hour, as before (a worker never reads it, an application takes it as at most 14 minutes)', () => {
    expect(settlementHandlerTimeoutFromEnv({})).toBe(30_000);
    expect(settlementHandlerTimeoutFromEnv({ SETTLEMENT_HANDLER_TIMEOUT_MS: '3600000' })).toBe(3_600_000);
    expect(() => loadConfig({ SETTLEMENT_HANDLER_TIMEOUT_MS: '3600000' })).not.toThrow();
  });
});

describe("Stripe's rate limit: a budget for all replicas together", () => {
  it("defaults to Stripe's published limits for the key's mode, and to none for the emulator", () => {
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_test_x' }).stripe).toMatchObject({ rateLimit: 25, searchRateLimit: 20 });
    expect(loadConfig({ STRIPE_SECRET_KEY: 'rk_test_x' }).stripe).toMatchObject({ rateLimit: 25, searchRateLimit: 20 });
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x' }).stripe).toMatchObject({ rateLimit: 100, searchRateLimit: 20 });
    expect(loadConfig({}).stripe).toMatchObject({ rateLimit: undefined, searchRateLimit: undefined });
  });

  it('takes what it is told: a number, or off', () => {
    expect(loadConfig({ STRIPE_RATE_LIMIT: '25' }).stripe).toMatchObject({ rateLimit: 25, searchRateLimit: 20 });
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x', STRIPE_RATE_LIMIT: '60', STRIPE_SEARCH_RATE_LIMIT: '10' }).stripe).toMatchObject({ rateLimit: 60, searchRateLimit: 10 });
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_test_x', STRIPE_RATE_LIMIT: 'off' }).stripe).toMatchObject({ rateLimit: undefined, searchRateLimit: undefined });
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_test_x', STRIPE_SEARCH_RATE_LIMIT: 'off' }).stripe).toMatchObject({ rateLimit: 25, searchRateLimit: undefined });
    expect(loadConfig({ STRIPE_RATE_LIMIT: '12.5' }).stripe.rateLimit).toBe(12.5);
    for (const bad of ['0', '-5', 'fast']) expect(() => loadConfig({ STRIPE_RATE_LIMIT: bad })).toThrow(/STRIPE_RATE_LIMIT: a number of requests per second, or off/);
  });

  it('a call waits for its tokens half of what the lease has beyond the Stripe timeout; a lease that leaves it under 500 ms is refused', () => {
    expect(loadConfig({}).stripe.budgetWaitMs).toBe(5_000);
    expect(loadConfig({ LEASE_TTL_MS: '3000', STRIPE_TIMEOUT_MS: '2000' }).stripe.budgetWaitMs).toBe(500);
    // A wait of 0 ms ends before the bucket answers, every time: the operation would be rescheduled for ever, never sent.
    for (const [lease, timeout] of [['20001', '20000'], ['2999', '2000'], ['20000', '20000'], ['10000', '20000']]) {
      expect(() => loadConfig({ LEASE_TTL_MS: lease, STRIPE_TIMEOUT_MS: timeout })).toThrow(/LEASE_TTL_MS \(\d+\) must be at least 1000 ms longer than STRIPE_TIMEOUT_MS/);
    }
  });

  it("gives a connected account a bucket of its own only below the platform's rate (the platform's bounds it otherwise)", () => {
    // Defaults: Stripe's documented limit per account, the platform's own: no bucket of its own.
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x' }).stripe.accountRateLimit).toBeUndefined();
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_test_x' }).stripe.accountRateLimit).toBeUndefined();
    // A platform whose limit Stripe raised keeps its accounts at the documented one.
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x', STRIPE_RATE_LIMIT: '500' }).stripe).toMatchObject({ rateLimit: 500, accountRateLimit: 100 });
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x', STRIPE_RATE_LIMIT: '500', STRIPE_ACCOUNT_RATE_LIMIT: 'off' }).stripe.accountRateLimit).toBeUndefined();
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x', STRIPE_ACCOUNT_RATE_LIMIT: '40' }).stripe.accountRateLimit).toBe(40);
    expect(loadConfig({ STRIPE_SECRET_KEY: 'sk_live_x', STRIPE_ACCOUNT_RATE_LIMIT: '100' }).stripe.accountRateLimit).toBeUndefined();
    // The emulator documents none: STRIPE_RATE_LIMIT's, and none without it unless told.
    expect(loadConfig({ STRIPE_RATE_LIMIT: '25' }).stripe.accountRateLimit).toBeUndefined();
    expect(loadConfig({}).stripe.accountRateLimit).toBeUndefined();
    expect(loadConfig({ STRIPE_ACCOUNT_RATE_LIMIT: '5' }).stripe).toMatchObject({ rateLimit: undefined, accountRateLimit: 5 });
    expect(() => loadConfig({ STRIPE_ACCOUNT_RATE_LIMIT: 'fast' })).toThrow(/STRIPE_ACCOUNT_RATE_LIMIT: a number of requests per second, or off/);
  });
});

describe('tracing: the standard OTEL_ variables, read here and nowhere else in outboxd', () => {
  it('is off without an endpoint, or when the SDK is disabled', () => {
    expect(loadConfig({}).tracing).toBeUndefined();
    expect(loadConfig({ OTEL_SERVICE_NAME: 'x', OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json' }).tracing).toBeUndefined();
    expect(loadConfig({ OTEL_EXPORTER_OTLP_ENDPOINT: 'http://collector:4318', OTEL_SDK_DISABLED: 'true' }).tracing).toBeUndefined();
  });

  it('sends to <endpoint>/v1/traces over http/protobuf unless told otherwise', () => {
    expect(loadConfig({ OTEL_EXPORTER_OTLP_ENDPOINT: 'http://collector:4318/' }).tracing).toEqual({
      url: 'http://collector:4318/v1/traces',
      protocol: 'http/protobuf',
      serviceName: 'outboxd',
      sampler: 'parentbased_always_on',
      samplerRatio: 1,
    });
    const tracing = loadConfig({
      OTEL_EXPORTER_OTLP_ENDPOINT: 'http://collector:4318',
      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'https://traces.example/otlp',
      OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json',
      OTEL_SERVICE_NAME: 'payments-worker',
      OTEL_TRACES_SAMPLER: 'parentbased_traceidratio',
      OTEL_TRACES_SAMPLER_ARG: '0.25',
    }).tracing;
    expect(tracing).toEqual({ url: 'https://traces.example/otlp', protocol: 'http/json', serviceName: 'payments-worker', sampler: 'parentbased_traceidratio', samplerRatio: 0.25 });
  });

  it('refuses what it cannot honour, naming the variable', () => {
    expect(() => loadConfig({ OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc' })).toThrow(/OTEL_EXPORTER_OTLP_PROTOCOL: only http\/protobuf and http\/json/);
    expect(() => loadConfig({ OTEL_TRACES_SAMPLER: 'sometimes' })).toThrow(/OTEL_TRACES_SAMPLER/);
    expect(() => loadConfig({ OTEL_TRACES_SAMPLER_ARG: '2' })).toThrow(/OTEL_TRACES_SAMPLER_ARG/);
    expect(() => loadConfig({ OTEL_EXPORTER_OTLP_ENDPOINT: 'collector:4318' })).toThrow(/OTEL_EXPORTER_OTLP_ENDPOINT/);
  });
});
