// The relay woken by the outboxes' NOTIFY (drizzle/0022_outbox_wake.sql) rather than its poll, and the
// triggers that send one only while a relay sleeps (relay_sleepers): a NOTIFY serializes its senders'
// commits, so the application's confirming transactions under load must not send one.
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation, relay } from '../support/fixtures.ts';
import { listening } from '../support/notifications.ts';
import { waitUntil } from '../../harness/replica.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { subscribeSettlements } from '../../src/outbox/settlements.ts';

let t: TestDb;
let e: RunningEmulator;
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(async () => {
  await relay(t);
});

const channel = () => t.pool.sql.relayChannel;

const sleepers = async () => (await t.pool.query(`select worker_id from outboxd.relay_sleepers order by worker_id`)).rows.map((r) => r.worker_id as string);

describe("the outboxes' triggers", () => {
  it('notify while a relay sleeps, and not when none does or its registration lapsed', async () => {
    const event = () => t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source) values (gen_random_uuid(), 'test')`);
    await listening(t, channel(), async (sent) => {
      try {
        expect(await sent(() => confirm(t))).toEqual([]);
        expect(await sent(event)).toEqual([]);
        await t.pool.query(t.pool.sql.relaySleeps('sleeper-a', 30));
        expect(await sent(() => confirm(t))).toEqual(['']);
        expect(await sent(() => confirm(t))).toEqual(['']);
        expect(await sent(event)).toEqual(['']);
        // An insert that adds no row (a second confirmation of one order) sends none.
        const orderId = `ord_dup_${Date.now()}`;
        expect(await sent(() => confirm(t, { orderId }))).toEqual(['']);
        expect(await sent(() => confirm(t, { orderId }))).toEqual([]);
        // A dead replica's registration, past its expiry: nobody hears, nobody pays.
        await t.pool.query(`update outboxd.relay_sleepers set expires_at = now() - interval '1 second'`);
        expect(await sent(() => confirm(t))).toEqual([]);
        // Registering clears those an hour lapsed.
        await t.pool.query(`update outboxd.relay_sleepers set expires_at = now() - interval '2 hours'`);
        await t.pool.query(t.pool.sql.relaySleeps('sleeper-b', 30));
        expect(await sleepers()).toEqual(['sleeper-b']);
      } finally {
        // Rows, not jobs: a job left behind would be the next test's replica's work.
        await t.pool.query(`delete from outboxd.relay_sleepers; delete from outboxd.charge_outbox; delete from outboxd.settlement_outbox`);
      }
    });
  });
});

describe('a replica that can LISTEN', () => {
  it('sleeps registered, relays an order and its settlement event at once, not after its poll (here 10 minutes), and leaves at its drain', async () => {
    // A named subscriber, so that there is a settlement event to relay (the unnamed handlers take theirs from the table).
    const queue = await subscribeSettlements(t.boss, 'wake');
    const replica = await startDispatcher(t, e.gateway({ timeoutMs: 10_000 }), 'wake-a', { relayIntervalMs: 600_000 });
    try {
      await waitUntil(async () => (await sleepers()).includes('wake-a'), 10_000, 'registered asleep');
      const op = await confirm(t);
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 15_000, 'settled');
      const copied = async () =>
        (await t.pool.query(`select count(*)::int as n from pgboss.job where name = $1 and data->>'operationId' = $2`, [queue, op])).rows[0].n;
      await waitUntil(async () => (await copied()) === 1, 15_000, 'settlement event relayed');
    } finally {
      await replica.stop();
      await t.boss.deleteQueue(queue);
    }
    expect(await sleepers()).toEqual([]);
  });

  it.each([1, 2])('under a load of confirms, %i replica(s) leave the sleepers and poll it: the confirms send next to no NOTIFY', async (replicas) => {
    const ids = Array.from({ length: replicas }, (_, i) => `wake-load-${i}`);
    const running = await Promise.all(ids.map((id) => startDispatcher(t, e.gateway({ timeoutMs: 10_000 }), id, { relayIntervalMs: 50 })));
    try {
      await waitUntil(async () => (await sleepers()).length === replicas, 10_000, 'registered asleep');
      await listening(t, channel(), async (sent) => {
        const confirms = 200;
        const notified = await sent(async () => {
          for (let i = 0; i < confirms; i++) await confirm(t);
        });
        // Each return to sleep costs the next confirms a NOTIFY or three (the third wakes the relay to
        // leave); relays that stayed asleep would have made every confirm and every settlement send one.
        expect(notified.length).toBeLessThan(confirms / 5);
      });
    } finally {
      await Promise.all(running.map((r) => r.stop()));
    }
  });

  // Last: it takes 0022 away from this test database, as a worker started before its migration finds it.
  it('on a schema without relay_sleepers, says so once and polls', async () => {
    await t.pool.query(`drop trigger charge_outbox_wake on outboxd.charge_outbox; drop trigger settlement_outbox_wake on outboxd.settlement_outbox;
                        drop function outboxd.outbox_wake(); drop table outboxd.relay_sleepers`);
    const warnings: string[] = [];
    const log = createLogger('warn', {}, { write: (line: string) => void warnings.push(JSON.parse(line).msg) });
    const replica = await startDispatcher(t, e.gateway({ timeoutMs: 10_000 }), 'wake-old-schema', { relayIntervalMs: 50, log });
    try {
      await waitUntil(async () => warnings.length > 0, 10_000, 'a warning');
      const op = await confirm(t);
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 15_000, 'settled');
      await new Promise((r) => setTimeout(r, 2_500)); // a relay that kept trying to register would warn each second
      expect(warnings).toEqual(['relay_sleepers is missing (migrate); the relay polls']);
    } finally {
      await replica.stop();
    }
  });
});
