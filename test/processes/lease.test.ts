// A worker's own lease deadline (issue 22, part 7): it gives its call up when the lease runs out without
// a renewal, before anyone else can claim, whether the renewal errs, hangs, or the process was stopped
// (SIGSTOP) past it. Told by a reconcile-before-retry effect that counts its executions: two would be the
// duplicate its policy exists to prevent.
import { appendFileSync, readFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startReplica, waitUntil } from '../../harness/replica.ts';
import { CallAbandoned, executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { acquireLease } from '../../src/engine/operation.ts';
import { Outboxd, type EffectDefinition } from '../../src/index.ts';
import type { EffectContext } from '../../src/kinds/application/definition.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { createTestDatabase, inAppTransaction, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { operation } from '../support/fixtures.ts';

let t: TestDb;
let appPool: pg.Pool;
let dir: string;
const apps: Outboxd[] = [];
beforeAll(async () => {
  t = await createTestDatabase();
  appPool = new pg.Pool({ connectionString: t.url, max: 2 });
  dir = await mkdtemp(path.join(tmpdir(), 'outboxd-lease-'));
});
afterAll(async () => {
  for (const o of apps) await o.stop();
  await appPool.end();
  await t.close();
  await rm(dir, { recursive: true, force: true });
});

let n = 0;
async function request(kind: string, def: EffectDefinition): Promise<string> {
  const o = new Outboxd({ connectionString: t.url });
  apps.push(o);
  o.defineEffect(kind, def);
  return (await inAppTransaction(appPool, (tx) => o.requestEffect(tx, kind, { key: `k-${++n}`, payload: { sku: 'sku-1' } }))).operationId;
}

/** The stock service's record, a file that every process appends to: who reserved what. */
const executions = (file: string, op: string) => readFileSync(file, 'utf8').split('\n').filter((l) => l === `executed ${op}`).length;

describe('a renewal that fails never extends the lease: the call is given up before the lease ends', () => {
  it.each([
    ['errs', `raise exception 'renewal refused (injected)'`],
    ['hangs', `perform pg_sleep(30)`],
  ])('a renewal that %s: the signal aborts while the lease is still this worker’s, and the effect does not run', async (_name, body) => {
    const kind = `held_${_name}`;
    let seen: EffectContext | undefined;
    let executed = 0;
    const def: EffectDefinition = {
      policy: 'reconcile-before-retry',
      execute: (ctx) =>
        new Promise((resolve, reject) => {
          seen = ctx;
          // The reservation is made 20 s from now, unless the call is given up first.
          const timer = setTimeout(() => resolve({ reserved: ++executed }), 20_000);
          ctx.signal.addEventListener('abort', () => (clearTimeout(timer), reject(ctx.signal.reason)));
        }),
      check: async () => ({ status: executed ? 'done' : 'not_done' }),
    };
    const op = await request(kind, def);
    // Every renewal of this operation (an update that moves lease_expires_at under the same fence) fails.
    await t.pool.query(`create or replace function outboxd.fail_renewal() returns trigger language plpgsql as $$
      begin if new.fence = old.fence and new.lease_expires_at > old.lease_expires_at then ${body}; end if; return new; end $$`);
    await t.pool.query(`create trigger fail_renewal before update on outboxd.payment_operations for each row when (old.id = '${op}') execute function outboxd.fail_renewal()`);
    const replica = await startDispatcher(t, new FakeStripe(), `renewing-${_name}`, { effects: new Map([[kind, def]]), leaseTtlMs: 3_000 });
    try {
      await waitUntil(() => seen, 20_000, 'the execution starts');
      await waitUntil(() => seen!.signal.aborted, 10_000, 'the call given up');
      // Given up while the lease in the database was still this worker's: nobody else could claim yet.
      const { rows } = await t.pool.query(`select lease_expires_at > now() as held, lease_owner from outboxd.payment_operations where id = $1`, [op]);
      expect(rows[0]).toEqual({ held: true, lease_owner: `renewing-${_name}` });
      expect(seen!.signal.reason).toBeInstanceOf(CallAbandoned);
      expect(String(seen!.signal.reason)).toMatch(/deadline passed without a renewal/);
      expect(await operation(t, op)).toMatchObject({ status: 'pending', last_outcome: null });
      expect(executed).toBe(0);
    } finally {
      // A hanging renewal holds its lock on the table, which dropping the trigger waits for.
      const wake = () => t.pool.query(`select pg_cancel_backend(pid) from pg_stat_activity where datname = current_database() and wait_event = 'PgSleep' and pid <> pg_backend_pid()`);
      await wake();
      await replica.stop();
      await wake();
      await t.pool.query(`drop trigger fail_renewal on outboxd.payment_operations`);
    }
  });
});

describe('a replica stopped past its lease (SIGSTOP) sends nothing when it wakes', () => {
  it('another replica checks and reserves once; the woken one gives its call up: one execution', async () => {
    const log = path.join(dir, 'stock.log');
    const module = path.join(dir, 'effects.mjs');
    await writeFile(log, '');
    // The replica's reservation: 8 s after it starts (the stock service is slow), unless given up.
    await writeFile(
      module,
      `import { appendFileSync, readFileSync } from 'node:fs';
       const LOG = ${JSON.stringify(log)};
       export default {
         stock_hold: {
           policy: 'reconcile-before-retry',
           execute: ({ operationId, signal }) => new Promise((resolve, reject) => {
             appendFileSync(LOG, 'started ' + operationId + '\\n');
             const timer = setTimeout(() => { appendFileSync(LOG, 'executed ' + operationId + '\\n'); resolve({ by: 'replica' }); }, 8000);
             signal.addEventListener('abort', () => { clearTimeout(timer); reject(signal.reason); });
           }),
           check: async ({ operationId }) => readFileSync(LOG, 'utf8').includes('executed ' + operationId) ? { status: 'done' } : { status: 'not_done' },
         },
       };`,
    );
    // The other replica (this process): the same kind, reserving at once.
    const here: EffectDefinition = {
      policy: 'reconcile-before-retry',
      execute: async ({ operationId }) => (appendFileSync(log, `executed ${operationId}\n`), { by: 'other' }),
      check: async ({ operationId }) => (executions(log, operationId) ? { status: 'done' } : { status: 'not_done' }),
    };
    const replica = await startReplica(
      { DATABASE_URL: t.url, LEASE_TTL_MS: '3000', STRIPE_TIMEOUT_MS: '2000', LOG_LEVEL: 'info' },
      { args: ['--effects', module] },
    );
    try {
      const op = await request('stock_hold', here);
      await waitUntil(() => readFileSync(log, 'utf8').includes(`started ${op}`), 30_000, 'the replica’s call under way');
      const startedAt = performance.now();
      replica.kill('SIGSTOP');
      // Its lease runs out in the database; the other replica claims, checks (not done) and reserves.
      const effects = new Map([['stock_hold', here]]);
      await waitUntil(async () => {
        const fence = await acquireLease(t.pool, op, 'other-replica', 30_000);
        if (fence === undefined) return false;
        await executeOperation(t.pool, kindsFor(new FakeStripe(), effects), op, fence, { log: createLogger('silent') });
        return (await operation(t, op)).status === 'succeeded';
      }, 30_000, 'the other replica to settle it');
      // Woken once the stopped call's own timer is due: without a deadline of its own it would reserve now.
      await waitUntil(() => performance.now() > startedAt + 9_000, 20_000, 'the stopped call’s timer to be due');
      replica.kill('SIGCONT');
      await waitUntil(() => replica.logs.some((l) => String(l.msg).startsWith('call abandoned') || l.msg === 'gateway call finished'), 20_000, 'the woken replica to end its call');
      expect(executions(log, op)).toBe(1);
      expect(replica.logs.find((l) => String(l.msg).startsWith('call abandoned'))).toMatchObject({ reason: expect.stringMatching(/deadline passed/) });
      expect(await operation(t, op)).toMatchObject({ status: 'succeeded', result: { by: 'other' } });
    } finally {
      replica.kill('SIGCONT');
      replica.kill('SIGKILL');
      await replica.exited;
    }
  });
});
