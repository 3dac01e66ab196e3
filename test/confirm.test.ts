import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { bossDb, inTransaction } from '../src/db/pool.ts';
import { confirmOrder, OrderConflictError } from '../src/orders/confirm.ts';
import { ValidationError } from '../src/orders/validate.ts';
import { enqueueCharge } from '../src/outbox.ts';
import * as sql from '../src/sql/statements.ts';
import { createTestDatabase, type TestDb } from './support/db.ts';
import { chargeJobs, counts, operation, orderInput } from './support/fixtures.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

describe('confirmOrder (invariant 1)', () => {
  it('commits the order, a pending charge operation and one outbox job together', async () => {
    const input = orderInput({ amount: 1234, currency: 'USD' });
    const { operationId, created } = await confirmOrder(t.pool, t.boss, input);
    expect(created).toBe(true);
    const op = await operation(t, operationId);
    expect(op).toMatchObject({
      order_id: input.orderId,
      kind: 'charge',
      amount: 1234,
      currency: 'usd',
      status: 'pending',
      attempts: 0,
      first_attempted_at: null,
      fence: 0,
    });
    expect(await chargeJobs(t, operationId)).toBe(1);
  });

  it('confirming the same order twice returns the same operation and enqueues nothing new', async () => {
    const input = orderInput();
    const first = await confirmOrder(t.pool, t.boss, input);
    const second = await confirmOrder(t.pool, t.boss, input);
    expect(second).toEqual({ operationId: first.operationId, created: false });
    expect(await chargeJobs(t, first.operationId)).toBe(1);
  });

  it('confirming concurrently yields one operation and one job', async () => {
    const input = orderInput();
    const results = await Promise.all(Array.from({ length: 8 }, () => confirmOrder(t.pool, t.boss, input)));
    expect(new Set(results.map((r) => r.operationId)).size).toBe(1);
    expect(results.filter((r) => r.created)).toHaveLength(1);
    expect(await chargeJobs(t, results[0]!.operationId)).toBe(1);
  });

  it('refuses to re-confirm an order with a different amount', async () => {
    const input = orderInput();
    await confirmOrder(t.pool, t.boss, input);
    await expect(confirmOrder(t.pool, t.boss, { ...input, amount: input.amount + 1 })).rejects.toBeInstanceOf(
      OrderConflictError,
    );
  });

  it('a rollback after the enqueue leaves no order, no operation and no job', async () => {
    const before = await counts(t);
    const input = orderInput();
    await expect(
      inTransaction(t.pool, async (tx) => {
        const v = [input.orderId, input.amount, input.currency, input.customer, input.paymentMethod] as const;
        await tx.query(sql.insertOrder(...v));
        const { rows } = await tx.query(sql.insertChargeOperation(...v));
        expect(await enqueueCharge(t.boss, bossDb(tx), rows[0].id)).toBeTruthy();
        throw new Error('the application fails after enqueueing');
      }),
    ).rejects.toThrow('the application fails');
    expect(await counts(t)).toEqual(before);
  });
});

describe('input validation (invariant 11): refused before anything is written', () => {
  const bad: [string, Record<string, unknown>, string][] = [
    ['zero amount', { amount: 0 }, 'amount'],
    ['negative amount', { amount: -5 }, 'amount'],
    ['fractional amount', { amount: 10.5 }, 'amount'],
    ['amount as a string', { amount: '100' }, 'amount'],
    ['amount beyond Stripe', { amount: 100_000_000 }, 'amount'],
    ['unsafe integer', { amount: 2 ** 53 + 2 }, 'amount'],
    ['unknown currency', { currency: 'xyz' }, 'currency'],
    ['empty currency', { currency: '' }, 'currency'],
    ['empty order id', { orderId: '' }, 'orderId'],
    ['blank order id', { orderId: '   ' }, 'orderId'],
    ['oversized order id', { orderId: 'o'.repeat(256) }, 'orderId'],
    ['control character in id', { orderId: 'ord\n1' }, 'orderId'],
    ['empty customer', { customer: '' }, 'customer'],
    ['oversized payment method', { paymentMethod: 'p'.repeat(300) }, 'paymentMethod'],
    ['missing payment method', { paymentMethod: undefined }, 'paymentMethod'],
    ['unknown field', { card: '4242424242424242' }, 'card'],
  ];
  it.each(bad)('%s', async (_name, change, field) => {
    const before = await counts(t);
    const input = { ...orderInput(), ...change };
    const err = await confirmOrder(t.pool, t.boss, input).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ValidationError);
    expect((err as ValidationError).field).toBe(field);
    expect(await counts(t)).toEqual(before);
  });
});
