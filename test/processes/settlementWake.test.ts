// The unnamed onSettled handlers woken by settlement_outbox's NOTIFY (drizzle/0026_settlement_wake.sql)
// rather than by their poll, and the triggers that send one only while a delivery waits
// (settlement_sleepers): a NOTIFY serializes its senders' commits, so the workers' settling transactions
// must not send one while the handlers are kept busy.
import pg from 'pg';
import type { Db as IDatabase } from 'pg-boss';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import type { Queryable } from '../../src/db/pool.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { Outboxd } from '../../src/index.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { deliverSettlements, type SettlementEvent } from '../../src/outbox/settlements.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { claim, confirm } from '../support/fixtures.ts';
import { listening } from '../support/notifications.ts';
import { freePort } from '../../src/db/embedded.ts';

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

/** The unnamed handlers' delivery, as an application's Outboxd runs it; by default polling every 10
 * minutes, so that only a NOTIFY wakes it within a test. */
function delivery(
  handle: (event: SettlementEvent) => Promise<void>,
  { errors = [] as Error[], idlePollMs = 600_000, rejoinAfterMs = 5_000, slots = 10, db = t.pool as Queryable, listener = t.boss.getDb() as Pick<IDatabase, 'listen'> } = {},
) {
  return deliverSettlements({ db, pool: t.pool, boss: t.boss, listener }, { slots, timeoutMs: 60_000, onError: (err) => errors.push(err), idlePollMs, rejoinAfterMs }, handle);
}

/** Ten settled operations, their events taken away: to be sent again as a test needs them. */
async function settledOperations(n: number): Promise<string[]> {
  const ops: string[] = [];
  for (let i = 0; i < n; i++) ops.push(await settle());
  await t.pool.query(`delete from outboxd.settlement_outbox`);
  return ops;
}
const eventOf = (op: string) => t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source) values ($1, 'dispatcher')`, [op]);

/** The delivery registered while the events of `ops` trickle in, one every 400 ms; then the trickle's end. */
async function registersWhileTrickling(ops: string[], what: string): Promise<void> {
  let trickling = true;
  const trickle = (async () => {
    for (const op of ops) {
      await eventOf(op);
      await new Promise((r) => setTimeout(r, 400));
    }
    trickling = false;
  })();
  await waitUntil(async () => (await sleepers()).length === 1, 10_000, what);
  expect(trickling).toBe(true);
  await trickle;
}

describe("settlement_outbox's triggers", () => {
  it('notify while a delivery waits, for an event inserted or copied to the named subscribers; not otherwise', async () => {
    const insert = (fannedOut = false) =>
      t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source, fanned_out) values (gen_random_uuid(), 'test', $1) returning id`, [fannedOut]);
    await listening(t, t.pool.sql.settlementChannel, async (sent) => {
      try {
        expect(await sent(() => settle())).toEqual([]);
        await t.pool.query(t.pool.sql.settlementSleeps('app-a', 30, 3));
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

describe('a delivery stopping', () => {
  it('gives back, still lapsed, an event whose last delivery lapsed that a look begun before stop() took', { timeout: 60_000 }, async () => {
    const op = await settle();
    await t.pool.query(`update outboxd.settlement_outbox set attempts = 1, leased_until = now() - interval '1 second' where operation_id = $1`, [op]);
    // Every take answers half a second late: stop() comes while they are under way.
    const slow: Queryable = {
      sql: t.pool.sql,
      query: (async (q: { name?: string }) => {
        const result = await t.pool.query(q as never);
        if (q.name?.startsWith('outboxd_take_settlement_event')) await new Promise((r) => setTimeout(r, 500));
        return result;
      }) as unknown as Queryable['query'],
    };
    const seen: string[] = [];
    const running = delivery(async (event) => void seen.push(event.operationId), { db: slow, slots: 1 });
    await new Promise((r) => setTimeout(r, 100));
    await running.stop();
    expect(seen).toEqual([]);
    expect((await t.pool.query(`select attempts, leased_until <= now() as lapsed from outboxd.settlement_outbox where operation_id = $1`, [op])).rows).toEqual([{ attempts: 2, lapsed: true }]);
    await t.pool.query(`delete from outboxd.settlement_outbox where operation_id = $1`, [op]);
  });
});

describe('a delivery that can LISTEN', () => {
  it('waits registered, delivers an event at once, not after its poll, and leaves when it stops', { timeout: 60_000 }, async () => {
    const seen: string[] = [];
    const errors: Error[] = [];
    const running = delivery(async (event) => void seen.push(event.operationId), { errors });
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      await new Promise((r) => setTimeout(r, 1_000)); // every loop's first look done: all asleep
      const op = await settle();
      await waitUntil(() => seen.includes(op), 15_000, 'delivered');
      await waitUntil(async () => (await t.pool.query(`select 1 from outboxd.settlement_outbox where operation_id = $1`, [op])).rows.length === 0, 10_000, 'the event goes');
    } finally {
      await running.stop();
    }
    expect(await sleepers()).toEqual([]);
    expect(errors).toEqual([]);
  });

  it('with a handler hung on one event, the other loops wait registered and deliver the next event at once', { timeout: 60_000 }, async () => {
    const [stuck, next] = await settledOperations(2);
    await eventOf(stuck!); // taken at the start, by a handler that never returns
    let release!: () => void;
    const hung = new Promise<void>((resolve) => (release = resolve));
    const seen: string[] = [];
    const running = delivery(async (event) => {
      seen.push(event.operationId);
      if (event.operationId === stuck) await hung;
    });
    try {
      await waitUntil(() => seen.includes(stuck!), 10_000, 'the stuck event taken');
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      await eventOf(next!);
      await waitUntil(() => seen.includes(next!), 15_000, 'the next event delivered');
    } finally {
      release();
      await running.stop();
    }
  });

  it('under a load, leaves the sleepers while its handlers are busy, and registers again once they all wait', { timeout: 60_000 }, async () => {
    const ops = await settledOperations(10);
    let release!: () => void;
    const busy = new Promise<void>((resolve) => (release = resolve));
    const seen: string[] = [];
    const running = delivery(
      async (event) => {
        seen.push(event.operationId);
        await busy;
      },
      { idlePollMs: 1_000 },
    );
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      for (const op of ops) await eventOf(op); // ten settling transactions in a row
      await waitUntil(() => seen.length === 10, 15_000, 'every handler busy');
      await waitUntil(async () => (await sleepers()).length === 0, 10_000, 'left under the load');
      release();
      await waitUntil(async () => (await sleepers()).length === 1, 20_000, 'registered again, idle');
      expect(seen.sort()).toEqual(ops.sort());
    } finally {
      release();
      await running.stop();
    }
  });

  it('under a trickle of events, begun while it delivered a backlog, registers while they trickle in', { timeout: 60_000 }, async () => {
    const ops = await settledOperations(15);
    for (const op of ops.slice(0, 5)) await eventOf(op); // waiting when it starts
    let delivered = 0;
    const running = delivery(async () => void delivered++, { idlePollMs: 1_000 });
    try {
      await registersWhileTrickling(ops.slice(5), 'registered while events trickle in');
      await waitUntil(() => delivered === ops.length, 15_000, 'every event delivered');
    } finally {
      await running.stop();
    }
  });

  it('after leaving under a burst, registers again while events trickle in', { timeout: 60_000 }, async () => {
    const ops = await settledOperations(22);
    const running = delivery(async () => {}, { idlePollMs: 1_000, rejoinAfterMs: 1_000 });
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      for (const op of ops.slice(0, 12)) await eventOf(op); // a burst
      await waitUntil(async () => (await sleepers()).length === 0, 10_000, 'left under the burst');
      await registersWhileTrickling(ops.slice(12), 'registered again while events trickle in');
    } finally {
      await running.stop();
    }
  });

  it('no more than three deliveries wait registered at once: a NOTIFY wakes a loop in each, and one suffices', { timeout: 60_000 }, async () => {
    // One after another: two that register at the same instant may both count two others (the next
    // renewal of each then counts three, and leaves).
    const running: ReturnType<typeof delivery>[] = [];
    try {
      for (let n = 1; n <= 3; n++) {
        running.push(delivery(async () => {}));
        await waitUntil(async () => (await sleepers()).length === n, 10_000, `${n} registered`);
      }
      running.push(delivery(async () => {}));
      await new Promise((r) => setTimeout(r, 1_500));
      expect(await sleepers()).toHaveLength(3);
    } finally {
      await Promise.all(running.map((r) => r.stop()));
    }
    expect(await sleepers()).toEqual([]);
  });

  it('under a steady flow of events, stays away while its polls find them: the settling transactions send next to no NOTIFY', { timeout: 60_000 }, async () => {
    const ops = await settledOperations(150);
    let delivered = 0;
    const running = delivery(async () => void delivered++, { idlePollMs: 1_000 });
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      await listening(t, t.pool.sql.settlementChannel, async (sent) => {
        const notified = await sent(async () => {
          for (const op of ops) {
            await eventOf(op);
            await new Promise((r) => setTimeout(r, 20)); // about 40 a second, for about four seconds
          }
        });
        // Ten to leave; a delivery that registered again whenever its loops all waited (between two
        // events) would have had most of them NOTIFY; this one stays away for longer than the flow lasts.
        expect(notified.length).toBeLessThan(30);
      });
      await waitUntil(() => delivered === ops.length, 15_000, 'every event delivered');
    } finally {
      await running.stop();
    }
  });

  it('a NOTIFY missed while its listener reconnects is made up for at the reconnect, not at the poll', { timeout: 60_000 }, async () => {
    const [op] = await settledOperations(1);
    const seen: string[] = [];
    const quiet = () => {};
    t.boss.on('error', quiet); // where the listener's lost connection is reported
    const running = delivery(async (event) => void seen.push(event.operationId));
    try {
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      await new Promise((r) => setTimeout(r, 1_000)); // every loop's first look done: all asleep
      const { rows } = await t.pool.query(`select pid from pg_stat_activity where datname = current_database() and query like 'LISTEN "outboxd_settlements%'`);
      expect(rows).toHaveLength(1);
      await t.pool.query('select pg_terminate_backend($1)', [rows[0].pid]);
      await waitUntil(async () => (await t.pool.query('select 1 from pg_stat_activity where pid = $1', [rows[0].pid])).rows.length === 0, 10_000, 'the listener gone');
      await eventOf(op!); // its NOTIFY reaches nobody: the listener reconnects a second later
      await waitUntil(() => seen.includes(op!), 20_000, 'delivered at the reconnect');
    } finally {
      await running.stop();
      t.boss.off('error', quiet);
    }
  });

  it('while its LISTEN cannot connect (a direct URL that never answers), it polls, and stop() returns', { timeout: 60_000 }, async () => {
    const [op] = await settledOperations(1);
    const seen: string[] = [];
    const running = delivery(async (event) => void seen.push(event.operationId), { idlePollMs: 1_000, listener: { listen: () => new Promise<never>(() => {}) } });
    await new Promise((r) => setTimeout(r, 500)); // every loop's first look done
    await eventOf(op!);
    await waitUntil(() => seen.includes(op!), 15_000, 'delivered by the poll');
    const stopped = await Promise.race([running.stop().then(() => 'stopped'), new Promise((r) => setTimeout(() => r('hung'), 10_000))]);
    expect(stopped).toBe('stopped');
  });

  it('stop() while its LISTEN still connects (here half a second) returns once that connection is closed, leaving none open', { timeout: 60_000 }, async () => {
    const listens: string[] = [];
    const slowListener: Pick<IDatabase, 'listen'> = {
      listen: async (channel, onNotification, onReconnect) => {
        await new Promise((r) => setTimeout(r, 500));
        const handle = await t.boss.getDb().listen!(channel, onNotification, onReconnect);
        listens.push('up');
        return {
          close: async () => {
            await handle.close();
            listens.push('closed');
          },
        };
      },
    };
    const running = delivery(async () => {}, { listener: slowListener });
    await running.stop();
    expect(listens).toEqual(['up', 'closed']);
  });

  it('stop() while the last loop registers, and the registration then fails, returns', { timeout: 60_000 }, async () => {
    // Every statement as the pool runs it, but the registration: refused half a second on, as to a
    // role that may not write settlement_sleepers, after stop() woke the loops.
    let registering!: () => void;
    const registeringStarted = new Promise<void>((resolve) => (registering = resolve));
    const db = {
      sql: t.pool.sql,
      query: async (statement: pg.QueryConfig) => {
        if (!statement.name?.startsWith('outboxd_settlement_sleeps')) return t.pool.query(statement);
        registering();
        await new Promise((r) => setTimeout(r, 500));
        throw Object.assign(new Error('permission denied for table settlement_sleepers'), { code: '42501' });
      },
    };
    const running = delivery(async () => {}, { slots: 2, db: db as unknown as Queryable });
    await registeringStarted;
    const stopped = await Promise.race([running.stop().then(() => 'stopped'), new Promise((r) => setTimeout(() => r('hung'), 10_000))]);
    expect(stopped).toBe('stopped');
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

  it("on its own pool with directConnectionString, LISTENs there: its handlers' delivery and startWorker's relay are woken, not polling", { timeout: 60_000 }, async () => {
    const pool = new pg.Pool({ connectionString: t.url, max: 6 });
    process.env.LOG_LEVEL = 'silent'; // startWorker reads the worker's settings from the environment
    const app = new Outboxd({ pool, directConnectionString: t.url, onError: () => {} });
    const listeners = async () =>
      // pg-boss's listener checks its LISTEN every 10 s on the same session: that check is its last query then.
      (await t.pool.query(`select application_name from pg_stat_activity
         where datname = current_database() and (query like 'LISTEN%' or query like '%pg_listening_channels%') order by 1`)).rows.map((r) => r.application_name as string);
    try {
      await app.onSettled(() => {});
      await waitUntil(async () => (await sleepers()).length === 1, 10_000, 'registered');
      await app.startWorker({ concurrency: 1 });
      await waitUntil(async () => (await listeners()).includes('outboxd-boss-worker'), 10_000, "the worker's LISTEN");
      expect(await listeners()).toContain('outboxd-boss-subscriber');
    } finally {
      await app.stop();
      await pool.end();
    }
    expect(await sleepers()).toEqual([]);
  });

  it("whose directConnectionString cannot be reached hears pg-boss's warning that it polls, through onError", { timeout: 60_000 }, async () => {
    const pool = new pg.Pool({ connectionString: t.url, max: 6 });
    const closed = new URL(t.url);
    closed.port = String(await freePort()); // nothing listens there
    const errors: Error[] = [];
    const app = new Outboxd({ pool, directConnectionString: closed.href, onError: (err) => errors.push(err) });
    try {
      await app.onSettled(() => {});
      await waitUntil(() => errors.some((e) => e.message.startsWith('pg-boss: Failed to start LISTEN/NOTIFY listener')), 20_000, "pg-boss's warning");
    } finally {
      await app.stop();
      await pool.end();
    }
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
