// The unnamed onSettled handlers woken by settlement_outbox's NOTIFY (drizzle/0026_settlement_wake.sql)
// rather than by their poll, and the triggers that send one only while a delivery waits
// (settlement_sleepers): a NOTIFY serializes its senders' commits, so the workers' settling transactions
// must not send one while the handlers are kept busy.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { Outboxd } from '../../src/index.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { deliverSettlements, type SettlementEvent } from '../../src/outbox/settlements.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { claim, confirm } from '../support/fixtures.ts';
import { listening } from '../support/notifications.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

const sleepers = async () => (await t.pool.query(`select delivery_id from outboxd.settlement_sleepers`)).rows.map((r) => r.delivery_id as string);

/** An operation settled by the executor, in the worker's own transaction, which writes its event. */
async function settle(): Promise<string> {
  const op = await confirm(t);
  await executeOperation(t.pool, kindsFor(new FakeStripe()), op, await claim(t, op));
  return op;
}

/** The unnamed handlers' delivery, as an application's Outboxd runs it, polling every 10 minutes: only a
 * NOTIFY wakes it within a test. */
function delivery(handle: (event: SettlementEvent) => Promise<void>, errors: Error[] = []) {
  return deliverSettlements(
    { db: t.pool, pool: t.pool, boss: t.boss, listener: t.boss.getDb() },
    { slots: 10, timeoutMs: 60_000, onError: (err) => errors.push(err), idlePollMs: 600_000 },
    handle,
  );
}

describe("settlement_outbox's triggers", () => {
  it('notify while a delivery waits, for an event inserted or copied to the named subscribers; not otherwise', async () => {
    const insert = (fannedOut = false) =>
      t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source, fanned_out) values (gen_random_uuid(), 'test', $1) returning id`, [fannedOut]);
    await listening(t, t.pool.sql.settlementChannel, async (sent) => {
      try {
        expect(await sent(() => settle())).toEqual([]);
        await t.pool.query(t.pool.sql.settlementSleeps('app-a', 30));
        expect(await sent(() => settle())).toEqual(['']);
        let id = 0;
        expect(await sent(async () => (id = (await insert()).rows[0].id))).toEqual(['']);
        // The relay's copy to the named subscribers: the unnamed handlers may take it now.
        expect(await sent(() => t.pool.query(`update outboxd.settlement_outbox set fanned_out = true where id = $1`, [id]))).toEqual(['']);
        // A delivery's lease, or its failure's backoff, is no new event.
        expect(await sent(() => t.pool.query(`update outboxd.settlement_outbox set attempts = attempts + 1, not_before = now() where id = $1`, [id]))).toEqual([]);
        // A confirmation (charge_outbox) is the relays' business.
        expect(await sent(() => confirm(t))).toEqual([]);
        // A dead application's registration, past its expiry: nobody hears, nobody pays.
        await t.pool.query(`update outboxd.settlement_sleepers set expires_at = now() - interval '1 second'`);
        expect(await sent(() => insert(true))).toEqual([]);
        await t.pool.query(t.pool.sql.settlementWakes('app-a'));
      } finally {
        await t.pool.query(`delete from outboxd.settlement_sleepers; delete from outboxd.settlement_outbox; delete from outboxd.charge_outbox`);
      }
    });
  });
});

describe('a delivery that can LISTEN', () => {
  it('waits registered, delivers an event at once, not after its poll, and leaves when it stops', { timeout: 60_000 }, async () => {
    const seen: string[] = [];
    const errors: Error[] = [];
    const running = delivery(async (event) => void seen.push(event.operationId), errors);
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      const op = await settle();
      await waitUntil(() => seen.includes(op), 15_000, 'delivered');
      await waitUntil(async () => (await t.pool.query(`select 1 from outboxd.settlement_outbox where operation_id = $1`, [op])).rows.length === 0, 10_000, 'the event goes');
    } finally {
      await running.stop();
    }
    expect(await sleepers()).toEqual([]);
    expect(errors).toEqual([]);
  });

  it('under a load, leaves the sleepers while its handlers are busy, and registers again once they all wait', { timeout: 60_000 }, async () => {
    // Ten settled operations whose events are sent again below, ten settling transactions in a row.
    const ops: string[] = [];
    for (let i = 0; i < 10; i++) ops.push(await settle());
    await t.pool.query(`delete from outboxd.settlement_outbox`);
    let release!: () => void;
    const busy = new Promise<void>((resolve) => (release = resolve));
    const seen: string[] = [];
    const running = delivery(async (event) => {
      seen.push(event.operationId);
      await busy;
    });
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      for (const op of ops) await t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source) values ($1, 'dispatcher')`, [op]);
      await waitUntil(() => seen.length === 10, 15_000, 'every handler busy');
      await waitUntil(async () => (await sleepers()).length === 0, 10_000, 'left under the load');
      release();
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered again, idle');
      expect(seen.sort()).toEqual(ops.sort());
    } finally {
      release();
      await running.stop();
    }
  });
});

describe('an application', () => {
  it("with a session connection registers its unnamed handlers' delivery, and leaves at stop()", { timeout: 60_000 }, async () => {
    const app = new Outboxd({ connectionString: t.url, onError: () => {} });
    try {
      await app.onSettled(() => {});
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
    } finally {
      await app.stop();
    }
    expect(await sleepers()).toEqual([]);
  });

  // Last: it takes 0026 away from this test database, as an application started before its migration finds it.
  it('on a schema without settlement_sleepers, says so once and polls', { timeout: 60_000 }, async () => {
    await t.pool.query(`drop trigger settlement_outbox_settled_wake on outboxd.settlement_outbox; drop trigger settlement_outbox_copied_wake on outboxd.settlement_outbox;
                        drop function outboxd.settlement_wake(); drop table outboxd.settlement_sleepers`);
    const errors: Error[] = [];
    const app = new Outboxd({ connectionString: t.url, onError: (err) => errors.push(err) });
    const seen: string[] = [];
    try {
      await app.onSettled((event) => void seen.push(event.operationId));
      const op = await settle();
      await waitUntil(() => seen.includes(op), 15_000, 'delivered by the poll');
      await new Promise((r) => setTimeout(r, 2_500)); // a delivery that kept trying to register would say so each second
      expect(errors.map((e) => (e as { code?: string }).code)).toEqual(['42P01']);
    } finally {
      await app.stop();
    }
  });
});
