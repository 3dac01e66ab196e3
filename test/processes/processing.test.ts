// Payments that take days (SEPA Debit, ACH: a PaymentIntent `processing`, a Refund `pending`): waiting,
// not stuck (src/engine/processing.ts). In-process replicas against the emulator over HTTP and a real
// PostgreSQL. Time is never waited for: a scheduled job is brought forward (start_after) and the moment it
// first waited is moved back (processing_since), as days passing would.
import type Stripe from 'stripe';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { bossDb, inTransaction, type Tx } from '../../src/db/pool.ts';
import { callTable, executeOperation, KEY_WINDOW_SECONDS } from '../../src/engine/executor.ts';
import { claimAttempt, StaleFenceError, type Operation, type Outcome } from '../../src/engine/operation.ts';
import { processingCheckDelaySeconds } from '../../src/engine/processing.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { requestRefund } from '../../src/kinds/refund/request.ts';
import { enqueueOperation } from '../../src/outbox/outbox.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { operationRecord } from '../../src/console/queries.ts';
import { timeline } from '../../src/console/timeline.ts';
import { operationPage } from '../../src/console/views/operation.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { idempotencyKeyFor } from '../../src/stripe/gateway.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher, type InProcessReplica } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation, relay } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

let t: TestDb;
let e: RunningEmulator;
const replicas: InProcessReplica[] = [];
const log = createLogger('silent');
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.reset());
afterEach(async () => {
  for (const r of replicas.splice(0)) await r.stop();
  await t.pool.query(`delete from pgboss.job where name in ('charge', 'charge_dead', 'refund', 'refund_dead')`);
  await t.pool.query(`delete from outboxd.charge_outbox`);
});

const dispatcher = async (opts: { processingReviewDays?: number } = {}) => {
  const r = await startDispatcher(t, e.gateway(), `replica-${replicas.length}`, opts);
  replicas.push(r);
  return r;
};
const createsFor = (op: string) => e.emulator.requests().filter((r) => r.endpoint === 'create' && r.operationId === op);
const retrievesOf = (pi: string) => e.emulator.requests().filter((r) => r.endpoint === 'retrieve' && r.path.includes(pi));
const jobsOf = async (op: string, queue = 'charge') =>
  (await t.pool.query(
    `select id, state, retry_count, extract(epoch from start_after - now())::float as starts_in from pgboss.job where name = $1 and data->>'operationId' = $2 order by created_on`,
    [queue, op],
  )).rows as { id: string; state: string; retry_count: number; starts_in: number }[];
const scheduledJob = async (op: string, queue = 'charge') => (await jobsOf(op, queue)).find((j) => j.state === 'created');
/** The scheduled check, brought forward: as if its delay had passed. */
const checkNow = (op: string) => t.pool.query(`update pgboss.job set start_after = now() where state = 'created' and data->>'operationId' = $1`, [op]);
/** The payment first waited this long ago. */
const waitedFor = (op: string, interval: string) =>
  t.pool.query(`update outboxd.payment_operations set processing_since = now() - $2::interval where id = $1`, [op, interval]);
const checks = async (op: string) =>
  (await t.pool.query(`select count(*)::int as n from outboxd.operation_events where operation_id = $1 and type = 'outcome' and details->>'outcome' = 'processing'`, [op])).rows[0].n as number;

/** A processing charge as its first job leaves it: waiting, with the next check scheduled. Its job may
 * spend no retry (retry_limit 0): one spent would dead-letter it. */
async function waiting(paymentMethod = 'pm_card_processing'): Promise<{ op: string; pi: string }> {
  const op = await confirm(t, { paymentMethod });
  await relay(t);
  await t.pool.query(`update pgboss.job set retry_limit = 0 where name = 'charge' and data->>'operationId' = $1`, [op]);
  if (replicas.length === 0) await dispatcher();
  const row = await waitUntil(async () => {
    const o = await operation(t, op);
    return o.next_check_at && (await scheduledJob(op)) ? o : undefined;
  }, 20_000, 'the first check to be scheduled');
  return { op, pi: row.external_id! };
}

describe('a processing payment waits, and is never created again', () => {
  it('its job completes and a fresh one is scheduled a minute later, spending no retry; the delay grows; it settles by retrieve', async () => {
    const { op, pi } = await waiting();
    const first = await operation(t, op);
    expect(first).toMatchObject({ status: 'unknown', last_outcome: 'processing', needs_review: false, external_id: expect.stringMatching(/^pi_/) });
    expect(first.processing_since).toBeInstanceOf(Date);
    const jobs = await jobsOf(op);
    expect(jobs.map((j) => [j.state, j.retry_count])).toEqual([['completed', 0], ['created', 0]]);
    expect(jobs[1]!.starts_in).toBeGreaterThan(50);
    expect(jobs[1]!.starts_in).toBeLessThanOrEqual(60);
    const { rows: nextIn } = await t.pool.query(`select extract(epoch from next_check_at - now())::float as s from outboxd.payment_operations where id = $1`, [op]);
    expect(nextIn[0].s).toBeGreaterThan(50);
    expect(nextIn[0].s).toBeLessThanOrEqual(60);

    // Three hours later the next check is two hours away: the schedule slows down.
    await waitedFor(op, '3 hours');
    await checkNow(op);
    await waitUntil(async () => (await checks(op)) === 2 && (await scheduledJob(op)), 20_000, 'the second check');
    expect((await scheduledJob(op))!.starts_in).toBeGreaterThan(7_100);
    expect((await operation(t, op)).processing_since!.getTime()).toBeLessThan(Date.now() - 2.9 * 3_600_000); // kept from the first

    e.emulator.settle(pi, 'succeeded');
    await checkNow(op);
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'settled');
    expect(await operation(t, op)).toMatchObject({ needs_review: false, next_check_at: null });
    // One create under the operation's key; every later look was a retrieve (invariant 6).
    expect(createsFor(op).map((r) => r.idempotencyKey)).toEqual([idempotencyKeyFor(op)]);
    expect(retrievesOf(pi)).toHaveLength(2);
    expect(e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === op)).toHaveLength(1);
    expect(await jobsOf(op, 'charge_dead')).toEqual([]);
  });

  it('a late failure arrives by webhook: failed, with its settlement event; the scheduled job then completes without a call', async () => {
    const { op, pi } = await waiting();
    e.emulator.settle(pi, 'requires_payment_method');
    const event = { id: `evt_${op}`, type: 'payment_intent.payment_failed', data: { object: { id: pi } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, event)).toBe('settled');
    expect(await operation(t, op)).toMatchObject({ status: 'failed', external_id: pi, next_check_at: null, last_error: expect.stringMatching(/requires_payment_method/) });
    const { rows: settlementEvents } = await t.pool.query(`select source from outboxd.settlement_outbox where operation_id = $1`, [op]);
    expect(settlementEvents).toEqual([{ source: 'webhook' }]);

    const scheduled = (await scheduledJob(op))!;
    const seen = e.emulator.requests().length;
    await checkNow(op);
    await waitUntil(async () => (await jobsOf(op)).find((j) => j.id === scheduled.id)?.state === 'completed', 20_000, 'the scheduled job to complete');
    expect(e.emulator.requests()).toHaveLength(seen); // it found the operation settled: no call
    expect(await scheduledJob(op)).toBeUndefined();
    expect(createsFor(op)).toHaveLength(1);
  });

  it('a replica whose lease was taken over neither writes its processing outcome nor schedules a check (invariant 8)', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    const kinds = kindsFor(e.gateway());
    const claimFor = async (owner: string, ttlMs: number) =>
      (await claimAttempt(t.pool, op, owner, ttlMs, KEY_WINDOW_SECONDS, 'charge', 'idempotent-key', callTable('idempotent-key'))).lease!;
    const scheduling = { onRescheduled: (tx: Tx, o: Operation, _: Outcome, delay: number | undefined) => enqueueOperation(t.boss, bossDb(tx), o, delay).then(() => {}) };
    const first = await claimFor('first', 60_000);
    const run = await executeOperation(t.pool, kinds, op, first.fence, { claimed: first.operation, begun: first.begun, ...scheduling });
    expect(run.operation.last_outcome).toBe('processing');
    await t.pool.query(`delete from pgboss.job where name = 'charge'`);

    const stale = await claimFor('stale', 1); // its lease lapses at once …
    const now = await waitUntil(() => claimFor('next', 60_000), 5_000, 'the next claim'); // … and another replica claims it
    await expect(executeOperation(t.pool, kinds, op, stale.fence, { claimed: stale.operation, begun: stale.begun, ...scheduling })).rejects.toBeInstanceOf(StaleFenceError);
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', fence: now.fence, lease_owner: 'next' });
    expect(await jobsOf(op)).toEqual([]);
  });
});

describe('held for a person only after the review age', () => {
  it('13 days 23 hours of processing is still waiting, its next check no later than the review age; past 14 days it is held, its charge kept', async () => {
    const { op, pi } = await waiting();
    await waitedFor(op, '13 days 23 hours');
    await checkNow(op);
    await waitUntil(async () => (await checks(op)) === 2 && (await scheduledJob(op)), 20_000, 'the second check');
    expect(await operation(t, op)).toMatchObject({ needs_review: false, status: 'unknown' });
    const next = (await scheduledJob(op))!.starts_in;
    expect(next).toBeLessThanOrEqual(3_600);
    expect(next).toBeGreaterThan(3_500);

    await waitedFor(op, '14 days 1 minute');
    await checkNow(op);
    await waitUntil(async () => (await operation(t, op)).needs_review, 20_000, 'held for review');
    const held = await operation(t, op);
    expect(held).toMatchObject({ status: 'unknown', external_id: pi, next_check_at: null });
    expect(held.review_reason).toMatch(new RegExp(`payment intent processing since .*over 14 days \\(PROCESSING_REVIEW_DAYS\\).*${pi}`));
    expect(await scheduledJob(op)).toBeUndefined();
    expect(createsFor(op)).toHaveLength(1);
  });

  it('PROCESSING_REVIEW_DAYS sets the age', async () => {
    await dispatcher({ processingReviewDays: 2 });
    const { op } = await waiting();
    await waitedFor(op, '2 days 1 minute');
    await checkNow(op);
    await waitUntil(async () => (await operation(t, op)).needs_review, 20_000, 'held for review');
    expect((await operation(t, op)).review_reason).toMatch(/over 2 days/);
  });
});

describe('the sweep and a lost job', () => {
  it('the sweep leaves a waiting payment to its scheduled job; a lost job is flagged, never dropped, and the sweep then retrieves it', async () => {
    const { op, pi } = await waiting();
    const sweep = () => reconcileSweep(t.pool, e.gateway(), { owner: 'sweep', leaseTtlMs: 10_000, log });
    expect((await sweep()).decisions.map((d) => d.operationId)).not.toContain(op);
    expect(retrievesOf(pi)).toHaveLength(0);

    for (const r of replicas.splice(0)) await r.stop();
    await t.pool.query(`delete from pgboss.job where name = 'charge' and data->>'operationId' = $1`, [op]);
    await t.pool.query(`update outboxd.payment_operations set updated_at = now() - interval '20 minutes' where id = $1`, [op]);
    expect((await sweep()).undriven).toEqual([op]);
    expect((await operation(t, op)).review_reason).toMatch(/no job drives this operation/);
    e.emulator.settle(pi, 'succeeded');
    const report = await sweep();
    expect(report.decisions.filter((d) => d.operationId === op)).toEqual([expect.objectContaining({ operationId: op, call: 'retrieve', to: 'succeeded' })]);
    expect(createsFor(op)).toHaveLength(1);
  });
});

describe('a pending refund waits the same way, and one waiting for the customer (requires_action)', () => {
  it.each(['pending', 'requires_action'] as const)('%s: scheduled a minute later with its re_, settled by retrieve, one refund create', async (status) => {
    const charge = await confirm(t);
    await dispatcher();
    await waitUntil(async () => (await operation(t, charge)).status === 'succeeded', 20_000, 'the charge');
    const { operationId: op } = await inTransaction(t.pool, (tx) => requestRefund(tx, { chargeOperationId: charge, amount: 500, key: 'sepa-refund' }));
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'refund_status', status } });
    const row = await waitUntil(async () => {
      const o = await operation(t, op);
      return o.next_check_at && (await scheduledJob(op, 'refund')) ? o : undefined;
    }, 20_000, 'the refund check scheduled');
    expect(row).toMatchObject({ status: 'unknown', last_outcome: 'processing', external_id: expect.stringMatching(/^re_/) });
    expect((await scheduledJob(op, 'refund'))!.starts_in).toBeGreaterThan(50);
    e.emulator.settleRefund(row.external_id!, 'succeeded');
    await checkNow(op);
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'the refund settled');
    expect(e.emulator.requests().filter((r) => r.endpoint === 'create_refund' && r.operationId === op)).toHaveLength(1);
  });
});

describe('the console', () => {
  it('shows a payment waiting on processing, since when, and its next check', async () => {
    const { op } = await waiting();
    const o = await operation(t, op);
    const record = await operationRecord(t.pool, o);
    const page = String(operationPage(o, record, timeline(o, record), {}, { csrfToken: 'x', now: new Date(), dashboard: undefined }));
    expect(page).toContain('Waiting on Stripe: processing');
    expect(page).toContain(`<time datetime="${o.processing_since!.toISOString()}">`);
    expect(page).toMatch(new RegExp(`<dt>Next check</dt><dd><time datetime="${o.next_check_at!.toISOString()}">[^<]*</time> <span class="age">\\(in `));
  });
});

describe('the schedule', () => {
  it('1 min, 5 min, 30 min, 2 h, 6 h, then a day; never past the review age', () => {
    const day = 86_400;
    const review = 14 * day;
    expect([0, 299, 300, 1_799, 1_800, 7_200, 21_600, 86_399, 86_400, 10 * day].map((w) => processingCheckDelaySeconds(w, review)))
      .toEqual([60, 60, 300, 300, 1_800, 7_200, 21_600, 21_600, 86_400, 86_400]);
    expect(processingCheckDelaySeconds(review - 600, review)).toBe(600);
  });
});
