// The relay woken by the outboxes' NOTIFY (drizzle/0022_outbox_wake.sql) rather than its poll, and the
// triggers that send one only when rows arrive in an empty outbox (a NOTIFY serializes its senders'
// commits: the application's confirming transactions under load must not pay for it).
import pg from 'pg';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation, relay } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

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

describe("the outboxes' triggers", () => {
  it('notify when rows arrive in an empty outbox, and not while rows wait', async () => {
    const listener = new pg.Client({ connectionString: t.url });
    await listener.connect();
    const heard: string[] = [];
    listener.on('notification', (n) => heard.push(n.payload ?? ''));
    await listener.query(`listen "${channel()}"`);
    // Notifications arrive in commit order: one sent after a write shows whether the write sent one.
    const after = async (write: () => Promise<unknown>) => {
      const marker = `marker-${heard.length}`;
      await write();
      await t.pool.query('select pg_notify($1, $2)', [channel(), marker]);
      await waitUntil(async () => heard.includes(marker), 10_000, marker);
      return heard.splice(0).filter((p) => p !== marker);
    };
    try {
      expect(await after(() => confirm(t))).toEqual(['']);
      expect(await after(() => confirm(t))).toEqual([]); // the first one's row still waits
      expect(await after(() => relay(t))).toEqual([]);
      expect(await after(() => confirm(t))).toEqual(['']);
      await relay(t);
      // The settlement outbox alike (its relay drops an event whose operation does not exist).
      const event = () => t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source) values (gen_random_uuid(), 'test')`);
      expect(await after(event)).toEqual(['']);
      expect(await after(event)).toEqual([]);
    } finally {
      await relay(t);
      await listener.end();
    }
  });
});

describe('a replica that can LISTEN', () => {
  it('relays an order and its settlement event at once, not after its poll (here 10 minutes)', async () => {
    const replica = await startDispatcher(t, e.gateway({ timeoutMs: 10_000 }), 'wake-a', { relayIntervalMs: 600_000 });
    try {
      const op = await confirm(t);
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 15_000, 'settled');
      const settlementWaiting = async () =>
        (await t.pool.query(`select count(*)::int as n from outboxd.settlement_outbox where operation_id = $1`, [op])).rows[0].n;
      await waitUntil(async () => (await settlementWaiting()) === 0, 15_000, 'settlement event relayed');
    } finally {
      await replica.stop();
    }
  });
});
