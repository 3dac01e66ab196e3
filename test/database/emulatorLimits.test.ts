// The emulator's answers for Stripe's 429s: an account-wide rate limiter (requests/s across all its
// requests, in memory and shared through PostgreSQL by every process serving that state), and the
// rate_limit fault's two codes, rate_limit and lock_timeout, as the SDK and our gateway see them. A
// request on a connected account (Stripe-Account) counts against the platform and the account both.
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { RetryLater } from '../../src/stripe/gateway.ts';
import { serveEmulator, type ServedEmulator } from '../../src/runtime/open.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';

/** `n` requests at once (retrieves of a charge that does not exist: 404 when admitted); their statuses and codes. */
async function burst(urls: string[], n: number, account?: string): Promise<{ status: number; code: string | undefined }[]> {
  return Promise.all(
    Array.from({ length: n }, async (_, i) => {
      const headers: Record<string, string> = { Authorization: `Bearer ${TEST_KEY}`, ...(account ? { 'Stripe-Account': account } : {}) };
      const res = await fetch(`${urls[i % urls.length]}/v1/payment_intents/pi_nothing${i}`, { headers });
      const body = (await res.json()) as { error?: { code?: string } };
      return { status: res.status, code: body.error?.code };
    }),
  );
}
const control = (url: string, path: string, body: unknown = {}) =>
  fetch(`${url}/_emulator/${path}`, { method: 'POST', body: JSON.stringify(body) }).then(async (r) => ({ status: r.status, body: await r.json() }));

/** Admitted requests of a burst: the bucket's second's worth, plus what refilled meanwhile. */
function expectLimited(answers: { status: number; code: string | undefined }[], perSecond: number, elapsedMs: number, refillPerSecond = perSecond) {
  const admitted = answers.filter((a) => a.status === 404).length;
  expect(admitted).toBeGreaterThanOrEqual(perSecond);
  expect(admitted).toBeLessThanOrEqual(perSecond + Math.ceil((refillPerSecond * elapsedMs) / 1000));
  const limited = answers.filter((a) => a.status === 429);
  expect(limited.length).toBe(answers.length - admitted);
  for (const a of limited) expect(a.code).toBe('rate_limit');
}

describe('in memory', () => {
  let e: RunningEmulator;
  beforeAll(async () => {
    e = await startEmulator({ rateLimit: 5 });
  });
  afterAll(() => e.close());

  it('answers 429 rate_limit beyond N requests/s across all requests, set and unset through the control API', async () => {
    let started = performance.now();
    expectLimited(await burst([e.url], 15), 5, performance.now() - started);
    expect(e.emulator.requests().filter((r) => r.status === 429).length).toBeGreaterThan(0);

    expect((await control(e.url, 'rate-limit', { requestsPerSecond: null })).status).toBe(200);
    expect((await burst([e.url], 15)).every((a) => a.status === 404)).toBe(true);

    expect((await control(e.url, 'rate-limit', { requestsPerSecond: 3 })).status).toBe(200);
    started = performance.now();
    expectLimited(await burst([e.url], 10), 3, performance.now() - started);
    expect((await control(e.url, 'rate-limit', { requestsPerSecond: -1 })).status).toBe(400);
    expect((await control(e.url, 'rate-limit', { requestsPerSecond: 'fast' })).status).toBe(400);

    // A reset is a new emulator: with the limit it was started with.
    e.emulator.reset();
    started = performance.now();
    expectLimited(await burst([e.url], 12), 5, performance.now() - started);
    e.emulator.setRateLimit(null);
  });

  it("a connected account's requests take from its own limit and the platform's: one busy account leaves the others theirs", async () => {
    await checkAccounts([e.url], (body) => control(e.url, 'rate-limit', body));
    expect((await control(e.url, 'rate-limit', { requestsPerSecond: 5, accountRequestsPerSecond: 0 })).body).toEqual({ error: 'accountRequestsPerSecond must be a number > 0, or null (no limit)' });
    e.emulator.setRateLimit(null);
  });

  it('a rate_limit fault answers 429 with the code it names: the gateway reports it as RetryLater with that code', async () => {
    e.emulator.setRateLimit(null);
    const operationId = randomUUID();
    const req = { operationId, amount: 1000, currency: 'eur', customer: 'cus_x', paymentMethod: 'pm_card_visa', metadata: {}, idempotencyKey: `payment-op:${operationId}` };
    e.emulator.addFault({ fault: { kind: 'rate_limit', code: 'lock_timeout' }, match: { operationId } });
    e.emulator.addFault({ fault: { kind: 'rate_limit' }, match: { operationId } });
    const gateway = e.gateway();
    const first = await gateway.createCharge(req).catch((err: unknown) => err);
    expect(first).toBeInstanceOf(RetryLater);
    expect(first).toMatchObject({ code: 'lock_timeout', httpStatus: 429 });
    await expect(gateway.createCharge(req)).rejects.toMatchObject({ code: 'rate_limit', httpStatus: 429 });
    await expect(gateway.createCharge(req)).resolves.toMatchObject({ status: 'succeeded' });
    expect(e.emulator.ledger()).toHaveLength(1);
    expect((await control(e.url, 'faults', { fault: { kind: 'rate_limit', code: 'too_fast' } })).body).toEqual({ error: 'fault.code must be one of rate_limit, lock_timeout' });
  });
});

describe('in PostgreSQL: one limit for every process serving the state', () => {
  let t: TestDb;
  const served: ServedEmulator[] = [];
  beforeAll(async () => {
    t = await createTestDatabase();
  });
  afterAll(async () => {
    for (const s of served.splice(0)) await s.close();
    await t.close();
  });
  const serve = async () => {
    const s = await serveEmulator({ url: t.url, schema: 'outboxd', embedded: true, close: async () => {} });
    served.push(s);
    return s.url;
  };

  it('N requests/s across two processes together, set through either; a reset turns it off', async () => {
    const [a, b] = [await serve(), await serve()];
    expect((await control(a, 'rate-limit', { requestsPerSecond: 6 })).status).toBe(200);
    const started = performance.now();
    expectLimited(await burst([a, b], 18), 6, performance.now() - started);
    expect((await control(b, 'reset')).status).toBe(200);
    expect((await burst([a, b], 18)).every((x) => x.status === 404)).toBe(true);
  });

  it("a connected account's limit across two processes, beside the platform's", async () => {
    const [a, b] = [await serve(), await serve()];
    await checkAccounts([a, b], (body) => control(a, 'rate-limit', body));
    await control(b, 'reset');
  });
});

/** Platform 20/s, each account 4/s: a burst on one account gets its 4, then another account gets its own 4,
 * and the platform what is left of its 20 (8 were taken by the accounts). */
async function checkAccounts(urls: string[], limit: (body: unknown) => Promise<unknown>) {
  await limit({ requestsPerSecond: 20, accountRequestsPerSecond: 4 });
  const started = performance.now();
  expectLimited(await burst(urls, 12, 'acct_busy'), 4, performance.now() - started);
  expectLimited(await burst(urls, 12, 'acct_other'), 4, performance.now() - started);
  expectLimited(await burst(urls, 20, undefined), 12, performance.now() - started, 20);
}
