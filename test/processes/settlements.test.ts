// Settlement events: every settlement (executor, reconcile sweep, webhook, a person's resolution)
// writes its event in the statement that changes the status; the unnamed onSettled handlers take it from
// that table, the workers' relay copies it to each named subscriber's queue, and handlers get it at least
// once: again after a throw or a process that died mid-handler, dead-lettered after many failures, and
// sent again by `outboxd settlements redrive`.
import { spawn } from 'node:child_process';
import pg from 'pg';
import { randomUUID } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import type Stripe from 'stripe';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { resolveOperation } from '../../src/admin/resolve.ts';
import { inTransaction } from '../../src/db/pool.ts';
import { createMetrics } from '../../src/telemetry/metrics.ts';
import { Outboxd, type SettlementEvent } from '../../src/index.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { createBoss } from '../../src/outbox/outbox.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { settleFromOutside, StaleFenceError } from '../../src/engine/operation.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { redriveSettlements, relaySettlements, SETTLED_DEAD_QUEUE, SETTLED_QUEUE, subscribeSettlements } from '../../src/outbox/settlements.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { waitUntil } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { claim, confirm, relay } from '../support/fixtures.ts';

const log = createLogger('silent');
let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

const events = async (op: string): Promise<{ source: string }[]> =>
  (await t.pool.query(`select source from outboxd.settlement_outbox where operation_id = $1`, [op])).rows;
const jobs = async (queue: string, op: string) =>
  (await t.pool.query(`select state, data from pgboss.job where name = $1 and data->>'operationId' = $2`, [queue, op])).rows;

describe('every settlement writes its event with the status change', () => {
  it('the executor: a success and a decline each write one event; an ambiguous outcome none', async () => {
    const stripe = new FakeStripe();
    const paid = await confirm(t);
    await executeOperation(t.pool, kindsFor(stripe), paid, await claim(t, paid));
    const declined = await confirm(t, { paymentMethod: 'pm_card_chargeDeclined' });
    await executeOperation(t.pool, kindsFor(stripe), declined, await claim(t, declined));
    const lost = await confirm(t);
    stripe.loseResponseOnce = true;
    expect((await executeOperation(t.pool, kindsFor(stripe), lost, await claim(t, lost))).operation.status).toBe('unknown');
    expect(await events(paid)).toEqual([{ source: 'dispatcher' }]);
    expect(await events(declined)).toEqual([{ source: 'dispatcher' }]);
    expect(await events(lost)).toEqual([]);
  });

  it('the reconcile sweep, a webhook and a person’s resolution each name themselves', async () => {
    const stripe = new FakeStripe();
    const swept = await confirm(t);
    const charge = stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: swept });
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now() - interval '25 hours' where id = $1`, [swept]);
    await reconcileSweep(t.pool, stripe, { owner: 'sweep', leaseTtlMs: 10_000, log });
    expect(await events(swept)).toEqual([{ source: 'reconcile' }]);

    const hooked = await confirm(t);
    const hookedCharge = stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: hooked });
    // Sent, its answer lost: a PaymentIntent naming an operation never sent is no settlement of it.
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now() where id = $1`, [hooked]);
    const event = { id: `evt_${hooked}`, type: 'payment_intent.succeeded', data: { object: { id: hookedCharge.id } } };
    expect(await receiveStripeEvent({ pool: t.pool, gateway: stripe, log }, event as unknown as Stripe.Event)).toBe('settled');
    expect(await events(hooked)).toEqual([{ source: 'webhook' }]);

    const resolved = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [resolved]);
    const found = stripe.addCharge({ status: 'succeeded', amount: 2599, currency: 'eur', operationId: resolved });
    await resolveOperation(t.pool, stripe, resolved, { outcome: 'succeeded', externalId: found.id }, 'cli:ops', { leaseTtlMs: 10_000, searchFreshnessSeconds: 3_600 });
    expect(await events(resolved)).toEqual([{ source: 'admin' }]);
    expect(charge.id).not.toBe(found.id);
  });

  it('rolled back with its transaction, and never written by a fenced-out or repeated settlement', async () => {
    const op = await confirm(t);
    await expect(
      inTransaction(t.pool, async (tx) => {
        expect(await settleFromOutside(tx, op, 'succeeded', 'pi_rollback', 'resolved_by_admin', null)).toBeDefined();
        throw new Error('the audit insert failed');
      }),
    ).rejects.toThrow('the audit insert failed');
    expect(await events(op)).toEqual([]);

    const stale = await claim(t, op, 'w1');
    await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
    await claim(t, op, 'w2'); // takes the operation over: w1's outcome must write nothing
    await expect(executeOperation(t.pool, kindsFor(new FakeStripe()), op, stale)).rejects.toBeInstanceOf(StaleFenceError);
    expect(await events(op)).toEqual([]);

    expect(await settleFromOutside(t.pool, op, 'failed', null, 'resolved_by_admin', 'by hand')).toBeDefined();
    expect(await settleFromOutside(t.pool, op, 'succeeded', 'pi_late', 'webhook:payment_intent.succeeded', null)).toBeUndefined();
    expect(await events(op)).toEqual([{ source: 'admin' }]);
  });

  it('the event waits in its table for the unnamed handlers; the relay copies it to each named subscriber that subscribed before it settled, once', async () => {
    const before = await confirm(t);
    await executeOperation(t.pool, kindsFor(new FakeStripe()), before, await claim(t, before)); // settled before anyone subscribed
    await relay(t);
    expect(await events(before)).toEqual([{ source: 'dispatcher' }]);
    expect(await jobs(SETTLED_QUEUE, before)).toEqual([]);

    const queue = await subscribeSettlements(t.boss, 'copies');
    try {
      const op = await confirm(t);
      await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op));
      await relay(t);
      const [job] = await jobs(queue, op);
      expect(job.data).toMatchObject({ operationId: op, kind: 'charge', status: 'succeeded', amount: 2599, currency: 'eur', source: 'dispatcher', queue });
      expect(job.data.externalId).toMatch(/^pi_/);
      await relay(t);
      expect(await jobs(queue, op)).toHaveLength(1);
      expect(await jobs(queue, before)).toEqual([]); // a subscriber hears of what settled after it subscribed
      expect(await events(op)).toEqual([{ source: 'dispatcher' }]);
      expect(await jobs(SETTLED_QUEUE, op)).toEqual([]);
    } finally {
      await t.boss.deleteQueue(queue);
    }
  });

  it('until an application of this release subscribes, the relay puts every event on `settled`, where the applications of the release before look', async () => {
    await t.pool.query(`delete from outboxd.settlement_delivery`); // a database upgraded from that release
    try {
      const op = await confirm(t);
      await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op));
      await relay(t);
      expect(await events(op)).toEqual([]);
      expect((await jobs(SETTLED_QUEUE, op)).map((j) => j.data)).toEqual([expect.objectContaining({ operationId: op, status: 'succeeded', source: 'dispatcher' })]);

      const app = new Outboxd({ connectionString: t.url, onError: () => {} });
      await app.onSettled(() => {});
      await app.stop();
      const next = await confirm(t);
      await executeOperation(t.pool, kindsFor(new FakeStripe()), next, await claim(t, next));
      await relay(t);
      expect(await events(next)).toEqual([{ source: 'dispatcher' }]);
      expect(await jobs(SETTLED_QUEUE, next)).toEqual([]);
    } finally {
      await t.pool.query(`insert into outboxd.settlement_delivery default values on conflict do nothing`);
    }
  });

  it('an application whose role may not write settlement_delivery says so once, leaves the switch alone and receives its events through `settled`', { timeout: 60_000 }, async () => {
    const role = `outboxd_limited_${randomUUID().slice(0, 8)}`;
    try {
      await t.pool.query(`delete from outboxd.settlement_delivery`); // a database upgraded from the release before
      await t.pool.query(`create role ${role} login password 'limited'`);
      // Every table, less the insert that writes the switch.
      await t.pool.query(`grant usage on schema outboxd, pgboss to ${role};
        grant select, insert, update, delete on all tables in schema outboxd, pgboss to ${role};
        grant usage on all sequences in schema outboxd, pgboss to ${role};
        revoke insert on outboxd.settlement_delivery from ${role}`);
      const url = new URL(t.url);
      url.username = role;
      url.password = 'limited';
      const errors: Error[] = [];
      const seen: string[] = [];
      const app = new Outboxd({ connectionString: url.toString(), onError: (err) => errors.push(err) });
      try {
        await app.onSettled((event) => {
          seen.push(event.operationId);
        });
        const op = await confirm(t);
        await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op));
        await relay(t);
        await waitUntil(() => seen.includes(op), 30_000, 'the event, through the queue settled');
        expect(errors.map((e) => e.message)).toEqual([expect.stringContaining('this role may not write settlement_delivery')]);
        expect((await t.pool.query(`select count(*)::int as n from outboxd.settlement_delivery`)).rows[0].n).toBe(0);
      } finally {
        await app.stop();
      }
    } finally {
      await t.pool.query(`insert into outboxd.settlement_delivery default values on conflict do nothing`);
      await t.pool.query(`drop owned by ${role}; drop role ${role}`).catch(() => {}); // not created, if its create failed
    }
  });

  it('the switch waits for every relay pass begun before it; a pass after it leaves the events in the table', async () => {
    await t.pool.query(`delete from outboxd.settlement_delivery`);
    const relayPass = await t.pool.connect();
    try {
      await relayPass.query('begin');
      expect((await relayPass.query(t.pool.sql.settlementRelayMode())).rows[0].table_delivery).toBe(false);
      let switched = false;
      const switching = t.pool.query(t.pool.sql.deliverFromTable()).then(() => (switched = true));
      await new Promise((resolve) => setTimeout(resolve, 500));
      expect(switched).toBe(false); // a pass that read the old way may still be taking rows that way
      await relayPass.query('commit');
      await switching;
      await relayPass.query('begin');
      expect((await relayPass.query(t.pool.sql.settlementRelayMode())).rows[0].table_delivery).toBe(true);
      await relayPass.query('commit');
    } finally {
      relayPass.release();
      await t.pool.query(`insert into outboxd.settlement_delivery default values on conflict do nothing`);
    }
  });

  it('a pass that waited for the switch (its mode read in a snapshot from before) takes no row the old way after it', async () => {
    await t.pool.query(`delete from outboxd.settlement_delivery`);
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op)); // its event waits in the table, not relayed
    const switching = await t.pool.connect();
    try {
      await switching.query('begin');
      await switching.query(t.pool.sql.deliverFromTable());
      // The pass waits on the switch's lock, its first statement's snapshot taken before the switch commits.
      const pass = relaySettlements(t.pool, t.boss, 10);
      await waitUntil(async () => (await t.pool.query(`select count(*)::int as n from pg_locks where locktype = 'advisory' and not granted and database = (select oid from pg_database where datname = current_database())`)).rows[0].n > 0, 10_000, 'the pass to wait');
      await switching.query('commit');
      await pass;
      expect(await events(op)).toEqual([{ source: 'dispatcher' }]); // left for the unnamed handlers
      expect(await jobs(SETTLED_QUEUE, op)).toEqual([]);
    } finally {
      switching.release();
      await t.pool.query(`insert into outboxd.settlement_delivery default values on conflict do nothing`);
      await t.pool.query(`delete from outboxd.settlement_outbox where operation_id = $1`, [op]);
    }
  });

  it('undone (an application rolled back), the old relay copies no event to a subscriber twice', async () => {
    const queue = await subscribeSettlements(t.boss, 'undone');
    try {
      const op = await settle(); // copied to the subscriber, left in the table
      expect(await jobs(queue, op)).toHaveLength(1);
      await t.pool.query(`delete from outboxd.settlement_delivery`);
      await relay(t);
      expect(await events(op)).toEqual([]);
      expect(await jobs(SETTLED_QUEUE, op)).toHaveLength(1);
      expect(await jobs(queue, op)).toHaveLength(1);
    } finally {
      await t.pool.query(`insert into outboxd.settlement_delivery default values on conflict do nothing`);
      await t.boss.deleteQueue(queue);
    }
  });
});

/** Settles a new operation through the executor and relays its event. */
async function settle(over: Parameters<typeof confirm>[1] = {}): Promise<string> {
  const op = await confirm(t, over);
  await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op));
  await relay(t);
  return op;
}

describe('onSettled', () => {
  it('delivers each settlement to the subscribed handler, and again after the handler threw', async () => {
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: SettlementEvent[] = [];
    let failures = 0;
    const first = await settle();
    await outboxd.onSettled(async (event) => {
      seen.push(event);
      if (event.operationId === first && failures++ === 0) throw new Error('the order service is down');
    });
    const second = await settle({ paymentMethod: 'pm_card_chargeDeclined' });
    try {
      await waitUntil(() => seen.filter((e) => e.operationId === first).length >= 2 && seen.some((e) => e.operationId === second), 30_000, 'both events, the first twice');
      const event = seen.find((e) => e.operationId === first)!;
      expect(event).toMatchObject({ orderId: expect.any(String), kind: 'charge', status: 'succeeded', amount: 2599, currency: 'eur', source: 'dispatcher' });
      expect(event.settledAt).toBeInstanceOf(Date);
      expect(seen.find((e) => e.operationId === second)).toMatchObject({ status: 'failed', source: 'dispatcher' });
      await waitUntil(async () => (await events(first)).length === 0, 10_000, 'the handled event goes');
    } finally {
      await outboxd.stop();
    }
  });

  it('a handler that keeps failing: dead-lettered, counted in /metrics, and sent again by `outboxd settlements redrive`', async () => {
    const op = await settle();
    // Its 40 retries spent: the next failure is its last.
    await t.pool.query(`update outboxd.settlement_outbox set attempts = 40 where operation_id = $1`, [op]);
    const failing = new Outboxd({ connectionString: t.url, onError: () => {} });
    await failing.onSettled(() => {
      throw new Error('a bug in the handler');
    });
    try {
      await waitUntil(async () => (await jobs(SETTLED_DEAD_QUEUE, op)).length === 1, 30_000, 'dead-lettered');
      expect(await events(op)).toEqual([]);
      expect((await jobs(SETTLED_DEAD_QUEUE, op))[0].data).toMatchObject({ operationId: op, status: 'succeeded', source: 'dispatcher', lastError: 'a bug in the handler' });
    } finally {
      await failing.stop(); // a timeout here must not leave it taking the events later tests wait for
    }

    // A worker's /metrics (its pg-boss supervises, which refreshes the queue counts).
    const boss = createBoss(t.url, 'worker', 2, t.schema);
    boss.on('error', () => {});
    await boss.start();
    const metrics = createMetrics({ db: t.pool, boss });
    const dead = async () => (await metrics.settlementEvents.get()).values.find((v) => v.labels.state === 'dead')?.value ?? 0;
    try {
      await waitUntil(async () => (await dead()) >= 1, 30_000, 'the dead gauge counts it');
    } finally {
      await boss.stop({ graceful: false });
    }

    const fixed = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: string[] = [];
    await fixed.onSettled((event) => {
      seen.push(event.operationId);
    });
    try {
      const res = await cli('settlements', 'redrive', '--json');
      expect(res.code).toBe(0);
      expect(JSON.parse(res.stdout).redriven).toBeGreaterThanOrEqual(1);
      await waitUntil(() => seen.includes(op), 30_000, 'the redriven event is delivered');
    } finally {
      await fixed.stop();
    }
  });
});

describe('a handler’s time is bounded', () => {
  it('a handler that hangs on one event holds up no other: later settlements are delivered meanwhile', { timeout: 120_000 }, async () => {
    // The timeout is far off: what keeps the others flowing is that each delivery has a slot of its own.
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {}, settlementHandlerTimeoutMs: 600_000 });
    const hung = await settle();
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    const seen: string[] = [];
    await outboxd.onSettled(async (event) => {
      seen.push(event.operationId);
      if (event.operationId === hung) await gate;
    });
    try {
      await waitUntil(() => seen.includes(hung), 30_000, 'the hanging delivery has begun');
      const later: string[] = [];
      for (let i = 0; i < 5; i++) later.push(await settle());
      await waitUntil(() => later.every((op) => seen.includes(op)), 20_000, 'the 5 later settlements, delivered while one handler hangs');
    } finally {
      release();
      await outboxd.stop();
    }
  });

  it('past SETTLEMENT_HANDLER_TIMEOUT_MS the delivery counts as failed and is retried with backoff', { timeout: 120_000 }, async () => {
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {}, settlementHandlerTimeoutMs: 1_500 });
    const op = await settle();
    let deliveries = 0;
    await outboxd.onSettled(async (event) => {
      if (event.operationId !== op) return;
      if (deliveries++ === 0) await new Promise(() => {}); // never returns
    });
    try {
      await waitUntil(async () => (await t.pool.query(`select last_error from outboxd.settlement_outbox where operation_id = $1`, [op])).rows[0]?.last_error, 10_000, 'the first delivery failed');
      const { rows } = await t.pool.query(`select attempts, last_error from outboxd.settlement_outbox where operation_id = $1`, [op]);
      expect(rows).toEqual([{ attempts: 1, last_error: expect.stringMatching(/did not return within 1500 ms/) }]);
      await waitUntil(async () => (await events(op)).length === 0, 60_000, 'the retried delivery is handled');
      expect(deliveries).toBe(2);
    } finally {
      await outboxd.stop();
    }
  });
});

describe('`outboxd settlements redrive`: every dead letter, each batch one transaction', () => {
  /** What a dead-lettering delivery puts on settled_dead for the operation's event. */
  const deadLetter = (operationId: string) =>
    ({ operationId, orderId: null, kind: 'charge', key: null, status: 'succeeded', externalId: null, amount: 1, currency: 'eur', settledAt: new Date().toISOString(), source: 'admin' });

  it('sends every dead letter back, more than a batch of them', async () => {
    const ops = [];
    for (let i = 0; i < 7; i++) ops.push(await settle());
    await t.pool.query(`delete from outboxd.settlement_outbox where operation_id = any($1::uuid[])`, [ops]);
    await t.boss.insert(SETTLED_DEAD_QUEUE, ops.map((op) => ({ data: deadLetter(op) })));
    expect(await redriveSettlements(t.pool, t.boss, 3)).toBe(7);
    const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.settlement_outbox where operation_id = any($1::uuid[])`, [ops]);
    expect(rows[0].n).toBe(7);
    for (const op of ops) expect((await jobs(SETTLED_DEAD_QUEUE, op)).map((j) => j.state)).toEqual(['completed']);
  });

  it('interrupted between sending the event again and completing its dead letter: nothing changed, no retry spent', async () => {
    const op = await settle();
    await t.pool.query(`delete from outboxd.settlement_outbox where operation_id = $1`, [op]); // as a dead-lettering delivery does
    await t.boss.send(SETTLED_DEAD_QUEUE, deadLetter(op));
    const dead = async () => (await t.pool.query(`select state, retry_count from pgboss.job where name = $1 and data->>'operationId' = $2`, [SETTLED_DEAD_QUEUE, op])).rows;
    const before = await dead();
    // The dead letter's completion, the redrive's last step, fails as a crash there would.
    await t.pool.query(`create function pgboss.interrupt_redrive() returns trigger language plpgsql as $$
      begin raise exception 'the redrive was interrupted'; end $$`);
    await t.pool.query(`create trigger interrupt_redrive after update on pgboss.job for each row
      when (new.name = 'settled_dead' and new.state = 'completed') execute function pgboss.interrupt_redrive()`);
    try {
      await expect(redriveSettlements(t.pool, t.boss)).rejects.toThrow('the redrive was interrupted');
    } finally {
      await t.pool.query(`drop trigger interrupt_redrive on pgboss.job; drop function pgboss.interrupt_redrive()`);
    }
    expect(await events(op)).toEqual([]);
    expect(await dead()).toEqual(before);
    expect(before).toEqual([{ state: 'created', retry_count: 0 }]);

    expect(await redriveSettlements(t.pool, t.boss)).toBeGreaterThanOrEqual(1);
    // Back in the unnamed handlers' table, marked copied: the named subscribers had their own.
    const { rows } = await t.pool.query(`select source, fanned_out from outboxd.settlement_outbox where operation_id = $1`, [op]);
    expect(rows).toEqual([{ source: 'admin', fanned_out: true }]);
    expect((await dead()).map((j) => j.state)).toEqual(['completed']);
  });

  it("a dead letter of an operation that does not exist is completed, not sent", async () => {
    const op = randomUUID();
    await t.boss.send(SETTLED_DEAD_QUEUE, deadLetter(op));
    await redriveSettlements(t.pool, t.boss);
    expect(await events(op)).toEqual([]);
    expect((await jobs(SETTLED_DEAD_QUEUE, op)).map((j) => j.state)).toEqual(['completed']);
  });
});

describe('the unnamed handlers’ table', () => {
  it('while a subscriber is named, an event reaches the unnamed handlers only once the relay copied it to that subscriber', { timeout: 60_000 }, async () => {
    const queue = await subscribeSettlements(t.boss, 'gate');
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: string[] = [];
    try {
      const op = await confirm(t);
      await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op)); // settled, not relayed
      await outboxd.onSettled((event) => {
        seen.push(event.operationId);
      });
      await new Promise((resolve) => setTimeout(resolve, 2_500)); // two idle looks of the delivery
      expect(seen).not.toContain(op);
      await relay(t);
      await waitUntil(() => seen.includes(op), 20_000, 'delivered once copied');
      expect(await jobs(queue, op)).toHaveLength(1);
    } finally {
      await outboxd.stop();
      await t.boss.deleteQueue(queue);
    }
  });

  it('an event whose delivery was never finished (its process died mid-handler) comes back once its lease lapses, not before', { timeout: 60_000 }, async () => {
    const op = await settle();
    // Leased for ten seconds by a delivery that never ends, as a killed process leaves it.
    await t.pool.query(`update outboxd.settlement_outbox set attempts = attempts + 1, leased_until = now() + interval '10 seconds' where operation_id = $1`, [op]);
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: string[] = [];
    try {
      await outboxd.onSettled((event) => {
        seen.push(event.operationId);
      });
      await new Promise((resolve) => setTimeout(resolve, 3_000)); // three of its polls
      expect(seen).not.toContain(op);
      await waitUntil(() => seen.includes(op), 30_000, 'delivered once the lease lapsed');
      await waitUntil(async () => (await events(op)).length === 0, 10_000, 'the handled event goes');
    } finally {
      await outboxd.stop();
    }
  });

  it('an event whose last delivery never finished is delivered alone, so that if it kills its process it takes no other event with it', { timeout: 60_000 }, async () => {
    // A process died with six events in hand, one of which killed it: every lease lapsed. Three new ones wait too.
    const lapsed: string[] = [];
    for (let i = 0; i < 6; i++) lapsed.push(await settle());
    await t.pool.query(`update outboxd.settlement_outbox set attempts = attempts + 1, leased_until = now() - interval '1 second' where operation_id = any($1::uuid[])`, [lapsed]);
    const fresh: string[] = [];
    for (let i = 0; i < 3; i++) fresh.push(await settle());
    const ours = new Set([...lapsed, ...fresh]);
    const ran: { op: string; from: number; to: number }[] = [];
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    try {
      await outboxd.onSettled(async (event) => {
        if (!ours.has(event.operationId)) return;
        const from = performance.now();
        await new Promise((resolve) => setTimeout(resolve, 200));
        ran.push({ op: event.operationId, from, to: performance.now() });
      });
      await waitUntil(() => ran.length === ours.size, 30_000, 'every event handled');
    } finally {
      await outboxd.stop();
    }
    // The fresh ones may run beside each other; a lapsed one runs beside nothing.
    for (const mine of ran.filter((r) => lapsed.includes(r.op))) {
      expect(ran.filter((r) => r !== mine && r.from < mine.to && mine.from < r.to)).toEqual([]);
    }
    expect(ran.filter((r) => fresh.includes(r.op))).toHaveLength(3);
  });

  it('a lapsed event waiting for the handlers in hand when the delivery stops is given back, still lapsed, not run', { timeout: 60_000 }, async () => {
    // The first is taken and held in its handler; only then does the second's lease lapse, so that it is
    // taken lapsed and must wait for the first.
    const inHand = await settle();
    const lapsed = await settle();
    await t.pool.query(`update outboxd.settlement_outbox set attempts = 1, leased_until = now() + interval '1 hour' where operation_id = $1`, [lapsed]);
    const seen: string[] = [];
    let release!: () => void;
    const released = new Promise<void>((resolve) => (release = resolve));
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    try {
      await outboxd.onSettled(async (event) => {
        seen.push(event.operationId);
        if (event.operationId === inHand) await released;
      });
      await waitUntil(() => seen.includes(inHand), 20_000, 'a handler in hand');
      await t.pool.query(`update outboxd.settlement_outbox set leased_until = now() - interval '1 second' where operation_id = $1`, [lapsed]);
      const row = async () => (await t.pool.query(`select attempts, leased_until > now() as leased from outboxd.settlement_outbox where operation_id = $1`, [lapsed])).rows[0];
      await waitUntil(async () => (await row())?.attempts === 2, 20_000, 'the lapsed event taken, waiting to be delivered alone');
      const stopped = outboxd.stop();
      release();
      await stopped;
      expect(seen).not.toContain(lapsed);
      // A look begun before the stop may have taken it once more, and given it back too.
      expect(await row()).toMatchObject({ attempts: expect.toSatisfy((n: number) => n >= 2), leased: false });
    } finally {
      release();
      await outboxd.stop(); // the same stop, when the test got that far
    }
  });

  it('an event whose deliveries kill their process is dead-lettered like one whose handler throws, without running the handler again', { timeout: 60_000 }, async () => {
    const op = await settle();
    // 41 deliveries begun, the last one's lease lapsed with nothing recorded.
    await t.pool.query(`update outboxd.settlement_outbox set attempts = 41, last_error = 'out of memory', leased_until = now() - interval '1 second' where operation_id = $1`, [op]);
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: string[] = [];
    try {
      await outboxd.onSettled((event) => {
        seen.push(event.operationId);
      });
      await waitUntil(async () => (await jobs(SETTLED_DEAD_QUEUE, op)).length === 1, 20_000, 'dead-lettered');
      expect((await jobs(SETTLED_DEAD_QUEUE, op))[0].data.lastError).toMatch(/^out of memory \(then its last deliveries never finished/);
      expect(seen).not.toContain(op);
      expect(await events(op)).toEqual([]);
    } finally {
      await outboxd.stop();
    }
  });

  it('a failure before the last retry puts the event off, keeping its error; the 41st failure dead-letters it', { timeout: 60_000 }, async () => {
    const op = await settle();
    await t.pool.query(`update outboxd.settlement_outbox set attempts = 39 where operation_id = $1`, [op]);
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    try {
      await outboxd.onSettled((event) => {
        if (event.operationId === op) throw new Error('still failing');
      });
      const row = async () => (await t.pool.query(`select attempts, last_error, not_before > now() as later from outboxd.settlement_outbox where operation_id = $1`, [op])).rows[0];
      await waitUntil(async () => (await row())?.last_error === 'still failing', 20_000, 'the 40th failure recorded');
      expect(await row()).toEqual({ attempts: 40, last_error: 'still failing', later: true });
      expect(await jobs(SETTLED_DEAD_QUEUE, op)).toEqual([]);
      await t.pool.query(`update outboxd.settlement_outbox set not_before = now() where operation_id = $1`, [op]);
      await waitUntil(async () => (await jobs(SETTLED_DEAD_QUEUE, op)).length === 1, 20_000, 'the 41st failure dead-lettered');
    } finally {
      await outboxd.stop();
    }
  });

  it("an application's own type parsers (pg's global ones: timestamps and jsonb left as text) change nothing outboxd reads", { timeout: 60_000 }, async () => {
    const { TIMESTAMPTZ, JSONB } = pg.types.builtins;
    const before = [pg.types.getTypeParser(TIMESTAMPTZ), pg.types.getTypeParser(JSONB)] as const;
    pg.types.setTypeParser(TIMESTAMPTZ, (s: string) => s);
    pg.types.setTypeParser(JSONB, (s: string) => s);
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const unnamed: SettlementEvent[] = [];
    const named: SettlementEvent[] = [];
    try {
      await outboxd.onSettled((event) => void unnamed.push(event));
      await outboxd.onSettled((event) => void named.push(event), { subscriber: 'parsers' });
      // A transactional handler's own statements read as the application's connections do: its parsers.
      const readInTransaction: unknown[] = [];
      await outboxd.onSettled(async (event, tx) => {
        readInTransaction.push(event.settledAt, (await tx.query(`select now() as at`)).rows[0].at);
      }, { subscriber: 'parsers-tx', transactional: true });
      const op = await settle();
      await waitUntil(() => unnamed.some((e) => e.operationId === op) && named.some((e) => e.operationId === op) && readInTransaction.length > 0, 20_000, 'the event, to every handler');
      expect(readInTransaction[0]).toBeInstanceOf(Date);
      expect(typeof readInTransaction[1]).toBe('string');
      for (const event of [...unnamed, ...named].filter((e) => e.operationId === op)) {
        expect(event).toMatchObject({ operationId: op, status: 'succeeded', amount: 2599 });
        expect(event.settledAt).toBeInstanceOf(Date);
      }
      const read = await outboxd.getOperation(op);
      expect(read?.createdAt).toBeInstanceOf(Date);
      expect(typeof read?.metadata).toBe('object');
    } finally {
      await outboxd.stop();
      pg.types.setTypeParser(TIMESTAMPTZ, before[0]);
      pg.types.setTypeParser(JSONB, before[1]);
    }
  });

  it("a handler's error holding U+0000 or half a surrogate pair is recorded (as U+FFFD): put off with backoff, as any failure", { timeout: 60_000 }, async () => {
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const calls = { unnamed: 0, named: 0, thrownObject: 0 };
    const orderId = `ord_nul_${randomUUID()}`;
    let op = '';
    let recorded: unknown;
    const bad = 'bad byte \u0000 in the body, then \ud83d';
    try {
      await outboxd.onSettled(async (event) => {
        if (event.orderId !== orderId) return;
        if (++calls.unnamed === 1) throw new Error(bad);
        // Delivered again: what the failure before left on the event.
        recorded = (await t.pool.query(`select last_error from outboxd.settlement_outbox where operation_id = $1`, [event.operationId])).rows[0];
      });
      // A transactional subscriber's failure is pg-boss's to record, as the job's output (jsonb): all of
      // it, nested fields too (an HTTP client's error carrying the response), or a thrown value that is no Error.
      await outboxd.onSettled(
        (event) => {
          if (event.orderId === orderId && ++calls.named === 1) throw Object.assign(new Error('upstream failed'), { response: { status: 502, body: bad }, lines: ['ok', bad] });
        },
        { subscriber: 'nul', transactional: true },
      );
      await outboxd.onSettled(
        (event) => {
          if (event.orderId === orderId && ++calls.thrownObject === 1) throw { message: bad };
        },
        { subscriber: 'nul-object', transactional: true },
      );
      op = await settle({ orderId });
      await waitUntil(async () => (await events(op)).length === 0, 10_000, 'delivered again after its backoff');
      expect(calls.unnamed).toBe(2);
      expect(recorded).toEqual({ last_error: 'bad byte \ufffd in the body, then \ufffd' });
      for (const subscriber of ['nul', 'nul-object']) {
        await waitUntil(async () => (await jobs(`settled.${subscriber}`, op))[0]?.state === 'completed', 20_000, `${subscriber}'s job, retried after its failure`);
      }
      expect(calls).toMatchObject({ named: 2, thrownObject: 2 });
    } finally {
      await outboxd.stop();
    }
  });

  it("a handler's error whose message is no text (an HTTP client's object) is recorded as what it says: put off with backoff, as any failure", { timeout: 60_000 }, async () => {
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const orderId = `ord_message_${randomUUID()}`;
    const recorded: unknown[] = [];
    let calls = 0;
    try {
      await outboxd.onSettled(async (event) => {
        if (event.orderId !== orderId) return;
        calls++;
        if (calls > 1) recorded.push((await t.pool.query(`select last_error from outboxd.settlement_outbox where operation_id = $1`, [event.operationId])).rows[0]);
        if (calls === 1) throw Object.assign(new Error('x'), { message: { code: 'card_declined' } });
        if (calls === 2) throw Object.assign(new Error('x'), { message: Object.create(null) });
      });
      const op = await settle({ orderId });
      await waitUntil(async () => (await events(op)).length === 0, 20_000, 'delivered after two failures, each put off with its backoff');
      expect(recorded).toEqual([{ last_error: 'Error: [object Object]' }, { last_error: '[object Error]' }]);
    } finally {
      await outboxd.stop();
    }
  });

  it('stop() while onSettled is still starting leaves no delivery running (on the application’s pool, which stop() leaves open)', { timeout: 60_000 }, async () => {
    const appPool = new pg.Pool({ connectionString: t.url, max: 4 });
    const outboxd = new Outboxd({ pool: appPool, onError: () => {} });
    const seen: string[] = [];
    try {
      const subscribing = outboxd.onSettled((event) => {
        seen.push(event.operationId);
      });
      await outboxd.stop();
      await subscribing.catch(() => {});
      const op = await settle();
      await new Promise((resolve) => setTimeout(resolve, 2_500));
      expect(seen).not.toContain(op);
      expect(await events(op)).toEqual([{ source: 'dispatcher' }]);
    } finally {
      await appPool.end();
    }
  });

  it('an onSettled that failed to start (not migrated yet) leaves nothing running, and the next one subscribes', { timeout: 60_000 }, async () => {
    const subscriberSessions = async () =>
      (await t.pool.query(`select count(*)::int as n from pg_stat_activity where datname = current_database() and application_name = 'outboxd-boss-subscriber'`)).rows[0].n as number;
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: string[] = [];
    try {
      await t.pool.query('alter table outboxd.settlement_delivery rename to settlement_delivery_later');
      try {
        await expect(outboxd.onSettled(() => {})).rejects.toThrow(/settlement_delivery/);
      } finally {
        await t.pool.query('alter table outboxd.settlement_delivery_later rename to settlement_delivery');
      }
      await waitUntil(async () => (await subscriberSessions()) === 0, 10_000, 'the failed start’s connections to close');
      await outboxd.onSettled((event) => {
        seen.push(event.operationId);
      });
      const op = await settle();
      await waitUntil(() => seen.includes(op), 30_000, 'the event, delivered by the second onSettled');
    } finally {
      await outboxd.stop();
    }
    // A backend leaves pg_stat_activity a moment after its client closed; a connection left open stays.
    await waitUntil(async () => (await subscriberSessions()) === 0, 5_000, 'the subscriber’s connections to close');
  });

  it('an event a worker of an earlier release put on the pg-boss queue `settled` is delivered too (a rolling upgrade)', { timeout: 60_000 }, async () => {
    const op = randomUUID();
    // What the relay of releases before table delivery sent.
    await t.boss.insert(SETTLED_QUEUE, [{ data: { operationId: op, orderId: 'o-1', kind: 'charge', key: null, status: 'succeeded', externalId: 'pi_1', amount: 5, currency: 'eur', settledAt: new Date().toISOString(), source: 'dispatcher', traceparent: null } }]);
    const outboxd = new Outboxd({ connectionString: t.url, onError: () => {} });
    const seen: SettlementEvent[] = [];
    try {
      await outboxd.onSettled((event) => {
        seen.push(event);
      });
      await waitUntil(() => seen.some((e) => e.operationId === op), 30_000, 'the earlier release’s event');
      expect(seen.find((e) => e.operationId === op)).toMatchObject({ orderId: 'o-1', status: 'succeeded', externalId: 'pi_1', hold: null });
      await waitUntil(async () => (await jobs(SETTLED_QUEUE, op))[0]?.state === 'completed', 10_000, 'its job completes');
    } finally {
      await outboxd.stop();
    }
  });
});

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
function cli(...args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, DATABASE_URL: t.url, LOG_LEVEL: 'warn' } });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    child.on('exit', (code) => resolve({ code, stdout, stderr }));
  });
}
