// outboxd never waits on the application: an application transaction holding a lock on an operation's
// row (select … for update), on a settled one whose job is delivered again or on a pending one, for 30 s,
// delays no other operation, and the locked pending one settles once the lock is released.
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher, type InProcessReplica } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation } from '../support/fixtures.ts';

const HELD_MS = 30_000;

let t: TestDb;
let e: RunningEmulator;
let appPool: pg.Pool;
const replicas: InProcessReplica[] = [];

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  appPool = new pg.Pool({ connectionString: t.url, max: 4 });
});
afterAll(async () => {
  for (const r of replicas) await r.stop();
  await appPool.end();
  await t.close();
  await e.close();
});

/** An application transaction that locks the operation's row until release() (rolled back then); `for key
 * share` is what a foreign key's check takes, inserting a row of the application's that names it. */
async function lockRow(id: string, strength: 'update' | 'key share' = 'update'): Promise<{ release(): Promise<void> }> {
  const client = await appPool.connect();
  await client.query('begin');
  await client.query(`select id from "${t.schema}".payment_operations where id = $1 for ${strength}`, [id]);
  return {
    release: async () => {
      await client.query('rollback');
      client.release();
    },
  };
}

const statusOf = async (id: string) => (await operation(t, id)).status;

describe('an application transaction holding an operation’s row', () => {
  it('for 30 s delays no other operation; the locked pending one settles after the release', async () => {
    const settled = await confirm(t, { orderId: 'locks-settled' });
    const first = await startDispatcher(t, e.gateway(), 'w-locks-1', { concurrency: 2 });
    replicas.push(first);
    await waitUntil(async () => (await statusOf(settled)) === 'succeeded', 60_000, 'the first charge to settle');
    await first.stop();
    replicas.pop();

    const pending = await confirm(t, { orderId: 'locks-pending' });
    const others: string[] = [];
    for (let i = 0; i < 4; i++) others.push(await confirm(t, { orderId: `locks-other-${i}` }));
    const locks = [await lockRow(settled), await lockRow(pending)];
    const heldUntil = Date.now() + HELD_MS;
    try {
      // The settled operation's job delivered again (pg-boss is at least once).
      await t.boss.send('charge', { operationId: settled });
      replicas.push(await startDispatcher(t, e.gateway(), 'w-locks-2', { concurrency: 2 }));
      await waitUntil(async () => (await Promise.all(others.map(statusOf))).every((s) => s === 'succeeded'), HELD_MS - 5_000, 'the other charges to settle while the locks are held');
      expect(Date.now()).toBeLessThan(heldUntil);
      expect(await statusOf(pending)).toBe('pending');
      await new Promise((resolve) => setTimeout(resolve, Math.max(0, heldUntil - Date.now())));
    } finally {
      for (const lock of locks) await lock.release();
    }
    // Skipped, not dropped: its job is retried and settles it.
    await waitUntil(async () => (await statusOf(pending)) === 'succeeded', 120_000, 'the locked charge to settle after the release');
    const { rows } = await t.pool.query(`select state from pgboss.job where name in ('charge_dead') and data->>'operationId' = $1`, [pending]);
    expect(rows).toEqual([]);
  }, 300_000);

  it("taken while its call is in flight, holds up no other operation's outcome: theirs are recorded as their calls return", async () => {
    const locked = await confirm(t, { orderId: 'locks-in-flight' });
    const others: string[] = [];
    for (let i = 0; i < 3; i++) others.push(await confirm(t, { orderId: `locks-in-flight-other-${i}` }));
    e.emulator.addFault({ match: { operationId: locked }, fault: { kind: 'latency', ms: 1_500 } });
    for (const op of others) e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 1_700 } });
    const replica = await startDispatcher(t, e.gateway({ timeoutMs: 5_000 }), 'w-locks-3', { concurrency: 8, leaseTtlMs: 12_000 });
    replicas.push(replica);
    await waitUntil(async () => (await operation(t, locked)).attempts === 1, 10_000, 'its call in flight');
    const lock = await lockRow(locked);
    try {
      await waitUntil(async () => (await Promise.all(others.map(statusOf))).every((s) => s === 'succeeded'), 30_000, 'the others settled');
      // From their call's send to their outcome: the call's 1.7 s, not the held row's lock_timeout (5 s) too.
      for (const op of others) {
        const row = await operation(t, op);
        expect(row.settled_at!.getTime() - row.last_attempted_at!.getTime()).toBeLessThan(4_000);
      }
    } finally {
      await lock.release();
    }
    // Its own outcome waited for the lock alone; written then, or its job retried with the same key.
    await waitUntil(async () => (await statusOf(locked)) === 'succeeded', 60_000, 'the locked one settled after the release');
  }, 120_000);

  it("a foreign key's check on it (an application's row naming the operation) holds up not even its own outcome", async () => {
    const named = await confirm(t, { orderId: 'locks-key-share' });
    e.emulator.addFault({ match: { operationId: named }, fault: { kind: 'latency', ms: 1_000 } });
    const replica = await startDispatcher(t, e.gateway({ timeoutMs: 5_000 }), 'w-locks-4', { concurrency: 2, leaseTtlMs: 12_000 });
    replicas.push(replica);
    await waitUntil(async () => (await operation(t, named)).attempts === 1, 10_000, 'its call in flight');
    const lock = await lockRow(named, 'key share');
    try {
      await waitUntil(async () => (await statusOf(named)) === 'succeeded', 10_000, 'settled while the key share is held');
      const row = await operation(t, named);
      expect(row.settled_at!.getTime() - row.last_attempted_at!.getTime()).toBeLessThan(3_000);
    } finally {
      await lock.release();
    }
  }, 60_000);
});
