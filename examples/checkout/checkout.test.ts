// The checkout example, end to end in the normal test suite: its own orders table beside outboxd's, an
// order confirmed with its charge request in one transaction, paid from onSettled; a declined card, then
// another card for the same order; bad input refused with 400 naming the field, and a 500 that shows no SQL.
import { afterAll, beforeAll, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../../test/support/db.ts';
import { startDispatcher, type InProcessReplica } from '../../test/support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../../test/support/emulator.ts';
import { createCheckout, type Checkout } from './checkout.ts';

let t: TestDb;
let emu: RunningEmulator;
let worker: InProcessReplica;
let checkout: Checkout;
let base: string;
const logged: string[] = [];
beforeAll(async () => {
  [t, emu] = await Promise.all([createTestDatabase(), startEmulator()]);
  checkout = createCheckout(t.url, (message, err) => logged.push(`${message}: ${String(err)}`));
  base = `http://127.0.0.1:${await checkout.start(0)}`;
  worker = await startDispatcher(t, emu.gateway(), 'checkout-worker');
});
afterAll(async () => {
  await worker.stop();
  await checkout.stop();
  await Promise.all([t.close(), emu.close()]);
});

const post = async (path: string, body: unknown) => {
  const res = await fetch(`${base}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
  return { status: res.status, body: (await res.json()) as Record<string, any> };
};
const order = async (id: string) => (await (await fetch(`${base}/orders/${id}`)).json()) as Record<string, any>;
const place = (paymentMethod: string) =>
  post('/orders', { email: 'ada@example.com', totalCents: 3100, currency: 'eur', customer: 'cus_ada', paymentMethod });

it('an order is confirmed with its charge request, then paid from onSettled', async () => {
  const { status, body } = await place('pm_card_visa');
  expect(status).toBe(201);
  await waitUntil(async () => (await order(body.orderId)).status === 'paid', 20_000, 'the order paid');
  expect(await order(body.orderId)).toMatchObject({ totalCents: 3100, payment: { id: body.operationId, status: 'succeeded', amount: 3100 } });
  const { rows } = await t.pool.query(`select count(*)::int as n from public.orders`);
  expect(rows[0].n).toBeGreaterThanOrEqual(1);
  // Paid in the transaction that recorded the checkout's subscriber consuming the settlement.
  const consumed = await t.pool.query(`select subscriber from outboxd.settlement_consumption where operation_id = $1`, [body.operationId]);
  expect(consumed.rows).toEqual([{ subscriber: 'checkout-orders' }]);
});

it('a declined card fails the payment; another card for the same order pays it', async () => {
  const { body } = await place('pm_card_chargeDeclined');
  await waitUntil(async () => (await order(body.orderId)).status === 'payment_failed', 20_000, 'the payment failed');
  const retry = await post(`/orders/${body.orderId}/payment`, { paymentMethod: 'pm_card_visa' });
  expect(retry.status).toBe(202);
  expect(retry.body.operationId).not.toBe(body.operationId);
  await waitUntil(async () => (await order(body.orderId)).status === 'paid', 20_000, 'paid with the other card');
  // Paid: another card now is a conflict, refused before anything is written.
  expect((await post(`/orders/${body.orderId}/payment`, { paymentMethod: 'pm_card_mastercard' })).status).toBe(409);
});

const valid = { email: 'v@example.com', totalCents: 3100, currency: 'eur', customer: 'cus_v', paymentMethod: 'pm_card_visa' };
const long = 'x'.repeat(300);
const ordersOf = async (email: string) =>
  (await t.pool.query(`select count(*)::int as n from public.orders where email = $1`, [email])).rows[0].n as number;
const operations = async () => (await t.pool.query(`select count(*)::int as n from outboxd.payment_operations`)).rows[0].n as number;

// One bad value per field of POST /orders; each is refused with 400 naming the field, and nothing is kept.
const badOrders: [string, Record<string, unknown>][] = [
  ['email', { email: undefined }],
  ['email', { email: 'not an address' }],
  ['email', { email: `${long}@example.com` }],
  ['email', { email: 'a\u0000b@example.com' }],
  ['totalCents', { totalCents: -100 }],
  ['totalCents', { totalCents: 0 }],
  ['totalCents', { totalCents: 31.5 }],
  ['totalCents', { totalCents: '3100' }],
  ['totalCents', { totalCents: 2 ** 31 }],
  ['currency', { currency: 'xyz' }],
  ['currency', { currency: undefined }],
  ['customer', { customer: undefined }],
  ['customer', { customer: long }],
  ['customer', { customer: 'cus_\u0000' }],
  ['paymentMethod', { paymentMethod: '' }],
  ['paymentMethod', { paymentMethod: long }],
  ['paymentMethod', { paymentMethod: 'pm_\u0000' }],
];
it.each(badOrders)('POST /orders, bad %s %j: 400 naming it, nothing kept', async (field, change) => {
  const email = `bad-${field}-${Math.random()}@example.com`;
  const before = await operations();
  const { status, body } = await post('/orders', { ...valid, email, ...change });
  expect({ status, body: { error: body.error, field: body.field } }).toEqual({ status: 400, body: { error: 'validation', field } });
  expect(body.message).toEqual(expect.any(String));
  expect(await ordersOf(email)).toBe(0);
  expect(await operations()).toBe(before);
});

it('a body that is not a JSON object: 400 naming the body', async () => {
  for (const raw of ['{not json', 'null', '[1]']) {
    const res = await fetch(`${base}/orders`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: raw });
    expect(res.status).toBe(400);
    expect(await res.json()).toMatchObject({ error: 'validation', field: 'body' });
  }
});

it('POST /orders/:id/payment with a bad payment method: 400 naming it; an id that is no order: 404', async () => {
  const { body } = await place('pm_card_chargeDeclined');
  await waitUntil(async () => (await order(body.orderId)).status === 'payment_failed', 20_000, 'the payment failed');
  const before = await operations();
  for (const paymentMethod of [undefined, 42, '', long, 'pm_\u0000']) {
    const res = await post(`/orders/${body.orderId}/payment`, { paymentMethod });
    expect(res).toMatchObject({ status: 400, body: { error: 'validation', field: 'paymentMethod' } });
  }
  expect(await operations()).toBe(before);
  expect((await order(body.orderId)).status).toBe('payment_failed');
  expect((await post('/orders/not-a-uuid/payment', { paymentMethod: 'pm_card_visa' })).status).toBe(404);
  expect((await fetch(`${base}/orders/not-a-uuid`)).status).toBe(404);
});

it('a failure that is not the input answers a bare 500: never the SQL or its parameters', async () => {
  // A real database refusal of the checkout's own insert, after outboxd accepted the charge request.
  await t.pool.query(`alter table public.orders add constraint no_bounce check (email <> 'bounce@example.com')`);
  const before = await operations();
  try {
    const res = await fetch(`${base}/orders`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ ...valid, email: 'bounce@example.com', customer: 'cus_secret_param' }),
    });
    const text = await res.text();
    expect(res.status).toBe(500);
    expect(JSON.parse(text)).toEqual({ error: 'internal' });
    expect(text).not.toMatch(/insert|orders|bounce|cus_secret_param|no_bounce/i);
    // What the answer leaves out is in the log, for whoever runs the service.
    expect(logged.at(-1)).toMatch(/insert into "orders".*cus_secret_param/s);
  } finally {
    await t.pool.query(`alter table public.orders drop constraint no_bounce`);
  }
  // The charge request outboxd accepted rolled back with the order: one transaction.
  expect(await ordersOf('bounce@example.com')).toBe(0);
  expect(await operations()).toBe(before);
});
