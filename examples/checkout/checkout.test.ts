// The checkout example, end to end in the normal test suite: its own orders table beside outboxd's, an
// order confirmed with its charge request in one transaction, paid from onSettled; a declined card, then
// another card for the same order.
import { afterAll, beforeAll, expect, it } from 'vitest';
import { waitUntil } from '../../scripts/lib/replica.ts';
import { createTestDatabase, type TestDb } from '../../test/support/db.ts';
import { startDispatcher, type InProcessReplica } from '../../test/support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../../test/support/emulator.ts';
import { createCheckout, type Checkout } from './checkout.ts';

let t: TestDb;
let emu: RunningEmulator;
let worker: InProcessReplica;
let checkout: Checkout;
let base: string;
beforeAll(async () => {
  [t, emu] = await Promise.all([createTestDatabase(), startEmulator()]);
  checkout = createCheckout(t.url);
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

it('bad input is refused by outboxd with the field named, and nothing is kept', async () => {
  const { status, body } = await post('/orders', { email: 'x@example.com', totalCents: 3100, currency: 'xyz', customer: 'cus_x', paymentMethod: 'pm_card_visa' });
  expect(status).toBe(422);
  expect(body.field).toBe('currency');
  const { rows } = await t.pool.query(`select count(*)::int as n from public.orders where email = 'x@example.com'`);
  expect(rows[0].n).toBe(0);
});
