// The emulator on its own, through the real stripe SDK over HTTP.
import { randomUUID } from 'node:crypto';
import Stripe from 'stripe';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { startEmulator, type RunningEmulator } from './support/emulator.ts';

let e: RunningEmulator;
let stripe: Stripe;
beforeAll(async () => {
  e = await startEmulator();
  stripe = e.client();
});
afterAll(() => e.close());
beforeEach(() => e.emulator.reset());

const params = (over: Partial<Stripe.PaymentIntentCreateParams> = {}): Stripe.PaymentIntentCreateParams => ({
  amount: 1000,
  currency: 'eur',
  customer: 'cus_1',
  payment_method: 'pm_card_visa',
  confirm: true,
  off_session: true,
  metadata: { operation_id: randomUUID() },
  ...over,
});

describe('PaymentIntents', () => {
  it('creates a succeeded PaymentIntent with nested metadata and retrieves it', async () => {
    const p = params();
    const pi = await stripe.paymentIntents.create(p, { idempotencyKey: 'k1' });
    expect(pi).toMatchObject({ object: 'payment_intent', status: 'succeeded', amount: 1000, currency: 'eur', metadata: p.metadata });
    expect(pi.lastResponse.requestId).toMatch(/^req_/);
    expect((await stripe.paymentIntents.retrieve(pi.id)).id).toBe(pi.id);
  });

  it('401 without a test secret key', async () => {
    const bad = new Stripe('rk_live_nope', { host: new URL(e.url).hostname, port: Number(new URL(e.url).port), protocol: 'http' });
    await expect(bad.paymentIntents.create(params())).rejects.toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
    expect(e.emulator.ledger()).toHaveLength(0);
  });

  it.each([
    ['pm_card_chargeDeclined', 'card_declined', 'generic_decline'],
    ['pm_card_chargeDeclinedInsufficientFunds', 'card_declined', 'insufficient_funds'],
    ['pm_card_authenticationRequired', 'authentication_required', undefined],
  ])('%s → 402 %s with the PaymentIntent in requires_payment_method', async (pm, code, decline) => {
    const err = (await stripe.paymentIntents.create(params({ payment_method: pm })).catch((x) => x)) as Stripe.errors.StripeCardError;
    expect(err).toBeInstanceOf(Stripe.errors.StripeCardError);
    expect(err.statusCode).toBe(402);
    expect(err.code).toBe(code);
    if (decline) expect(err.decline_code).toBe(decline);
    expect((err.payment_intent as Stripe.PaymentIntent).status).toBe('requires_payment_method');
  });

  it('pm_card_processing stays processing until settled', async () => {
    const pi = await stripe.paymentIntents.create(params({ payment_method: 'pm_card_processing' }));
    expect(pi.status).toBe('processing');
    e.emulator.settle(pi.id, 'succeeded');
    expect((await stripe.paymentIntents.retrieve(pi.id)).status).toBe('succeeded');
  });

  it('400 with the param named for invalid input, and nothing stored for the key', async () => {
    const err = (await stripe.paymentIntents.create(params({ amount: -1 }), { idempotencyKey: 'kv' }).catch((x) => x)) as Stripe.errors.StripeError;
    expect(err).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
    expect(err.param).toBe('amount');
    const ok = await stripe.paymentIntents.create(params({ amount: 5 }), { idempotencyKey: 'kv' });
    expect(ok.amount).toBe(5);
  });
});

describe('idempotency layer', () => {
  it('replays the first result byte for byte with Idempotent-Replayed', async () => {
    const p = params();
    const first = await stripe.paymentIntents.create(p, { idempotencyKey: 'same' });
    const second = await stripe.paymentIntents.create(p, { idempotencyKey: 'same' });
    expect(second.id).toBe(first.id);
    expect(second.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it('the same key with other parameters → 400 idempotency_error', async () => {
    const p = params();
    await stripe.paymentIntents.create(p, { idempotencyKey: 'k2' });
    const err = await stripe.paymentIntents.create({ ...p, amount: 2000 }, { idempotencyKey: 'k2' }).catch((x) => x);
    expect(err).toBeInstanceOf(Stripe.errors.StripeIdempotencyError);
    expect(err.statusCode).toBe(400);
  });

  it('the same key while its first request still executes → 409 idempotency_key_in_use (a StripeAPIError)', async () => {
    e.emulator.addFault({ fault: { kind: 'latency', ms: 300 } });
    const p = params();
    const first = stripe.paymentIntents.create(p, { idempotencyKey: 'k3' });
    await new Promise((r) => setTimeout(r, 50));
    const err = await stripe.paymentIntents.create(p, { idempotencyKey: 'k3' }).catch((x) => x);
    expect(err).toBeInstanceOf(Stripe.errors.StripeAPIError);
    expect(err.statusCode).toBe(409);
    expect(err.code).toBe('idempotency_key_in_use');
    await first;
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it('a key longer than 255 characters → 400', async () => {
    const err = await stripe.paymentIntents.create(params(), { idempotencyKey: 'k'.repeat(256) }).catch((x) => x);
    expect(err.statusCode).toBe(400);
    expect(e.emulator.ledger()).toHaveLength(0);
  });

  it('a 500 after commit is stored and replayed: the charge exists, every retry sees the 500', async () => {
    const p = params();
    e.emulator.addFault({ fault: { kind: 'error_after_commit', status: 500 } });
    for (let i = 0; i < 2; i++) {
      const err = await stripe.paymentIntents.create(p, { idempotencyKey: 'k5' }).catch((x) => x);
      expect(err).toBeInstanceOf(Stripe.errors.StripeAPIError);
      expect(err.statusCode).toBe(500);
    }
    expect(e.emulator.requests().map((r) => r.replayed)).toEqual([false, true]);
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it('an error before commit and a 429 store nothing: the next request with the key executes', async () => {
    const p = params();
    e.emulator.addFault({ fault: { kind: 'rate_limit' } });
    await expect(stripe.paymentIntents.create(p, { idempotencyKey: 'k6' })).rejects.toBeInstanceOf(Stripe.errors.StripeRateLimitError);
    e.emulator.addFault({ fault: { kind: 'error_before_commit', status: 503 } });
    await expect(stripe.paymentIntents.create(p, { idempotencyKey: 'k6' })).rejects.toMatchObject({ statusCode: 503 });
    expect(e.emulator.ledger()).toHaveLength(0);
    expect((await stripe.paymentIntents.create(p, { idempotencyKey: 'k6' })).status).toBe('succeeded');
  });

  it('keys expire after the retention on the emulator clock; a pruned key runs a new request', async () => {
    const p = params();
    await stripe.paymentIntents.create(p, { idempotencyKey: 'k7' });
    e.emulator.advanceClock(23 * 3600_000);
    await stripe.paymentIntents.create(p, { idempotencyKey: 'k7' });
    expect(e.emulator.ledger()).toHaveLength(1);
    e.emulator.advanceClock(3600_000);
    await stripe.paymentIntents.create(p, { idempotencyKey: 'k7' });
    expect(e.emulator.ledger()).toHaveLength(2);
    e.emulator.pruneKeys();
    await stripe.paymentIntents.create(p, { idempotencyKey: 'k7' });
    expect(e.emulator.ledger()).toHaveLength(3);
  });
});

describe('lost responses (after the charge committed)', () => {
  it('truncate: a body cut off after the headers is a StripeConnectionError, never retried', async () => {
    e.emulator.addFault({ fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    const err = await e.client({ maxNetworkRetries: 2 }).paymentIntents.create(params(), { idempotencyKey: 'k8' }).catch((x) => x);
    expect(err).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(e.emulator.requests()).toHaveLength(1);
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it('reset: the SDK resends once even with retries off, with the same key, and gets the replay', async () => {
    e.emulator.addFault({ fault: { kind: 'lose_response_after_commit', mode: 'reset' } });
    const pi = await stripe.paymentIntents.create(params(), { idempotencyKey: 'k9' });
    expect(pi.status).toBe('succeeded');
    expect(e.emulator.requests().map((r) => [r.idempotencyKey, r.status, r.replayed])).toEqual([
      ['k9', 'reset', false],
      ['k9', 200, true],
    ]);
  });

  it('hang: the client times out', async () => {
    e.emulator.addFault({ fault: { kind: 'lose_response_after_commit', mode: 'hang' } });
    const err = await e.client({ timeoutMs: 300 }).paymentIntents.create(params(), { idempotencyKey: 'k10' }).catch((x) => x);
    expect(err).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it('faults match by operation id and count down', async () => {
    const target = params();
    e.emulator.addFault({ match: { operationId: target.metadata!.operation_id as string }, fault: { kind: 'rate_limit' }, count: 2 });
    await expect(stripe.paymentIntents.create(params())).resolves.toBeTruthy();
    await expect(stripe.paymentIntents.create(target)).rejects.toMatchObject({ statusCode: 429 });
    await expect(stripe.paymentIntents.create(target)).rejects.toMatchObject({ statusCode: 429 });
    await expect(stripe.paymentIntents.create(target)).resolves.toBeTruthy();
  });
});

describe('search', () => {
  const byOp = (op: string) => `metadata['operation_id']:'${op}'`;

  it('finds by metadata and status, in the search_result envelope', async () => {
    const p = params();
    const pi = await stripe.paymentIntents.create(p);
    const res = await stripe.paymentIntents.search({ query: `${byOp(p.metadata!.operation_id as string)} AND status:'succeeded'` });
    expect(res).toMatchObject({ object: 'search_result', has_more: false, next_page: null });
    expect(res.data.map((d) => d.id)).toEqual([pi.id]);
    const none = await stripe.paymentIntents.search({ query: `${byOp(p.metadata!.operation_id as string)} AND status:'canceled'` });
    expect(none.data).toHaveLength(0);
  });

  it('is not read-after-write: a write is searchable only after the lag; an outage freezes indexing', async () => {
    e.emulator.configureSearch({ lagMs: 60_000 });
    const p = params();
    await stripe.paymentIntents.create(p);
    const q = { query: byOp(p.metadata!.operation_id as string) };
    expect((await stripe.paymentIntents.search(q)).data).toHaveLength(0);
    e.emulator.configureSearch({ frozen: true });
    e.emulator.advanceClock(61_000);
    expect((await stripe.paymentIntents.search(q)).data).toHaveLength(0);
    e.emulator.configureSearch({ frozen: false });
    expect((await stripe.paymentIntents.search(q)).data).toHaveLength(1);
    e.emulator.configureSearch({ lagMs: 0 });
  });

  it('pages with next_page', async () => {
    const op = randomUUID();
    for (let i = 0; i < 5; i++) await stripe.paymentIntents.create(params({ metadata: { operation_id: op } }));
    const seen: string[] = [];
    let page: string | undefined;
    do {
      const res = await stripe.paymentIntents.search({ query: byOp(op), limit: 2, ...(page ? { page } : {}) });
      seen.push(...res.data.map((d) => d.id));
      page = res.next_page ?? undefined;
    } while (page);
    expect(new Set(seen).size).toBe(5);
  });

  it('an unsupported query is a 400', async () => {
    await expect(stripe.paymentIntents.search({ query: 'nonsense' })).rejects.toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
  });
});

describe('control API over HTTP', () => {
  it('adds faults, advances the clock and reads the ledger', async () => {
    const post = (path: string, body: unknown) =>
      fetch(`${e.url}/_emulator/${path}`, { method: 'POST', body: JSON.stringify(body) }).then((r) => r.json());
    await post('faults', { fault: { kind: 'rate_limit' } });
    await expect(stripe.paymentIntents.create(params())).rejects.toMatchObject({ statusCode: 429 });
    await stripe.paymentIntents.create(params({ payment_method: 'pm_card_processing' }));
    const ledger = (await fetch(`${e.url}/_emulator/ledger`).then((r) => r.json())) as { paymentIntent: { id: string } }[];
    expect(ledger).toHaveLength(1);
    await post(`payment_intents/${ledger[0]!.paymentIntent.id}/settle`, { status: 'succeeded' });
    expect((await stripe.paymentIntents.retrieve(ledger[0]!.paymentIntent.id)).status).toBe('succeeded');
  });
});
