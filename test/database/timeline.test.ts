// Each operation's history (operation_events), which the console shows as its timeline: every gateway
// call with its outcome and Stripe's request id (one row per call), the claims that took over an expired
// lease, flags and settlements from outside a claim. Each row is written by the statement that makes the
// change, so the timeline costs the dispatcher's path no round trip, and a settled charge one row.
import type Stripe from 'stripe';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import type { Pool } from '../../src/db/pool.ts';
import { callTable, executeOperation, KEY_WINDOW_SECONDS } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { acknowledgeReview, claimAttempt, flagDiscrepancy, flagForReview, releaseLease, settleFromOutside } from '../../src/engine/operation.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { createKindQueues, relayOutbox } from '../../src/outbox/outbox.ts';
import { settledQueueFor, subscribeSettlements } from '../../src/outbox/settlements.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { timeline } from '../../src/console/timeline.ts';
import { JOB_SEARCH_MS, operationRecord, overview, overviewCharts, reviewQueue } from '../../src/console/queries.ts';
import { overviewPage } from '../../src/console/views/pages.ts';
import { operationPage } from '../../src/console/views/operation.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { counting } from '../support/counting.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { claim, confirm, operation, relay } from '../support/fixtures.ts';

let t: TestDb;
let e: RunningEmulator;
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.reset());

/** The dispatcher's claim: the lease and the attempt of the call the charge's policy chooses. */
const claimWithAttempt = async (pool: Pool, op: string, owner: string) =>
  (await claimAttempt(pool, op, owner, 30_000, KEY_WINDOW_SECONDS, 'charge', 'idempotent-key', callTable('idempotent-key'))).lease!;

const events = async (op: string) =>
  (await t.pool.query(`select type, fence, actor, details from outboxd.operation_events where operation_id = $1 order by id`, [op])).rows;

describe('the operation timeline', () => {
  it('records a call as one row with its outcome, owner, duration and Stripe request id, in the statement that records the outcome', async () => {
    const op = await confirm(t);
    const relayCount = counting(t.pool);
    expect(await relayOutbox(relayCount.pool, t.boss)).toEqual({ operations: 1, settlements: 0 });
    // one look into both outboxes, then begin, take the batch, insert the jobs, commit (the settlement
    // outbox is empty: nothing settled yet)
    expect(relayCount.statements()).toBe(5);

    const run = counting(t.pool);
    const lease = await claimWithAttempt(run.pool, op, 'worker-a');
    const result = await executeOperation(run.pool, kindsFor(e.gateway()), op, lease.fence, { claimed: lease.operation, begun: lease.begun });
    expect(result.operation.status).toBe('succeeded');
    // the claim with the attempt, the outcome (recording the call): no begin, no commit
    expect(run.statements()).toBe(2);

    const create = e.emulator.requests().find((r) => r.endpoint === 'create' && r.operationId === op)!;
    expect(await events(op)).toEqual([
      {
        type: 'outcome',
        fence: 1,
        actor: 'worker-a',
        details: {
          call: 'create',
          attempt: 1,
          outcome: 'succeeded',
          from: 'pending',
          to: 'succeeded',
          duration_ms: expect.any(Number),
          request_id: create.requestId,
          external_id: result.operation.external_id,
          error: null,
        },
      },
    ]);
  });

  it('a decline keeps the request id Stripe sent with the error', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_chargeDeclined' });
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const create = e.emulator.requests().find((r) => r.endpoint === 'create' && r.operationId === op)!;
    const outcome = (await events(op)).find((x) => x.type === 'outcome')!;
    expect(outcome.details).toMatchObject({ outcome: 'failed', request_id: create.requestId, error: expect.stringMatching(/^Declined 402: card_declined/) });
  });

  it('a takeover names the previous owner and counts the calls it left with no outcome; the timeline says so', async () => {
    const op = await confirm(t);
    // worker-a claims, counting the create, and dies before its outcome: no outcome follows.
    await claimWithAttempt(t.pool, op, 'worker-a');
    await t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
    const second = await claimWithAttempt(t.pool, op, 'worker-b');
    expect(second.previousOwner).toBe('worker-a');
    await executeOperation(t.pool, kindsFor(e.gateway()), op, second.fence, { claimed: second.operation, begun: second.begun });

    expect((await events(op)).map((r) => ({ type: r.type, fence: r.fence, actor: r.actor, unanswered: r.details.unanswered }))).toEqual([
      { type: 'claimed', fence: 2, actor: 'worker-b', unanswered: 1 },
      { type: 'outcome', fence: 2, actor: 'worker-b', unanswered: undefined },
    ]);
    const current = await operation(t, op);
    const entries = timeline(current, await operationRecord(t.pool, current));
    expect(entries.map((x) => x.title)).toEqual(['charge operation created', 'claimed, taking over an expired lease', 'create → succeeded', 'settlement event waiting for onSettled']);
    expect(entries[1]).toMatchObject({ tone: 'warn', text: expect.stringMatching(/^a call by worker-a recorded no outcome/) });
  });

  it('each takeover counts only the calls no earlier row accounts for; a call under a live lease is in flight', async () => {
    const op = await confirm(t);
    const expire = () => t.pool.query(`update outboxd.payment_operations set lease_expires_at = now() - interval '1 second' where id = $1`, [op]);
    await claimWithAttempt(t.pool, op, 'worker-a');
    await expire();
    await claimWithAttempt(t.pool, op, 'worker-b');
    const shown = async () => {
      const current = await operation(t, op);
      return timeline(current, await operationRecord(t.pool, current));
    };
    // worker-b's call is under its live lease.
    expect((await shown()).map((x) => x.title)).toEqual(['charge operation created', 'claimed, taking over an expired lease', 'call in flight']);
    await expire();
    const third = await claimWithAttempt(t.pool, op, 'worker-c');
    expect((await events(op)).map((r) => r.details.unanswered)).toEqual([1, 1]);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, third.fence, { claimed: third.operation, begun: third.begun });
    const entries = await shown();
    expect(entries.map((x) => x.title)).toEqual([
      'charge operation created',
      'claimed, taking over an expired lease',
      'claimed, taking over an expired lease',
      'create → succeeded',
      'settlement event waiting for onSettled',
    ]);
    expect(entries.map((x) => x.text)).toContainEqual(expect.stringMatching(/^a call by worker-b recorded no outcome/));
  });

  it('a call cut off by a settlement from outside is shown as having no outcome', async () => {
    const op = await confirm(t);
    await claimWithAttempt(t.pool, op, 'worker-a');
    await settleFromOutside(t.pool, op, 'succeeded', 'pi_outside', 'webhook:payment_intent.succeeded', null);
    const current = await operation(t, op);
    expect(timeline(current, await operationRecord(t.pool, current)).map((x) => x.title)).toEqual([
      'charge operation created',
      'settled succeeded by a Stripe webhook',
      'a call with no outcome recorded',
      'settlement event waiting for onSettled',
    ]);
  });

  it("a release before one row per call left a sent row and an outcome row: shown as one call, and a sent row alone as a call with no outcome", async () => {
    const op = await confirm(t);
    await t.pool.query(
      `insert into outboxd.operation_events (operation_id, type, fence, actor, details) values
         ($1, 'relayed', null, null, '{}'),
         ($1, 'claimed', 1, 'worker-old', '{}'),
         ($1, 'sent', 1, null, '{"call": "create", "attempt": 1}'),
         ($1, 'outcome', 1, null, '{"call": "create", "attempt": 1, "outcome": "ambiguous", "from": "pending", "to": "unknown", "duration_ms": 5}'),
         ($1, 'claimed', 2, 'worker-old', '{}'),
         ($1, 'sent', 2, null, '{"call": "create", "attempt": 2}')`,
      [op],
    );
    await t.pool.query(`update outboxd.payment_operations set attempts = 2, fence = 2, status = 'unknown' where id = $1`, [op]);
    const current = await operation(t, op);
    expect(timeline(current, await operationRecord(t.pool, current)).map((x) => x.title)).toEqual([
      'charge operation created',
      'relayed from the outbox to a job',
      'claimed',
      'create → ambiguous',
      'claimed',
      'create sent, no outcome recorded',
    ]);
  });

  it('flags and settlements from outside a claim are recorded with their source', async () => {
    const op = await confirm(t);
    await flagDiscrepancy(t.pool, op, 'webhook payment_intent.succeeded: pi_x is not the operation\'s charge');
    const settled = await settleFromOutside(t.pool, op, 'succeeded', 'pi_123', 'webhook:payment_intent.succeeded', null);
    expect(settled).toMatchObject({ status: 'succeeded', review_reason: "discrepancy with Stripe: webhook payment_intent.succeeded: pi_x is not the operation's charge" });
    expect(await events(op)).toEqual([
      { type: 'flagged', fence: null, actor: null, details: { reason: "discrepancy with Stripe: webhook payment_intent.succeeded: pi_x is not the operation's charge" } },
      { type: 'settled', fence: 1, actor: 'webhook:payment_intent.succeeded', details: { status: 'succeeded', external_id: 'pi_123' } },
    ]);
    // Nothing is recorded for a write that changed nothing.
    expect(await settleFromOutside(t.pool, op, 'failed', null, 'webhook:payment_intent.canceled', 'canceled')).toBeUndefined();
    expect(await events(op)).toHaveLength(2);
  });

  it('a Stripe event about the operation joins its timeline, after the settlement it made', async () => {
    const op = await confirm(t);
    // Sent, its answer lost: the webhook tells.
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now(), last_attempted_at = now() where id = $1`, [op]);
    const pi = await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } });
    const event = { id: `evt_${op.replaceAll('-', '')}`, object: 'event', type: 'payment_intent.succeeded', created: 1_700_000_000, livemode: false, data: { object: { id: pi.id } } };
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log: createLogger('silent') }, event as unknown as Stripe.Event)).toBe('settled');
    const current = await operation(t, op);
    const entries = timeline(current, await operationRecord(t.pool, current));
    expect(entries.map((x) => x.title)).toEqual([
      'charge operation created',
      'settled succeeded by a Stripe webhook',
      'a call with no outcome recorded',
      'Stripe event payment_intent.succeeded → settled',
      'settlement event waiting for onSettled',
    ]);
    expect(entries[3]!.facts).toContainEqual(['Stripe object', pi.id]);
  });

  it('a refusal that repeats is one row with a count and when it was last seen', async () => {
    const op = await confirm(t);
    const stripe = new FakeStripe();
    stripe.rateLimitNext = 3;
    const round = async (owner: string) => {
      const lease = await claimWithAttempt(t.pool, op, owner);
      return executeOperation(t.pool, kindsFor(stripe), op, lease.fence, { claimed: lease.operation, begun: lease.begun });
    };
    for (const owner of ['worker-a', 'worker-b', 'worker-a']) expect((await round(owner)).outcome?.kind).toBe('rate_limited');
    expect((await round('worker-b')).operation.status).toBe('succeeded');
    const rows = (await t.pool.query(`select type, fence, details->>'outcome' as outcome, repeats, last_at is not null as repeated from outboxd.operation_events where operation_id = $1 order by id`, [op])).rows;
    expect(rows).toEqual([
      { type: 'outcome', fence: 1, outcome: 'rate_limited', repeats: 3, repeated: true },
      { type: 'outcome', fence: 4, outcome: 'succeeded', repeats: 1, repeated: false },
    ]);
    const current = await operation(t, op);
    const entries = timeline(current, await operationRecord(t.pool, current));
    expect(entries.map((x) => x.title)).toContain('create → rate_limited (3 times)');
  });

  it('a discrepancy is added to one already there, once each, and bounded: past its length it says the timeline has more', async () => {
    const op = await confirm(t);
    const reason = async () => (await operation(t, op)).review_reason as string;
    await flagDiscrepancy(t.pool, op, 'pi_a is not the operation\'s charge');
    await flagDiscrepancy(t.pool, op, 'pi_b is not the operation\'s charge');
    await flagDiscrepancy(t.pool, op, 'pi_a is not the operation\'s charge');
    await flagDiscrepancy(t.pool, op, 'pi_a is not'); // inside another, but another discrepancy
    expect(await reason()).toBe("discrepancy with Stripe: pi_a is not the operation's charge | pi_b is not the operation's charge | pi_a is not");
    for (let i = 0; i < 80; i++) await flagDiscrepancy(t.pool, op, `pi_${String(i).padStart(60, '0')} is not the operation's charge`);
    const bounded = await reason();
    expect(bounded.endsWith(' | and more: see the timeline')).toBe(true);
    expect(bounded.length).toBeLessThan(4200);
    await flagDiscrepancy(t.pool, op, 'pi_z is not the operation\'s charge');
    expect(await reason()).toBe(bounded);
  });

  it("a discrepancy whose text holds '; ' is listed once; a reason held before, or given after, is kept beside it", async () => {
    const op = await confirm(t);
    const reason = async () => (await operation(t, op)).review_reason as string;
    const mismatch = 'webhook payment_intent.payment_failed: pi_3Q is 500 eur; the operation is 2599 eur';
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'search found 2 charges for this operation: pi_a, pi_b' where id = $1`, [op]);
    for (let i = 0; i < 3; i++) await flagDiscrepancy(t.pool, op, mismatch);
    expect(await reason()).toBe(`discrepancy with Stripe: ${mismatch} | search found 2 charges for this operation: pi_a, pi_b`);
    // A claim's flag after it is listed too, once, whatever the order.
    const fence = await claim(t, op);
    await flagForReview(t.pool, op, fence, 'retries exhausted');
    const again = await claim(t, op);
    await flagForReview(t.pool, op, again, 'retries exhausted');
    expect(await reason()).toBe(`discrepancy with Stripe: ${mismatch} | search found 2 charges for this operation: pi_a, pi_b | retries exhausted`);
    // Flagged with the reason it holds (the dead-letter handler gives the one it read): as it was.
    const held = await reason();
    await flagForReview(t.pool, op, await claim(t, op), held);
    expect(await reason()).toBe(held);
  });

  it('the same flag is news of its own once something came after it (a person acknowledged it) or another claim raises it', async () => {
    const types = async (op: string) =>
      (await t.pool.query(`select type, fence, repeats from outboxd.operation_events where operation_id = $1 and type in ('flagged', 'acknowledged') order by id`, [op])).rows;
    const settled = await confirm(t);
    await settleFromOutside(t.pool, settled, 'failed', null, 'webhook:payment_intent.payment_failed', 'declined', null);
    await flagDiscrepancy(t.pool, settled, 'pi_x is succeeded, the operation failed');
    const { review_reason } = await operation(t, settled);
    expect(await acknowledgeReview(t.pool, settled, 'alice', 'refunded', review_reason!)).toBeDefined();
    await flagDiscrepancy(t.pool, settled, 'pi_x is succeeded, the operation failed');
    // Counted on the first, it read as acknowledged while held again (and the first could be pruned under it).
    expect(await types(settled)).toEqual([
      { type: 'flagged', fence: null, repeats: 1 },
      { type: 'acknowledged', fence: null, repeats: 1 },
      { type: 'flagged', fence: null, repeats: 1 },
    ]);
    const held = await confirm(t);
    await flagForReview(t.pool, held, await claim(t, held), 'retries exhausted');
    const second = await claim(t, held);
    await flagForReview(t.pool, held, second, 'retries exhausted');
    await flagForReview(t.pool, held, second, 'retries exhausted');
    expect((await types(held)).map((r) => [r.fence, r.repeats])).toEqual([[1, 1], [second, 2]]);
    // The review queue says when it was last flagged: the repeat's time, not its row's first.
    const { last_at } = (await t.pool.query(`select last_at from outboxd.operation_events where operation_id = $1 and type = 'flagged' and repeats = 2`, [held])).rows[0];
    expect((await reviewQueue(t.pool, 1000)).find((o) => o.id === held)!.flagged_at).toEqual(last_at);
  });

  it('the same flag again counts on its row; another reason is a row of its own; ambiguous creates are never merged', async () => {
    const op = await confirm(t);
    for (let i = 0; i < 3; i++) await flagDiscrepancy(t.pool, op, 'no job drives it');
    await flagDiscrepancy(t.pool, op, 'another reason');
    expect((await t.pool.query(`select details->>'reason' as reason, repeats from outboxd.operation_events where operation_id = $1 order by id`, [op])).rows).toEqual([
      { reason: 'discrepancy with Stripe: no job drives it', repeats: 3 },
      { reason: 'discrepancy with Stripe: another reason', repeats: 1 },
    ]);

    const lost = await confirm(t);
    const stripe = new FakeStripe();
    for (let i = 0; i < 2; i++) {
      stripe.loseResponseOnce = true;
      const lease = await claimWithAttempt(t.pool, lost, `worker-${i}`);
      expect((await executeOperation(t.pool, kindsFor(stripe), lost, lease.fence, { claimed: lease.operation, begun: lease.begun })).outcome?.kind).toBe('ambiguous');
    }
    expect((await events(lost)).map((r) => r.type)).toEqual(['outcome', 'outcome']);
  });

  it('a stale claim records nothing: no call, no outcome', async () => {
    const op = await confirm(t);
    const stale = await claim(t, op, 'worker-a');
    await releaseLease(t.pool, op, stale);
    await claim(t, op, 'worker-b');
    await expect(executeOperation(t.pool, kindsFor(e.gateway()), op, stale)).rejects.toThrow(/fence/);
    expect((await events(op)).map((r) => r.type)).toEqual(['claimed', 'claimed']);
  });

  it("its settlement event's way to onSettled joins the timeline: waiting, failed with its error, then gone once handled", async () => {
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    await relay(t);
    const shown = async () => timeline(await operation(t, op), await operationRecord(t.pool, await operation(t, op))).filter((x) => x.kind === 'settlement');
    expect((await shown()).map((x) => x.title)).toEqual(['settlement event waiting for onSettled']);
    await t.pool.query(`update outboxd.settlement_outbox set attempts = 2, last_error = 'the order service is down' where operation_id = $1`, [op]);
    expect((await shown()).map((x) => [x.title, x.tone, x.text])).toEqual([['settlement event waiting for onSettled, which failed 2 times', 'bad', 'the order service is down']]);
    await t.pool.query(`delete from outboxd.settlement_outbox where operation_id = $1`, [op]);
    expect(await shown()).toEqual([]);
  });

  it("pg-boss's jobs not searched within JOB_SEARCH_MS (millions kept, a lock): the page says so, and is not held up to the statement timeout", async () => {
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const locker = await t.pool.connect();
    try {
      await locker.query(`begin; lock table pgboss.job in access exclusive mode`);
      const started = performance.now();
      const current = await operation(t, op);
      const record = await operationRecord(t.pool, current);
      expect(performance.now() - started).toBeLessThan(JOB_SEARCH_MS + 2_000);
      expect(record.settlements).toBeUndefined();
      expect(timeline(current, record).filter((x) => x.kind === 'settlement').map((x) => [x.title, x.tone])).toEqual([
        ['settlement event waiting for onSettled', 'info'],
        ['settlement event jobs not searched', 'warn'],
      ]);
    } finally {
      await locker.query('rollback');
      locker.release();
    }
  });

  it("a named subscriber's delivery joins the timeline beside the unnamed handlers'", async () => {
    await subscribeSettlements(t.boss, 'mark-paid');
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    await relay(t);
    const shown = async () => timeline(await operation(t, op), await operationRecord(t.pool, await operation(t, op))).filter((x) => x.kind === 'settlement');
    expect((await shown()).map((x) => x.title).sort()).toEqual(['settlement event queued for subscriber mark-paid', 'settlement event waiting for onSettled']);
    const jobs = await t.boss.fetch<{ operationId: string }>(settledQueueFor('mark-paid'), { batchSize: 100 });
    await t.boss.complete(settledQueueFor('mark-paid'), jobs.find((j) => j.data.operationId === op)!.id);
    expect((await shown()).map((x) => x.title)).toContain('settlement event delivered to subscriber mark-paid');
  });

  it("the console's overview shows the fleet's Stripe budget: off, room to spare, or in full use", async () => {
    const render = async (limits: { rateLimit: number | undefined; searchRateLimit: number | undefined }) =>
      String(overviewPage(await overview(t.pool, t.boss, limits), new Date(), await overviewCharts(t.pool, new Date())));
    expect(await render({ rateLimit: undefined, searchRateLimit: undefined })).toContain('not limited');
    await t.pool.query(`insert into outboxd.rate_budgets (name, tokens, short_at) values ('bench-account', 3, now() - interval '10 minutes')`);
    expect(await render({ rateLimit: 25, searchRateLimit: 20 })).toMatch(/room to spare[\s\S]*25 requests\/s, search 20\/s/);
    await t.pool.query(`update outboxd.rate_budgets set short_at = now() - interval '5 seconds' where name = 'bench-account'`);
    expect(await render({ rateLimit: 25, searchRateLimit: 20 })).toMatch(/in full use[\s\S]*waited for a token [56] s ago/);
  });

  it("the console's overview counts every kind's queue, not only the charges'", async () => {
    const render = async () =>
      String(overviewPage(await overview(t.pool, t.boss, { rateLimit: undefined, searchRateLimit: undefined }), new Date(), await overviewCharts(t.pool, new Date())));
    await confirm(t);
    await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, effect_key, payload) values ('welcome_mail', 'at-least-once', 'k-' || gen_random_uuid(), '{}')`,
    );
    await createKindQueues(t.boss, 'welcome_mail');
    const html = await render();
    expect(html).toContain('Jobs queued');
    expect(html).toMatch(/charge \d+ · (\w+ \d+ · )*welcome_mail \d+; \d+ active, \d+ failed retained/);
  });

  it("the operation page names each kind's own idempotency key and what a resolution must name", async () => {
    const page = async (id: string) => {
      const op = await operation(t, id);
      const record = await operationRecord(t.pool, op);
      return String(operationPage(op, record, timeline(op, record), {}, { csrfToken: 'x', now: new Date(), dashboard: undefined }));
    };
    const charge = await confirm(t);
    expect(await page(charge)).toContain(`payment-op:${charge}`);
    // Its key window, while it may be resent; once settled, nothing is.
    await t.pool.query(`update outboxd.payment_operations set first_attempted_at = now() - interval '1 hour', attempts = 1 where id = $1`, [charge]);
    expect(await page(charge)).toMatch(/open until .*22 h \d+ min left\): resent with the same key/);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now() where id = $1`, [charge]);
    expect(await page(charge)).toMatch(/settled: nothing is sent again/);
    expect(await page(charge)).not.toMatch(/resent with the same key/);
    const { rows } = await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, effect_key, payload) values ('welcome_mail', 'at-least-once', 'k-' || gen_random_uuid(), '{}') returning id`,
    );
    const effect = rows[0].id as string;
    const html = await page(effect);
    expect(html).toContain('none: policy at-least-once');
    expect(html).not.toContain(`payment-op:${effect}`);
    expect(html).toContain('Your reference for the effect');
  });
});
