// The emulator's authorizations (manual capture, cancel, expiry), Connect (Stripe-Account scoping,
// destination charges) and payments that stay processing, through the real stripe SDK over HTTP: in
// memory, and in PostgreSQL where two processes decide a capture and a cancel of one PaymentIntent.
import { randomUUID } from 'node:crypto';
import { createServer, type Server } from 'node:http';
import Stripe from 'stripe';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { EmulatorServer, PgState, type EmulatedEvent } from '../../src/emulator/index.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';

const DAY_MS = 24 * 60 * 60 * 1000;
let e: RunningEmulator;
let stripe: Stripe;
beforeAll(async () => {
  e = await startEmulator();
  stripe = e.client({ timeoutMs: 10_000 });
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
const hold = (over: Partial<Stripe.PaymentIntentCreateParams> = {}, opts: Stripe.RequestOptions = {}) =>
  stripe.paymentIntents.create(params({ capture_method: 'manual', ...over }), opts);
const failure = (p: Promise<unknown>) => p.then(() => { throw new Error('expected the request to fail'); }, (err: Stripe.errors.StripeError) => err);
const control = (path: string, body: unknown = {}) =>
  fetch(`${e.url}/_emulator/${path}`, { method: 'POST', body: JSON.stringify(body) }).then(async (r) => ({ status: r.status, body: await r.json() }));
const types = () => e.emulator.emittedEvents().map((ev) => ev.type);

/** A webhook endpoint that keeps what it verified with the secret. */
async function receiver(): Promise<{ url: string; secret: string; events: Stripe.Event[]; close(): Promise<void> }> {
  const secret = 'whsec_capture';
  const events: Stripe.Event[] = [];
  const server: Server = createServer(async (req, res) => {
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    events.push(Stripe.webhooks.constructEvent(Buffer.concat(chunks).toString(), String(req.headers['stripe-signature']), secret));
    res.end('ok');
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const url = `http://127.0.0.1:${(server.address() as { port: number }).port}/`;
  return { url, secret, events, close: () => new Promise((r) => server.close(() => r())) };
}

async function waitFor<T>(read: () => T | undefined, what: string, ms = 20_000): Promise<T> {
  const until = Date.now() + ms;
  for (;;) {
    const v = read();
    if (v !== undefined) return v;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

describe('manual capture', () => {
  it('an authorization holds the amount until captured; its charge says when it expires (capture_before)', async () => {
    e.emulator.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    const pi = await hold();
    expect(pi).toMatchObject({ status: 'requires_capture', capture_method: 'manual', amount: 1000, amount_capturable: 1000, amount_received: 0 });
    const expanded = await stripe.paymentIntents.retrieve(pi.id, { expand: ['latest_charge'] });
    const charge = expanded.latest_charge as Stripe.Charge;
    expect(charge).toMatchObject({ id: pi.latest_charge, object: 'charge', captured: false, amount_captured: 0, payment_intent: pi.id });
    expect(charge.payment_method_details!.card!.capture_before).toBe(pi.created + 7 * 24 * 60 * 60);
    expect(types()).toEqual(['payment_intent.amount_capturable_updated']);
  });

  it('a partial capture receives amount_to_capture and releases the rest; the key replays it; a second capture is refused', async () => {
    e.emulator.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    const pi = await hold();
    const captured = await stripe.paymentIntents.capture(pi.id, { amount_to_capture: 600 }, { idempotencyKey: 'capture-op:1' });
    expect(captured).toMatchObject({ status: 'succeeded', amount_received: 600, amount_capturable: 0 });
    const replay = await stripe.paymentIntents.capture(pi.id, { amount_to_capture: 600 }, { idempotencyKey: 'capture-op:1' });
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(replay).toEqual(captured);
    expect(await failure(stripe.paymentIntents.capture(pi.id, { amount_to_capture: 500 }, { idempotencyKey: 'capture-op:1' }))).toBeInstanceOf(Stripe.errors.StripeIdempotencyError);

    const again = await failure(stripe.paymentIntents.capture(pi.id, {}, { idempotencyKey: 'capture-op:2' }));
    expect(again).toMatchObject({ statusCode: 400, code: 'payment_intent_unexpected_state', message: 'This PaymentIntent could not be captured because it has already been captured.' });
    expect((again.raw as { payment_intent: { status: string } }).payment_intent.status).toBe('succeeded');
    expect(types()).toEqual(['payment_intent.amount_capturable_updated', 'payment_intent.succeeded']);
    // What was released cannot be refunded: a refund takes at most what was received.
    expect(await failure(stripe.refunds.create({ payment_intent: pi.id, amount: 601 }))).toMatchObject({ code: 'amount_too_large' });
    expect((await stripe.refunds.create({ payment_intent: pi.id })).amount).toBe(600);
  });

  it('a capture without an amount takes all it holds; more than it holds is a 400 that stores nothing under the key', async () => {
    const pi = await hold();
    const tooMuch = await failure(stripe.paymentIntents.capture(pi.id, { amount_to_capture: 1001 }, { idempotencyKey: 'k' }));
    expect(tooMuch).toMatchObject({ statusCode: 400, code: 'amount_too_large', param: 'amount_to_capture' });
    // The key is free: other parameters under it execute.
    expect(await stripe.paymentIntents.capture(pi.id, {}, { idempotencyKey: 'k' })).toMatchObject({ status: 'succeeded', amount_received: 1000 });
    expect(await failure(stripe.paymentIntents.capture(pi.id, { amount_to_capture: 0 }))).toMatchObject({ statusCode: 400, param: 'amount_to_capture' });
  });

  it('only an authorization is captured: an automatic charge, a declined or unconfirmed one are refused with payment_intent_unexpected_state', async () => {
    const automatic = await stripe.paymentIntents.create(params());
    expect(await failure(stripe.paymentIntents.capture(automatic.id))).toMatchObject({ statusCode: 400, code: 'payment_intent_unexpected_state' });
    const declined = (await failure(hold({ payment_method: 'pm_card_chargeDeclined' }))) as Stripe.errors.StripeCardError;
    const declinedId = (declined.payment_intent as Stripe.PaymentIntent).id;
    expect(await failure(stripe.paymentIntents.capture(declinedId))).toMatchObject({
      statusCode: 400,
      code: 'payment_intent_unexpected_state',
      message: expect.stringContaining('it has a status of requires_payment_method'),
    });
    const unconfirmed = await hold({ confirm: false });
    expect(unconfirmed.status).toBe('requires_confirmation');
    expect(await failure(stripe.paymentIntents.capture(unconfirmed.id))).toMatchObject({ code: 'payment_intent_unexpected_state' });
    expect(await failure(stripe.paymentIntents.capture('pi_nope'))).toMatchObject({ statusCode: 404, code: 'resource_missing' });
  });

  it('faults and lost responses reach captures: the capture committed, the retry under its key gets the replay', async () => {
    const pi = await hold();
    e.emulator.addFault({ endpoint: 'capture', fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    expect(await failure(stripe.paymentIntents.capture(pi.id, {}, { idempotencyKey: 'lost' }))).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(e.emulator.ledger()[0]!.paymentIntent.status).toBe('succeeded');
    const retry = await stripe.paymentIntents.capture(pi.id, {}, { idempotencyKey: 'lost' });
    expect(retry.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(e.emulator.requests().filter((r) => r.endpoint === 'capture').map((r) => [r.status, r.replayed, r.operationId])).toEqual([
      ['truncated', false, pi.metadata.operation_id],
      [200, true, pi.metadata.operation_id],
    ]);
  });
});

describe('cancel', () => {
  it('an authorization is canceled and releases what it held; the key replays; a capture after it is refused', async () => {
    e.emulator.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    const pi = await hold();
    const canceled = await stripe.paymentIntents.cancel(pi.id, { cancellation_reason: 'requested_by_customer' }, { idempotencyKey: 'cancel-op:1' });
    expect(canceled).toMatchObject({ status: 'canceled', amount_capturable: 0, amount_received: 0, cancellation_reason: 'requested_by_customer' });
    expect(canceled.canceled_at).toBeGreaterThan(0);
    const replay = await stripe.paymentIntents.cancel(pi.id, { cancellation_reason: 'requested_by_customer' }, { idempotencyKey: 'cancel-op:1' });
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(await failure(stripe.paymentIntents.capture(pi.id))).toMatchObject({ code: 'payment_intent_unexpected_state', message: expect.stringContaining('status of canceled') });
    expect(types()).toEqual(['payment_intent.amount_capturable_updated', 'payment_intent.canceled']);
    expect(await failure(stripe.paymentIntents.cancel(pi.id, { cancellation_reason: 'bored' as 'abandoned' }))).toMatchObject({ statusCode: 400, param: 'cancellation_reason' });
  });

  it('a succeeded charge cannot be canceled (400 payment_intent_unexpected_state); a declined one can', async () => {
    const paid = await stripe.paymentIntents.create(params());
    expect(await failure(stripe.paymentIntents.cancel(paid.id, {}, { idempotencyKey: 'c1' }))).toMatchObject({
      statusCode: 400,
      code: 'payment_intent_unexpected_state',
      message: expect.stringContaining('You cannot cancel this PaymentIntent because it has a status of succeeded'),
    });
    const declined = (await failure(stripe.paymentIntents.create(params({ payment_method: 'pm_card_chargeDeclined' })))) as Stripe.errors.StripeCardError;
    expect(await stripe.paymentIntents.cancel((declined.payment_intent as Stripe.PaymentIntent).id)).toMatchObject({ status: 'canceled' });
  });

  it('a capture and a cancel racing: one of them wins, the other is refused', async () => {
    const pi = await hold();
    e.emulator.addFault({ endpoint: 'any', fault: { kind: 'latency', ms: 300 }, count: 2 });
    const [capture, cancel] = await Promise.allSettled([stripe.paymentIntents.capture(pi.id), stripe.paymentIntents.cancel(pi.id)]);
    expect([capture.status, cancel.status].sort()).toEqual(['fulfilled', 'rejected']);
    const final = await stripe.paymentIntents.retrieve(pi.id);
    expect(final.status).toBe(capture.status === 'fulfilled' ? 'succeeded' : 'canceled');
  });
});

describe('authorization expiry', () => {
  it('seven days on the emulator clock cancel an authorization (expired); a capture after is refused', async () => {
    e.emulator.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    const pi = await hold();
    e.emulator.advanceClock(7 * DAY_MS - 60_000);
    expect((await stripe.paymentIntents.retrieve(pi.id)).status).toBe('requires_capture');
    e.emulator.advanceClock(60_000);
    expect(await failure(stripe.paymentIntents.capture(pi.id, {}, { idempotencyKey: 'late' }))).toMatchObject({ code: 'payment_intent_unexpected_state' });
    expect(await stripe.paymentIntents.retrieve(pi.id)).toMatchObject({ status: 'canceled', cancellation_reason: 'expired', amount_capturable: 0 });
    expect(types()).toEqual(['payment_intent.amount_capturable_updated', 'payment_intent.canceled']);
  });

  it('the control API expires an authorization now; anything else is a 400', async () => {
    const pi = await hold();
    expect(await control(`payment_intents/${pi.id}/expire`)).toMatchObject({ status: 200, body: { id: pi.id, status: 'canceled', cancellation_reason: 'expired' } });
    expect((await control(`payment_intents/${pi.id}/expire`)).status).toBe(400);
    expect(e.emulator.ledger()[0]!.paymentIntent.status).toBe('canceled');
    const other = await hold();
    expect(e.emulator.expire(other.id).status).toBe('canceled');
  });

  it('the in-process ledger sees an authorization expire as the clock passes capture_before', async () => {
    await hold();
    e.emulator.advanceClock(7 * DAY_MS);
    expect(e.emulator.ledger()[0]!.paymentIntent).toMatchObject({ status: 'canceled', cancellation_reason: 'expired' });
  });
});

describe('Connect', () => {
  it('Stripe-Account scopes objects: only that account retrieves, lists and searches its PaymentIntents', async () => {
    const onA = await stripe.paymentIntents.create(params(), { stripeAccount: 'acct_A' });
    const onPlatform = await stripe.paymentIntents.create(params());
    expect((await stripe.paymentIntents.retrieve(onA.id, {}, { stripeAccount: 'acct_A' })).id).toBe(onA.id);
    expect(await failure(stripe.paymentIntents.retrieve(onA.id))).toMatchObject({ statusCode: 404, code: 'resource_missing' });
    expect(await failure(stripe.paymentIntents.retrieve(onA.id, {}, { stripeAccount: 'acct_B' }))).toMatchObject({ statusCode: 404 });
    expect(await failure(stripe.paymentIntents.retrieve(onPlatform.id, {}, { stripeAccount: 'acct_A' }))).toMatchObject({ statusCode: 404 });
    expect((await stripe.paymentIntents.list({}, { stripeAccount: 'acct_A' })).data.map((x) => x.id)).toEqual([onA.id]);
    expect((await stripe.paymentIntents.list()).data.map((x) => x.id)).toEqual([onPlatform.id]);
    const query = `metadata['operation_id']:'${onA.metadata.operation_id}'`;
    expect((await stripe.paymentIntents.search({ query }, { stripeAccount: 'acct_A' })).data.map((x) => x.id)).toEqual([onA.id]);
    expect((await stripe.paymentIntents.search({ query })).data).toEqual([]);
    expect(e.emulator.ledger().map((l) => l.account)).toEqual(['acct_A', null]);
    // A capture or cancel through another account does not find it either.
    const held = await hold({}, { stripeAccount: 'acct_A' });
    expect(await failure(stripe.paymentIntents.capture(held.id))).toMatchObject({ statusCode: 404 });
    expect((await stripe.paymentIntents.capture(held.id, {}, { stripeAccount: 'acct_A' })).status).toBe('succeeded');
  });

  it('an account that disconnected the platform answers 403 account_invalid to everything, until restored; the platform and other accounts go on', async () => {
    const before = await stripe.paymentIntents.create(params(), { stripeAccount: 'acct_Gone' });
    expect(await control('accounts/acct_Gone/revoke')).toEqual({ status: 200, body: { ok: true } });
    for (const refused of [
      stripe.paymentIntents.create(params(), { stripeAccount: 'acct_Gone', idempotencyKey: 'payment-op:gone' }),
      stripe.paymentIntents.retrieve(before.id, {}, { stripeAccount: 'acct_Gone' }),
      stripe.paymentIntents.search({ query: `metadata['operation_id']:'${before.metadata.operation_id}'` }, { stripeAccount: 'acct_Gone' }),
    ]) {
      expect(await failure(refused)).toMatchObject({ statusCode: 403, code: 'account_invalid', type: 'StripePermissionError' });
    }
    expect((await stripe.paymentIntents.create(params(), { stripeAccount: 'acct_Other' })).status).toBe('succeeded');
    expect((await stripe.paymentIntents.create(params())).status).toBe('succeeded');
    expect(await control('accounts/acct_Gone/restore')).toEqual({ status: 200, body: { ok: true } });
    // Nothing ran while it was refused: the key is free, and the account's objects are there again.
    expect((await stripe.paymentIntents.create(params(), { stripeAccount: 'acct_Gone', idempotencyKey: 'payment-op:gone' })).lastResponse.headers['idempotent-replayed']).toBeUndefined();
    expect((await stripe.paymentIntents.retrieve(before.id, {}, { stripeAccount: 'acct_Gone' })).id).toBe(before.id);
  });

  it("Stripe-Account scopes idempotency keys: the same key on the platform and on an account are two requests", async () => {
    const p = params();
    const a = await stripe.paymentIntents.create(p, { idempotencyKey: 'payment-op:1', stripeAccount: 'acct_A' });
    const platform = await stripe.paymentIntents.create(p, { idempotencyKey: 'payment-op:1' });
    const b = await stripe.paymentIntents.create(p, { idempotencyKey: 'payment-op:1', stripeAccount: 'acct_B' });
    expect(new Set([a.id, platform.id, b.id]).size).toBe(3);
    const replay = await stripe.paymentIntents.create(p, { idempotencyKey: 'payment-op:1', stripeAccount: 'acct_A' });
    expect(replay.id).toBe(a.id);
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(e.emulator.ledger()).toHaveLength(3);
  });

  it("refunds live on the PaymentIntent's account: only it refunds, retrieves and lists them", async () => {
    const pi = await stripe.paymentIntents.create(params(), { stripeAccount: 'acct_A' });
    expect(await failure(stripe.refunds.create({ payment_intent: pi.id }))).toMatchObject({ statusCode: 400, code: 'resource_missing' });
    const refund = await stripe.refunds.create({ payment_intent: pi.id, amount: 100 }, { stripeAccount: 'acct_A' });
    expect(await failure(stripe.refunds.retrieve(refund.id))).toMatchObject({ statusCode: 404 });
    expect((await stripe.refunds.retrieve(refund.id, {}, { stripeAccount: 'acct_A' })).id).toBe(refund.id);
    expect((await stripe.refunds.list({ payment_intent: pi.id })).data).toEqual([]);
    expect((await stripe.refunds.list({ payment_intent: pi.id }, { stripeAccount: 'acct_A' })).data.map((r) => r.id)).toEqual([refund.id]);
    expect(e.emulator.refundLedger().map((r) => r.account)).toEqual(['acct_A']);
  });

  it('a destination charge stores transfer_data and application_fee_amount; its refund reverses the transfer and the fee when asked', async () => {
    const pi = await stripe.paymentIntents.create(params({ transfer_data: { destination: 'acct_dest' }, application_fee_amount: 123 }));
    expect(pi).toMatchObject({ transfer_data: { destination: 'acct_dest' }, application_fee_amount: 123 });
    expect(await stripe.paymentIntents.retrieve(pi.id)).toMatchObject({ transfer_data: { destination: 'acct_dest' }, application_fee_amount: 123 });
    const refund = await stripe.refunds.create({ payment_intent: pi.id, amount: 400, reverse_transfer: true, refund_application_fee: true });
    expect(refund.transfer_reversal).toMatch(/^trr_/);
    const plain = await stripe.refunds.create({ payment_intent: pi.id, amount: 100 });
    expect(plain.transfer_reversal).toBeNull();
    expect(e.emulator.refundLedger().map((r) => [r.reverseTransfer, r.refundApplicationFee])).toEqual([[true, true], [false, false]]);
  });

  it('refuses an application fee without a connected account, a malformed destination, and a malformed Stripe-Account', async () => {
    expect(await failure(stripe.paymentIntents.create(params({ application_fee_amount: 10 }), { idempotencyKey: 'fee' }))).toMatchObject({ statusCode: 400, param: 'application_fee_amount' });
    expect(await failure(stripe.paymentIntents.create(params({ transfer_data: { destination: 'nope' } })))).toMatchObject({ statusCode: 400, param: 'transfer_data[destination]' });
    expect(await failure(stripe.paymentIntents.create(params({ application_fee_amount: 2000 }), { stripeAccount: 'acct_A' }))).toMatchObject({ statusCode: 400, param: 'application_fee_amount' });
    expect(await failure(stripe.paymentIntents.create(params(), { stripeAccount: 'not-an-account' }))).toBeInstanceOf(Stripe.errors.StripePermissionError);
    // A direct charge may take a fee: the account is the header's.
    expect((await stripe.paymentIntents.create(params({ application_fee_amount: 10 }), { stripeAccount: 'acct_A' })).application_fee_amount).toBe(10);
    expect(e.emulator.ledger()).toHaveLength(1);
  });

  it("webhooks about a connected account's objects carry its account; the platform's carry none", async () => {
    const hook = await receiver();
    try {
      e.emulator.configureWebhooks({ url: hook.url, secret: hook.secret });
      const onA = await stripe.paymentIntents.create(params(), { stripeAccount: 'acct_A' });
      const onPlatform = await stripe.paymentIntents.create(params());
      await stripe.refunds.create({ payment_intent: onA.id }, { stripeAccount: 'acct_A' });
      await waitFor(() => (hook.events.some((ev) => ev.type === 'refund.created') && hook.events.length >= 3 ? true : undefined), 'three events');
      const seen = (id: string) => hook.events.find((ev) => (ev.data.object as { id: string }).id === id)!;
      expect(seen(onA.id)).toMatchObject({ type: 'payment_intent.succeeded', account: 'acct_A' });
      expect(seen(onPlatform.id).account).toBeUndefined();
      expect(hook.events.find((ev) => ev.type === 'refund.created')!.account).toBe('acct_A');
    } finally {
      await hook.close();
    }
  });
});

describe('webhook deliveries', () => {
  it("a reset forgets deliveries still to come: an earlier endpoint's retry never reaches the next one", async () => {
    e.emulator.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    await stripe.paymentIntents.create(params());
    await waitFor(() => (e.emulator.webhookDeliveries().length > 0 ? true : undefined), 'the failed first delivery');
    e.emulator.reset();
    const hook = await receiver();
    try {
      e.emulator.configureWebhooks({ url: hook.url, secret: hook.secret });
      const after = await stripe.paymentIntents.create(params());
      await waitFor(() => (hook.events.length > 0 ? true : undefined), 'the new endpoint\'s event');
      // Past the failed delivery's retries (200 ms, then 400 ms later).
      await new Promise((r) => setTimeout(r, 900));
      expect(hook.events.map((ev) => (ev.data.object as { id: string }).id)).toEqual([after.id]);
    } finally {
      await hook.close();
    }
  });
});

describe('payments that stay processing', () => {
  it('pm_card_processing stays processing until the control API fails or succeeds it, each with its webhook', async () => {
    const hook = await receiver();
    try {
      e.emulator.configureWebhooks({ url: hook.url, secret: hook.secret });
      const failing = await stripe.paymentIntents.create(params({ payment_method: 'pm_card_processing' }), { stripeAccount: 'acct_A' });
      const succeeding = await stripe.paymentIntents.create(params({ payment_method: 'pm_card_processing' }));
      expect([failing.status, succeeding.status]).toEqual(['processing', 'processing']);
      e.emulator.advanceClock(3 * DAY_MS);
      expect((await stripe.paymentIntents.retrieve(succeeding.id)).status).toBe('processing');
      expect(await control(`payment_intents/${failing.id}/settle`, { status: 'requires_payment_method' })).toMatchObject({ status: 200, body: { status: 'requires_payment_method', amount_received: 0, last_payment_error: { code: 'card_declined' } } });
      expect(await control(`payment_intents/${succeeding.id}/settle`, { status: 'succeeded' })).toMatchObject({ status: 200, body: { status: 'succeeded', amount_received: 1000 } });
      const of = (id: string, type: string) => hook.events.find((ev) => ev.type === type && (ev.data.object as { id: string }).id === id);
      expect(await waitFor(() => of(failing.id, 'payment_intent.payment_failed'), 'payment_failed')).toMatchObject({ account: 'acct_A' });
      await waitFor(() => of(succeeding.id, 'payment_intent.succeeded'), 'succeeded');
    } finally {
      await hook.close();
    }
  });
});

describe('in PostgreSQL', () => {
  let t: TestDb;
  const servers: { server: EmulatorServer; state: PgState }[] = [];
  const serve = async () => {
    const state = await PgState.open(t.url);
    const server = new EmulatorServer(state);
    servers.push({ server, state });
    const { url } = await server.listen(0);
    const base = new URL(url);
    return new Stripe(TEST_KEY, { host: base.hostname, port: Number(base.port), protocol: 'http', maxNetworkRetries: 0, timeout: 10_000 });
  };
  beforeAll(async () => {
    t = await createTestDatabase();
  });
  afterAll(async () => {
    for (const { server, state } of servers.splice(0)) await server.close(), await state.close();
    await t.close();
  });

  it('a capture made through one process is replayed through another; the account and its scope are kept', async () => {
    const [a, b] = [await serve(), await serve()];
    const pi = await a.paymentIntents.create(params({ capture_method: 'manual' }), { stripeAccount: 'acct_pg' });
    expect(await failure(b.paymentIntents.retrieve(pi.id))).toMatchObject({ statusCode: 404 });
    const captured = await a.paymentIntents.capture(pi.id, { amount_to_capture: 700 }, { idempotencyKey: 'capture-op:pg', stripeAccount: 'acct_pg' });
    const replay = await b.paymentIntents.capture(pi.id, { amount_to_capture: 700 }, { idempotencyKey: 'capture-op:pg', stripeAccount: 'acct_pg' });
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(replay).toEqual(captured);
    const refund = await b.refunds.create({ payment_intent: pi.id, reverse_transfer: true }, { stripeAccount: 'acct_pg' });
    expect(refund.amount).toBe(700);
    const ledger = (await servers[0]!.state.refunds()).find((r) => r.refund.id === refund.id)!;
    expect(ledger).toMatchObject({ account: 'acct_pg', reverseTransfer: true, refundApplicationFee: false });
  });

  it('a capture and a cancel of one authorization through two processes: exactly one wins', async () => {
    const [a, b] = [await serve(), await serve()];
    for (let i = 0; i < 5; i++) {
      const pi = await a.paymentIntents.create(params({ capture_method: 'manual' }));
      const [capture, cancel] = await Promise.allSettled([a.paymentIntents.capture(pi.id), b.paymentIntents.cancel(pi.id)]);
      expect([capture.status, cancel.status].sort()).toEqual(['fulfilled', 'rejected']);
      const loser = (capture.status === 'rejected' ? capture.reason : (cancel as PromiseRejectedResult).reason) as Stripe.errors.StripeError;
      expect(loser.code).toBe('payment_intent_unexpected_state');
      expect((await b.paymentIntents.retrieve(pi.id)).status).toBe(capture.status === 'fulfilled' ? 'succeeded' : 'canceled');
    }
  });

  it('an account revoked through one process is refused by another, until a reset', async () => {
    const [a, b] = [await serve(), await serve()];
    const { state } = servers.at(-1)!;
    await state.revokeAccess('acct_pgGone', true);
    expect(await failure(a.paymentIntents.create(params(), { stripeAccount: 'acct_pgGone' }))).toMatchObject({ statusCode: 403, code: 'account_invalid' });
    expect((await b.paymentIntents.create(params(), { stripeAccount: 'acct_pgOther' })).status).toBe('succeeded');
    await state.revokeAccess('acct_pgOther', true);
    await state.revokeAccess('acct_pgGone', false);
    expect((await b.paymentIntents.create(params(), { stripeAccount: 'acct_pgGone' })).status).toBe('succeeded');
    expect(await failure(a.paymentIntents.create(params(), { stripeAccount: 'acct_pgOther' }))).toMatchObject({ statusCode: 403 });
    await state.reset();
    expect((await a.paymentIntents.create(params(), { stripeAccount: 'acct_pgOther' })).status).toBe('succeeded');
  });

  it('an authorization expires on the shared clock, with its event', async () => {
    const [a, b] = [await serve(), await serve()];
    const { state } = servers.at(-1)!;
    await state.configureWebhooks({ url: 'http://127.0.0.1:9/unreachable', secret: 'whsec_x' });
    const pi = await a.paymentIntents.create(params({ capture_method: 'manual' }));
    await state.advanceClock(7 * DAY_MS);
    expect(await b.paymentIntents.retrieve(pi.id)).toMatchObject({ status: 'canceled', cancellation_reason: 'expired' });
    expect(await failure(a.paymentIntents.capture(pi.id))).toMatchObject({ code: 'payment_intent_unexpected_state' });
    const events: EmulatedEvent[] = await state.events();
    expect(events.filter((ev) => ev.data.object.id === pi.id).map((ev) => ev.type)).toEqual(['payment_intent.amount_capturable_updated', 'payment_intent.canceled']);
    await state.reset();
  });
});
