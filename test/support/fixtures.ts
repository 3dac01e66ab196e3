import { randomUUID } from 'node:crypto';
import { confirmOrder } from '../../src/exampleApp/confirm.ts';
import type { OrderInput } from '../../src/kinds/charge/input.ts';
import { relayOutbox } from '../../src/outbox/outbox.ts';
import { acquireLease, type Operation } from '../../src/engine/operation.ts';
import type { TestDb } from './db.ts';

export function orderInput(overrides: Partial<OrderInput> = {}): OrderInput {
  return {
    orderId: `ord_${randomUUID()}`,
    amount: 2599,
    currency: 'eur',
    customer: 'cus_test_1',
    paymentMethod: 'pm_card_visa',
    ...overrides,
  };
}

export async function confirm(t: TestDb, overrides: Partial<OrderInput> = {}): Promise<string> {
  return (await confirmOrder(t.pool, orderInput(overrides))).operationId;
}

/** Takes the operation's lease the way a dispatcher does and returns the fencing token. */
export async function claim(t: TestDb, operationId: string, owner = 'test-worker'): Promise<number> {
  const fence = await acquireLease(t.pool, operationId, owner, 60_000);
  if (fence === undefined) throw new Error(`could not claim ${operationId}`);
  return fence;
}

export async function operation(t: TestDb, id: string): Promise<Operation> {
  const { rows } = await t.pool.query('select * from outboxd.payment_operations where id = $1', [id]);
  return rows[0];
}

export async function chargeJobs(t: TestDb, operationId?: string): Promise<number> {
  const { rows } = await t.pool.query(
    `select count(*)::int as n from pgboss.job where name = 'charge' and ($1::text is null or data->>'operationId' = $1)`,
    [operationId ?? null],
  );
  return rows[0].n;
}

export async function outboxRows(t: TestDb, operationId?: string): Promise<number> {
  const { rows } = await t.pool.query(
    `select count(*)::int as n from outboxd.charge_outbox where ($1::uuid is null or operation_id = $1)`,
    [operationId ?? null],
  );
  return rows[0].n;
}

/** Relays every outbox row to a pg-boss job, as a worker's relay does: how many operations' rows. */
export async function relay(t: TestDb): Promise<number> {
  let total = 0;
  for (let pass = await relayOutbox(t.pool, t.boss); pass.operations + pass.settlements > 0; pass = await relayOutbox(t.pool, t.boss, undefined, pass)) {
    total += pass.operations;
  }
  return total;
}

export async function counts(t: TestDb): Promise<{ orders: number; operations: number; outbox: number; jobs: number }> {
  const { rows } = await t.pool.query(`select
      (select count(*)::int from outboxd.orders) as orders,
      (select count(*)::int from outboxd.payment_operations) as operations,
      (select count(*)::int from outboxd.charge_outbox) as outbox,
      (select count(*)::int from pgboss.job where name = 'charge') as jobs`);
  return rows[0];
}
