// The emulator on its own, through the real stripe SDK over HTTP: in memory (the handle tests drive)
// and in PostgreSQL (the runtime's: one ledger per data directory, shared by every process on it).
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import Stripe from 'stripe';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { loadConfig } from '../../src/runtime/config.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { openGateway, serveEmulator, type ServedEmulator } from '../../src/runtime/open.ts';
import { PgState } from '../../src/emulator/index.ts';
import { stripeClient } from '../../src/stripe/sdkGateway.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';

let e: RunningEmulator;
/** Until this emulator has a request under `key`: logged as it arrives, its key claimed in the same turn. */
const arrived = (key: string) => waitUntil(() => e.emulator.requests().some((r) => r.idempotencyKey === key), 10_000, `a request under ${key}`);
let stripe: Stripe;
beforeAll(async () => {
  e = await startEmulator();
  stripe = e.client({ timeoutMs: 10_000 }); // outlasts the latency faults that hold a key mid-request
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

  it("an unknown payment method is refused as Stripe refuses it (400 resource_missing), and nothing is stored for the key", async () => {
    const err = (await stripe.paymentIntents.create(params({ payment_method: 'pm_card_typo' }), { idempotencyKey: 'kpm' }).catch((x) => x)) as Stripe.errors.StripeError;
    expect(err).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
    expect(err).toMatchObject({ statusCode: 400, code: 'resource_missing', param: 'payment_method', message: "No such PaymentMethod: 'pm_card_typo'" });
    expect(e.emulator.ledger()).toHaveLength(0);
    const ok = await stripe.paymentIntents.create(params({ payment_method: 'pm_card_mastercard' }), { idempotencyKey: 'kpm' });
    expect(ok.status).toBe('succeeded');
  });

  it('takes the key as HTTP Basic auth too, as the real API does (curl -u sk_test_…:)', async () => {
    const basic = (user: string) => ({ Authorization: `Basic ${Buffer.from(`${user}:`).toString('base64')}` });
    const pi = await stripe.paymentIntents.create(params());
    const res = await fetch(`${e.url}/v1/payment_intents/${pi.id}`, { headers: basic(TEST_KEY) });
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ id: pi.id });
    expect((await fetch(`${e.url}/v1/payment_intents/${pi.id}`, { headers: basic('sk_live_nope') })).status).toBe(401);
    expect((await fetch(`${e.url}/v1/payment_intents/${pi.id}`)).status).toBe(401);
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
    e.emulator.addFault({ fault: { kind: 'latency', ms: 2_000 } });
    const p = params();
    const first = stripe.paymentIntents.create(p, { idempotencyKey: 'k3' });
    await arrived('k3');
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

describe('refunds', () => {
  const paid = async (amount = 1000) => stripe.paymentIntents.create(params({ amount }));
  const refund = (pi: string, over: Partial<Stripe.RefundCreateParams> = {}, key?: string) =>
    stripe.refunds.create({ payment_intent: pi, amount: 400, reason: 'requested_by_customer', metadata: { operation_id: randomUUID() }, ...over }, key ? { idempotencyKey: key } : {});

  it('refunds a succeeded PaymentIntent, retrieves the refund and lists the PaymentIntent’s refunds', async () => {
    const pi = await paid();
    const first = await refund(pi.id, { amount: 300 });
    expect(first).toMatchObject({ object: 'refund', status: 'succeeded', amount: 300, currency: 'eur', payment_intent: pi.id, reason: 'requested_by_customer' });
    const second = await refund(pi.id, { amount: 200 });
    expect((await stripe.refunds.retrieve(first.id)).metadata).toEqual(first.metadata);
    expect((await stripe.refunds.list({ payment_intent: pi.id })).data.map((r) => r.id).sort()).toEqual([first.id, second.id].sort());
    expect((await stripe.refunds.list({ payment_intent: (await paid()).id })).data).toEqual([]);
    await expect(stripe.refunds.retrieve('re_missing')).rejects.toMatchObject({ statusCode: 404, code: 'resource_missing' });
  });

  it('refuses more than remains unrefunded (failed refunds give theirs back), and a PaymentIntent that has not succeeded; nothing stored under the key', async () => {
    const pi = await paid(1000);
    const a = await refund(pi.id, { amount: 700 });
    await expect(refund(pi.id, { amount: 301 }, 'rk-1')).rejects.toMatchObject({ statusCode: 400, code: 'amount_too_large' });
    e.emulator.settleRefund(a.id, 'failed');
    expect((await refund(pi.id, { amount: 1000 }, 'rk-1')).status).toBe('succeeded'); // the key was free
    await expect(refund(pi.id, { amount: 1 })).rejects.toMatchObject({ code: 'charge_already_refunded' });
    const processing = await stripe.paymentIntents.create(params({ payment_method: 'pm_card_processing' }));
    await expect(refund(processing.id)).rejects.toMatchObject({ statusCode: 400, code: 'charge_not_refundable' });
    await expect(refund('pi_missing')).rejects.toMatchObject({ code: 'resource_missing' });
    await expect(refund(pi.id, { reason: 'whim' as never })).rejects.toMatchObject({ statusCode: 400, param: 'reason' });
  });

  it('the idempotency layer: a replay, 400 for other parameters or a charge’s key, 409 while executing', async () => {
    const pi = await paid();
    const p = { amount: 100, metadata: { operation_id: 'op-r' } };
    const first = await refund(pi.id, p, 'refund-op:r');
    const replay = await refund(pi.id, p, 'refund-op:r');
    expect(replay.id).toBe(first.id);
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');
    await expect(refund(pi.id, { ...p, amount: 101 }, 'refund-op:r')).rejects.toBeInstanceOf(Stripe.errors.StripeIdempotencyError);
    await stripe.paymentIntents.create(params(), { idempotencyKey: 'shared-key' });
    await expect(refund(pi.id, p, 'shared-key')).rejects.toBeInstanceOf(Stripe.errors.StripeIdempotencyError);
    e.emulator.addFault({ endpoint: 'create_refund', fault: { kind: 'latency', ms: 2_000 } });
    const slow = refund(pi.id, { ...p, amount: 5 }, 'refund-op:slow');
    await arrived('refund-op:slow');
    await expect(refund(pi.id, { ...p, amount: 5 }, 'refund-op:slow')).rejects.toMatchObject({ statusCode: 409 });
    await slow;
    expect(e.emulator.refundLedger().filter((r) => r.refund.payment_intent === pi.id)).toHaveLength(2);
  });

  it('faults on refund endpoints: a lost response after commit, a stored 500, a refund status, a 429 on the list', async () => {
    const pi = await paid(10_000);
    const op = randomUUID();
    e.emulator.addFault({ endpoint: 'create_refund', match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    await expect(refund(pi.id, { metadata: { operation_id: op } }, 'lost')).rejects.toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(e.emulator.refundLedger().filter((r) => r.refund.metadata.operation_id === op)).toHaveLength(1);
    expect((await refund(pi.id, { metadata: { operation_id: op } }, 'lost')).lastResponse.headers['idempotent-replayed']).toBe('true');

    e.emulator.addFault({ endpoint: 'create_refund', fault: { kind: 'error_after_commit', status: 500 } });
    const stored = { metadata: { operation_id: 'op-500' } };
    await expect(refund(pi.id, stored, 'stored-500')).rejects.toMatchObject({ statusCode: 500 });
    await expect(refund(pi.id, stored, 'stored-500')).rejects.toMatchObject({ statusCode: 500 });
    expect(e.emulator.refundLedger().filter((r) => r.refund.metadata.operation_id === 'op-500')).toHaveLength(1);

    e.emulator.addFault({ fault: { kind: 'refund_status', status: 'pending' } }); // create_refund by default
    const pending = await refund(pi.id);
    expect(pending.status).toBe('pending');
    expect((await stripe.refunds.retrieve(pending.id)).status).toBe('pending');
    expect(e.emulator.settleRefund(pending.id, 'succeeded').status).toBe('succeeded');

    e.emulator.addFault({ endpoint: 'list_refunds', fault: { kind: 'rate_limit' } });
    await expect(stripe.refunds.list({ payment_intent: pi.id })).rejects.toMatchObject({ statusCode: 429 });
    expect(e.emulator.requests().map((r) => r.endpoint)).toEqual(expect.arrayContaining(['create_refund', 'retrieve_refund', 'list_refunds']));
  });

  it('pending refunds succeed by themselves after processingSettleMs', async () => {
    const own = await startEmulator({ processingSettleMs: 200 });
    try {
      const client = own.client();
      const pi = await client.paymentIntents.create(params());
      own.emulator.addFault({ fault: { kind: 'refund_status', status: 'pending' } });
      const pending = await client.refunds.create({ payment_intent: pi.id, amount: 10 });
      expect(pending.status).toBe('pending');
      own.emulator.advanceClock(200);
      expect((await client.refunds.retrieve(pending.id)).status).toBe('succeeded');
    } finally {
      await own.close();
    }
  });

  it('a processing payment finishes by itself after processingSettleMs: succeeded, or held when it is an authorization', async () => {
    const own = await startEmulator({ processingSettleMs: 200 });
    try {
      const client = own.client();
      const automatic = await client.paymentIntents.create(params({ payment_method: 'pm_card_processing' }));
      const manual = await client.paymentIntents.create(params({ payment_method: 'pm_card_processing', capture_method: 'manual' }));
      expect([automatic.status, manual.status]).toEqual(['processing', 'processing']);
      own.emulator.advanceClock(200);
      expect(await client.paymentIntents.retrieve(automatic.id)).toMatchObject({ status: 'succeeded', amount_received: automatic.amount });
      expect(await client.paymentIntents.retrieve(manual.id)).toMatchObject({ status: 'requires_capture', amount_received: 0, amount_capturable: manual.amount });
    } finally {
      await own.close();
    }
  });

  it('the control API: GET /_emulator/refunds, settle a refund, and refund.* events to the webhook target', async () => {
    const pi = await paid();
    const r = await refund(pi.id);
    const settled = await fetch(`${e.url}/_emulator/refunds/${r.id}/settle`, { method: 'POST', body: JSON.stringify({ status: 'canceled' }) }).then((x) => x.json());
    expect(settled).toMatchObject({ id: r.id, status: 'canceled' });
    const listed = (await fetch(`${e.url}/_emulator/refunds`).then((x) => x.json())) as { refund: { id: string; status: string } }[];
    expect(listed.map((x) => [x.refund.id, x.refund.status])).toEqual([[r.id, 'canceled']]);
    const bad = await fetch(`${e.url}/_emulator/refunds/${r.id}/settle`, { method: 'POST', body: JSON.stringify({ status: 'done' }) });
    expect(bad.status).toBe(400);
    e.emulator.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    e.emulator.settleRefund(r.id, 'failed');
    await refund(pi.id, { amount: 1 });
    expect(e.emulator.emittedEvents().map((ev) => [ev.type, ev.data.object.object])).toEqual([['refund.failed', 'refund'], ['refund.created', 'refund']]);
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

describe('control API input', () => {
  it('refuses malformed bodies with a 400 that says why, changing nothing', async () => {
    const post = (path: string, body: string) => fetch(`${e.url}/_emulator/${path}`, { method: 'POST', body });
    for (const [path, body] of [
      ['clock/advance', '{"ms":"soon"}'],
      ['faults', '{"fault":{"kind":"explode"}}'],
      ['faults', '{"fault":{"kind":"rate_limit"},"count":0}'],
      ['search', '{"frozen":"yes"}'],
      ['reset', 'not json'],
    ]) {
      const res = await post(path!, body!);
      expect(res.status, `${path} ${body}`).toBe(400);
      expect(await res.json()).toHaveProperty('error');
    }
    expect(e.emulator.now() - Date.now()).toBeLessThan(1_000);
    await expect(stripe.paymentIntents.create(params())).resolves.toMatchObject({ status: 'succeeded' });
    const settle = await post('payment_intents/pi_missing/settle', '{"status":"succeeded"}');
    expect(settle.status).toBe(400);
  });
});

describe('in PostgreSQL: one emulator for every process on a data directory', () => {
  let t: TestDb;
  const served: ServedEmulator[] = [];
  const log = createLogger('silent');
  /** An emulator served the way each outboxd process on the embedded default serves it. */
  const serve = async () => {
    const s = await serveEmulator({ url: t.url, schema: 'outboxd', embedded: true, close: async () => {} });
    served.push(s);
    return { url: s.url, stripe: stripeClient({ secretKey: TEST_KEY, apiBase: s.url, timeoutMs: 10_000 }) };
  };
  const control = (url: string, path: string, body: unknown = {}) =>
    fetch(`${url}/_emulator/${path}`, { method: 'POST', body: JSON.stringify(body) }).then(async (r) => ({ status: r.status, body: await r.json() }));
  const ledger = async (url: string) => (await (await fetch(`${url}/_emulator/ledger`)).json()) as { paymentIntent: Stripe.PaymentIntent }[];

  beforeAll(async () => {
    t = await createTestDatabase();
  });
  afterAll(async () => {
    for (const s of served.splice(0)) await s.close();
    await t.close();
  });
  beforeEach(async () => {
    await control((await serve()).url, 'reset');
  });

  it('a charge made through one process is retrieved, listed and searched through another, and replayed under its key', async () => {
    const [a, b] = [await serve(), await serve()];
    const p = params();
    const pi = await a.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k1' });
    expect((await b.stripe.paymentIntents.retrieve(pi.id)).metadata).toEqual(p.metadata);
    expect((await b.stripe.paymentIntents.list({ limit: 10 })).data.map((x) => x.id)).toEqual([pi.id]);
    expect((await b.stripe.paymentIntents.search({ query: `metadata['operation_id']:'${p.metadata!.operation_id}'` })).data.map((x) => x.id)).toEqual([pi.id]);
    const replay = await b.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k1' });
    expect(replay.id).toBe(pi.id);
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');
    await expect(b.stripe.paymentIntents.create({ ...p, amount: 5 }, { idempotencyKey: 'pg-k1' })).rejects.toBeInstanceOf(Stripe.errors.StripeIdempotencyError);
    expect(await ledger(b.url)).toHaveLength(1);
  });

  it('a key still executing in one process is a 409 in another; faults and the clock are shared', async () => {
    const [a, b] = [await serve(), await serve()];
    expect((await control(b.url, 'faults', { fault: { kind: 'latency', ms: 5_000 } })).status).toBe(200);
    const p = params();
    const first = a.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k2' });
    await new Promise((r) => setTimeout(r, 1_500)); // its key claimed (a commit in another process)
    const err = await b.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k2' }).catch((x) => x);
    expect(err).toMatchObject({ statusCode: 409, code: 'idempotency_key_in_use' });
    await first;
    await control(a.url, 'faults', { fault: { kind: 'rate_limit' }, count: 1 });
    await expect(b.stripe.paymentIntents.create(params())).rejects.toMatchObject({ statusCode: 429 });
    await expect(a.stripe.paymentIntents.create(params())).resolves.toMatchObject({ status: 'succeeded' }); // used up once
    // Keys expire on the shared clock: advanced through one process, expired in the other.
    await control(a.url, 'clock/advance', { ms: 25 * 3600_000 });
    expect((await b.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k2' })).lastResponse.headers['idempotent-replayed']).toBeUndefined();
    expect((await ledger(a.url)).filter((l) => l.paymentIntent.metadata.operation_id === p.metadata!.operation_id)).toHaveLength(2);
  });

  it('refunds are shared too: one process refunds, another retrieves, lists, replays and refuses more than remains', async () => {
    const [a, b] = [await serve(), await serve()];
    const pi = await a.stripe.paymentIntents.create(params({ amount: 500 }));
    const r = await a.stripe.refunds.create({ payment_intent: pi.id, amount: 300, metadata: { operation_id: 'op-pg' } }, { idempotencyKey: 'refund-op:pg' });
    expect((await b.stripe.refunds.retrieve(r.id)).metadata).toEqual({ operation_id: 'op-pg' });
    expect((await b.stripe.refunds.list({ payment_intent: pi.id })).data.map((x) => x.id)).toEqual([r.id]);
    const replay = await b.stripe.refunds.create({ payment_intent: pi.id, amount: 300, metadata: { operation_id: 'op-pg' } }, { idempotencyKey: 'refund-op:pg' });
    expect(replay.id).toBe(r.id);
    await expect(b.stripe.refunds.create({ payment_intent: pi.id, amount: 201 })).rejects.toMatchObject({ code: 'amount_too_large' });
    await control(a.url, 'faults', { fault: { kind: 'refund_status', status: 'pending' } });
    const pending = await b.stripe.refunds.create({ payment_intent: pi.id, amount: 200 });
    expect(pending.status).toBe('pending');
    expect((await control(a.url, `refunds/${pending.id}/settle`, { status: 'succeeded' })).body).toMatchObject({ status: 'succeeded' });
    const refunds = (await (await fetch(`${b.url}/_emulator/refunds`)).json()) as { refund: { id: string; status: string } }[];
    expect(refunds.map((x) => [x.refund.id, x.refund.status])).toEqual([[r.id, 'succeeded'], [pending.id, 'succeeded']]);
  });

  it('survives its processes: a new one serves the same ledger and keys', async () => {
    const a = await serve();
    const p = params({ payment_method: 'pm_card_processing' });
    const pi = await a.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k3' });
    for (const s of served.splice(0)) await s.close();
    const c = await serve();
    expect((await c.stripe.paymentIntents.retrieve(pi.id)).status).toBe('processing');
    expect((await c.stripe.paymentIntents.create(p, { idempotencyKey: 'pg-k3' })).id).toBe(pi.id);
    expect((await control(c.url, `payment_intents/${pi.id}/settle`, { status: 'succeeded' })).body).toMatchObject({ id: pi.id, status: 'succeeded', amount_received: 1000 });
    expect((await c.stripe.paymentIntents.retrieve(pi.id)).status).toBe('succeeded');
  });

  it('a key whose process died before committing is free again; one still executing is not', async () => {
    const [dying, other] = await Promise.all([PgState.open(t.url), PgState.open(t.url)]);
    try {
      expect(await dying.claimKey('orphan-key', 'h', Date.now(), 86_400_000)).toEqual({ kind: 'claimed' });
      expect(await other.claimKey('orphan-key', 'h', Date.now(), 86_400_000)).toEqual({ kind: 'executing' });
      await dying.close(); // its session ends, as when its process is killed
      expect(await other.claimKey('orphan-key', 'h', Date.now(), 86_400_000)).toEqual({ kind: 'claimed' });
    } finally {
      await other.close();
    }
  });

  it("the runtime's emulator leaves pm_card_processing processing until it is settled through the control API", async () => {
    const config = loadConfig({ LOG_LEVEL: 'silent' });
    const handle = await openGateway(config, log, { url: t.url, schema: 'outboxd', embedded: true, close: async () => {} });
    try {
      expect(handle.mode).toBe('emulator');
      const op = randomUUID();
      const charge = await handle.gateway.createCharge({ operationId: op, idempotencyKey: `payment-op:${op}`, amount: 700, currency: 'eur', customer: 'cus_1', paymentMethod: 'pm_card_processing', metadata: {} });
      expect(charge.status).toBe('processing');
      await control(handle.emulatorUrl!, 'clock/advance', { ms: 3600_000 });
      expect((await handle.gateway.retrieveCharge(charge.id)).status).toBe('processing');
      await control(handle.emulatorUrl!, `payment_intents/${charge.id}/settle`, { status: 'succeeded' });
      expect((await handle.gateway.retrieveCharge(charge.id)).status).toBe('succeeded');
    } finally {
      await handle.close();
    }
  });
});

describe('outboxd stripe-emulator', () => {
  const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
  const emulatorCli = (...args: string[]) =>
    new Promise<{ code: number | null; stdout: string; stderr: string; kill(): void }>((resolve) => {
      // DATABASE_URL set: an in-memory emulator, no database needed.
      const child = spawn(process.execPath, [BIN, 'stripe-emulator', ...args], { env: { ...process.env, DATABASE_URL: 'postgres://unused@127.0.0.1:1/x', LOG_LEVEL: 'warn' } });
      let stdout = '';
      let stderr = '';
      const timer = setTimeout(() => child.kill('SIGKILL'), 20_000);
      child.stderr.on('data', (d) => (stderr += d));
      child.stdout.on('data', (d) => {
        stdout += d;
        if (stdout.includes('\n')) resolve({ code: null, stdout, stderr, kill: () => child.kill('SIGTERM') });
      });
      child.on('exit', (code) => {
        clearTimeout(timer);
        resolve({ code, stdout, stderr, kill: () => {} });
      });
    });

  it.each(['abc', '70000', '-1', '1.5', ''])('--port %j is a usage error (exit 2) that says what a port is', async (port) => {
    const res = await emulatorCli('--port', port);
    res.kill(); // in case it listened anyway
    expect(res.code).toBe(2);
    expect(res.stderr).toMatch(/--port/);
    expect(res.stderr).toMatch(/0 to 65535/);
  });

  it('--port 0 listens on a free port and prints its URL', async () => {
    const res = await emulatorCli('--port', '0');
    const url = res.stdout.trim();
    expect(url).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    expect((await fetch(`${url}/_emulator/ledger`)).status).toBe(200);
    res.kill();
  });
});
