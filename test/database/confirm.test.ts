import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { inTransaction } from '../../src/db/pool.ts';
import { confirmOrder } from '../../src/exampleApp/confirm.ts';
import { ValidationError } from '../../src/types/errors.ts';
import { exampleStatementsFor } from '../../src/exampleApp/sql.ts';
import { deadQueueFor, KIND_QUEUE_OPTIONS, queueFor, relayOutbox } from '../../src/outbox/outbox.ts';
import { OrderConflictError, requestCharge } from '../../src/kinds/charge/request.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { chargeJobs, counts, operation, orderInput, outboxRows, relay } from '../support/fixtures.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

describe('confirmOrder (invariant 1)', () => {
  it('commits the order, a pending charge operation and one outbox row together', async () => {
    const input = orderInput({ amount: 1234, currency: 'USD' });
    const { operationId, created } = await confirmOrder(t.pool, input);
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
    expect(await outboxRows(t, operationId)).toBe(1);
  });

  it('operation ids are time-ordered (UUIDv7): each sorts after the last, so the ledger’s indexes grow at their right edge', async () => {
    const ids: string[] = [];
    for (let i = 0; i < 3; i++) {
      ids.push((await confirmOrder(t.pool, orderInput())).operationId);
      await new Promise((resolve) => setTimeout(resolve, 2)); // ids of one millisecond order at random
    }
    for (const id of ids) {
      expect(id).toMatch(/^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
      const millis = parseInt(id.replaceAll('-', '').slice(0, 12), 16);
      expect(Math.abs(millis - Date.now())).toBeLessThan(60_000);
    }
    expect([...ids].sort()).toEqual(ids);
    expect(new Set(ids).size).toBe(3);
  });

  it('the id function calls only PostgreSQL’s own functions: a look-alike earlier on the inserting role’s search_path is never called', async () => {
    const client = await t.pool.connect();
    try {
      await client.query('begin');
      await client.query(`create schema lookalike`);
      await client.query(`create function lookalike.gen_random_uuid() returns uuid language sql as $$ select '00000000-0000-4000-8000-000000000000'::uuid $$`);
      await client.query(`set local search_path = lookalike, pg_catalog`);
      const { rows } = await client.query(`select outboxd.uuidv7()::text as a, outboxd.uuidv7()::text as b`);
      expect(rows[0].a).not.toBe(rows[0].b);
      expect(rows[0].a.slice(19)).not.toBe('8000-000000000000');
    } finally {
      await client.query('rollback');
      client.release();
    }
  });

  it('confirming the same order twice returns the same operation and enqueues nothing new', async () => {
    const input = orderInput();
    const first = await confirmOrder(t.pool, input);
    const second = await confirmOrder(t.pool, input);
    expect(second).toEqual({ operationId: first.operationId, created: false });
    expect(await outboxRows(t, first.operationId)).toBe(1);
  });

  it('confirming concurrently yields one operation and one job', async () => {
    const input = orderInput();
    const results = await Promise.all(Array.from({ length: 8 }, () => confirmOrder(t.pool, input)));
    expect(new Set(results.map((r) => r.operationId)).size).toBe(1);
    expect(results.filter((r) => r.created)).toHaveLength(1);
    expect(await outboxRows(t, results[0]!.operationId)).toBe(1);
  });

  it('refuses to re-confirm an order with a different amount', async () => {
    const input = orderInput();
    await confirmOrder(t.pool, input);
    await expect(confirmOrder(t.pool, { ...input, amount: input.amount + 1 })).rejects.toBeInstanceOf(
      OrderConflictError,
    );
  });

  it('a rollback after the outbox row leaves no order, no operation, no outbox row and no job', async () => {
    await relay(t); // earlier tests' rows: the baseline has an empty outbox
    const before = await counts(t);
    const input = orderInput();
    await expect(
      inTransaction(t.pool, async (tx) => {
        await tx.query(exampleStatementsFor(t.schema).insertOrder(input.orderId, input.amount, input.currency, input.customer, input.paymentMethod));
        expect((await requestCharge(tx, input)).created).toBe(true);
        throw new Error('the application fails after writing the outbox row');
      }),
    ).rejects.toThrow('the application fails');
    expect(await relay(t)).toBe(0);
    expect(await counts(t)).toEqual(before);
  });

  it('a declined order is confirmed again with another payment method: a new operation, a new job', async () => {
    const input = orderInput({ paymentMethod: 'pm_card_chargeDeclined' });
    const first = await confirmOrder(t.pool, input);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = $1`, [first.operationId]);
    expect(await confirmOrder(t.pool, input)).toEqual({ operationId: first.operationId, created: false });
    const second = await confirmOrder(t.pool, { ...input, paymentMethod: 'pm_card_visa' });
    expect(second.created).toBe(true);
    expect(second.operationId).not.toBe(first.operationId);
    expect(await outboxRows(t, second.operationId)).toBe(1);
  });
});

describe('the outbox relay', () => {
  it('turns each outbox row into exactly one charge job with the queue’s policy, and removes the row', async () => {
    const op = (await confirmOrder(t.pool, orderInput())).operationId;
    await relay(t);
    expect(await outboxRows(t, op)).toBe(0);
    expect(await chargeJobs(t, op)).toBe(1);
    const [job] = await t.boss.findJobs(queueFor('charge'), { data: { operationId: op } });
    expect(job).toMatchObject({ heartbeatSeconds: KIND_QUEUE_OPTIONS.heartbeatSeconds, deadLetter: deadQueueFor('charge'), retryLimit: KIND_QUEUE_OPTIONS.retryLimit });
    expect(await relay(t)).toBe(0);
    expect(await chargeJobs(t, op)).toBe(1);
  });

  it('relays running at once take disjoint batches: one job per row', async () => {
    const ops = await Promise.all(Array.from({ length: 300 }, () => confirmOrder(t.pool, orderInput()).then((c) => c.operationId)));
    const moved = await Promise.all(Array.from({ length: 4 }, () => relayOutbox(t.pool, t.boss, 50)));
    const rest = await relay(t);
    expect(moved.reduce((a, b) => a + b.operations, 0) + rest).toBeGreaterThanOrEqual(300);
    const { rows } = await t.pool.query(
      `select data->>'operationId' as op, count(*)::int as n from pgboss.job where name = 'charge' and data->>'operationId' = any($1) group by 1`,
      [ops],
    );
    expect(rows).toHaveLength(300);
    expect(rows.every((r) => r.n === 1)).toBe(true);
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
    const err = await confirmOrder(t.pool, input).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ValidationError);
    expect((err as ValidationError).field).toBe(field);
    expect(await counts(t)).toEqual(before);
  });
});
