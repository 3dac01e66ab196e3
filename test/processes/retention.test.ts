// Bounded growth (issue 22): the ledger is kept, the timeline and the audit trail past their retention,
// settlement events no onSettled handler took within 14 days, transactional subscribers' consumptions
// after 60, and stored webhook events after 30, are pruned in small batches by one replica at a time, never the history of an operation that has not
// settled; pg-boss deletes outboxd's completed jobs by a retention set on its queues.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { recordAudit } from '../../src/admin/audit.ts';
import { createQueues, JOB_RETENTION } from '../../src/outbox/outbox.ts';
import { PRUNE_QUEUE, pruneHistory } from '../../src/outbox/retention.ts';
import { SETTLED_DEAD_QUEUE } from '../../src/outbox/settlements.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { FakeStripe } from '../support/fakeStripe.ts';
import { confirm } from '../support/fixtures.ts';

let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(async () => {
  await t.close();
});

const days = { operationEvents: 90, audit: 365, webhookEvents: 30 };

/** An operation whose every event (and its creation) happened `ageDays` ago, settled `settledDaysAgo`
 * ago (null: not settled); with `events` timeline rows. */
async function historic(ageDays: number, settledDaysAgo: number | null, events = 4): Promise<string> {
  const op = await confirm(t);
  await t.pool.query(
    `update outboxd.payment_operations set created_at = now() - make_interval(days => $2),
       status = case when $3::int is null then 'unknown' else 'succeeded' end,
       settled_at = now() - make_interval(days => $3::int) where id = $1`,
    [op, ageDays, settledDaysAgo],
  );
  await t.pool.query(
    `insert into outboxd.operation_events (operation_id, at, type, details) select $1, now() - make_interval(days => $2), 'claimed', '{}' from generate_series(1, $3)`,
    [op, ageDays, events],
  );
  return op;
}
/** Seven webhook events received 40 days ago, ids `evt_<tag>_<n>`. */
const oldWebhookEvents = (tag: string) =>
  t.pool.query(`insert into outboxd.webhook_events (id, type, result, payload, received_at)
    select 'evt_' || $1 || '_' || i, 'payment_intent.succeeded', 'settled', '{}', now() - interval '40 days' from generate_series(1, 7) i`, [tag]);
const eventsOf = async (op: string) => Number((await t.pool.query(`select count(*) from outboxd.operation_events where operation_id = $1`, [op])).rows[0].count);
const auditOf = async (op: string | null, tag: string) =>
  Number((await t.pool.query(`select count(*) from outboxd.admin_audit where operation_id is not distinct from $1 and details->>'tag' = $2`, [op, tag])).rows[0].count);
async function audited(op: string | null, ageDays: number, tag: string): Promise<void> {
  await recordAudit(t.pool, { actor: 'test', action: op ? 'requeue' : 'reconcile', operationId: op, details: { tag } });
  await t.pool.query(`update outboxd.admin_audit set at = now() - make_interval(days => $2) where details->>'tag' = $1`, [tag, ageDays]);
}

describe('retention of the timeline and the audit trail', () => {
  it('prunes what settled and aged past its window, batch by batch; keeps the ledger and every unsettled history', async () => {
    const settledLongAgo = await historic(120, 100);
    const unsettledLongAgo = await historic(120, null);
    const settledLately = await historic(120, 10); // its history is a person's for 90 days after it settled
    // Settled long ago but still held for a person (a second charge nobody has acknowledged): kept.
    const heldLongAgo = await historic(800, 700);
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'discrepancy with Stripe: pi_second' where id = $1`, [heldLongAgo]);
    const recent = await historic(5, 4);
    const settledYearsAgo = await historic(800, 700, 0);
    await audited(settledYearsAgo, 750, 'old-resolve');
    await audited(settledLongAgo, 400, 'old-resolve-lately-settled'); // its operation settled 100 days ago
    await audited(unsettledLongAgo, 400, 'old-requeue');
    await audited(heldLongAgo, 750, 'old-flag-held');
    await audited(null, 400, 'old-reconcile');
    await audited(null, 30, 'recent-reconcile');
    // A sweep a person asked for long ago that decided on an operation still held (and on one long settled).
    await recordAudit(t.pool, { actor: 'test', action: 'reconcile', operationId: null, details: { tag: 'old-reconcile-held', decisions: [{ operationId: settledYearsAgo }, { operationId: heldLongAgo }] } });
    await t.pool.query(`update outboxd.admin_audit set at = now() - interval '400 days' where details->>'tag' = 'old-reconcile-held'`);
    // Settlement events no unnamed handler took: gone after 14 days, as a pg-boss job never taken. One the
    // handlers still retry (they began late: the application was down) is left to the dead letter.
    await t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source, created_at, not_before, attempts, last_error)
      values ($1, 'dispatcher', now() - interval '15 days', now() - interval '15 days', 0, null),
             ($2, 'dispatcher', now() - interval '13 days', now() - interval '13 days', 0, null),
             ($3, 'dispatcher', now() - interval '15 days', now() + interval '2 minutes', 7, 'mailer down')`, [settledLongAgo, settledLately, recent]);
    // One whose delivery died with its process a moment ago (its lease lapsed): it comes back alone.
    await t.pool.query(`insert into outboxd.settlement_outbox (operation_id, source, created_at, not_before, attempts, leased_until)
      values ($1, 'dispatcher', now() - interval '15 days', now() - interval '15 days', 1, now() - interval '1 minute')`, [unsettledLongAgo]);
    const settlementEventOf = async (op: string) => (await t.pool.query(`select 1 from outboxd.settlement_outbox where operation_id = $1`, [op])).rows.length;
    // Stored webhook events: gone after 30 days.
    await t.pool.query(`insert into outboxd.webhook_events (id, type, result, payload, received_at)
      select 'evt_retention_' || i, 'payment_intent.succeeded', 'settled', '{}', now() - make_interval(days => case when i <= 7 then 31 else 29 end)
      from generate_series(1, 9) i`);
    const webhookEventsLeft = async () => (await t.pool.query(`select id from outboxd.webhook_events where id like 'evt_retention_%' order by id`)).rows.map((r) => r.id);
    // Transactional subscribers' consumptions: gone after 60 days, when no other copy of the event can
    // still arrive (14 days queued, 30 dead-lettered, 14 more after a redrive).
    await t.pool.query(`insert into outboxd.settlement_consumption (subscriber, operation_id, consumed_at)
      select 'sub-' || (i % 2), gen_random_uuid(), now() - make_interval(days => case when i <= 5 then 61 else 59 end)
      from generate_series(1, 7) i`);
    const consumptionsLeft = async () => Number((await t.pool.query(`select count(*) from outboxd.settlement_consumption where consumed_at > now() - interval '60 days'`)).rows[0].count);

    // Connected accounts' Stripe budget buckets: gone a day after their last take; the platform's stay.
    await t.pool.query(`insert into outboxd.rate_budgets (name, tokens, refilled_at)
      select name, 1, now() - make_interval(hours => hours) from (values
        ('stripe@acct_idle1', 25), ('stripe@acct_idle2', 48), ('stripe@acct_idle3', 30), ('stripe@acct_idle4', 99),
        ('stripe@acct_lately', 23), ('stripe_idle_platform', 1000)) v(name, hours)`);
    const budgetsLeft = async () => (await t.pool.query(`select name from outboxd.rate_budgets where name in ('stripe@acct_idle1', 'stripe@acct_idle2', 'stripe@acct_idle3', 'stripe@acct_idle4', 'stripe@acct_lately', 'stripe_idle_platform') order by name`)).rows.map((r) => r.name);

    // Three rows a statement: many batches, each a short statement of its own.
    const pruned = await pruneHistory(t.pool, days, { scan: 3 });
    expect(pruned).toEqual({ operationEvents: 4, audit: 2, settlementEvents: 1, settlementConsumption: 5, webhookEvents: 7, rateBudgets: 4 });
    expect(await budgetsLeft()).toEqual(['stripe@acct_lately', 'stripe_idle_platform']);
    expect([await settlementEventOf(settledLongAgo), await settlementEventOf(settledLately), await settlementEventOf(recent), await settlementEventOf(unsettledLongAgo)]).toEqual([0, 1, 1, 1]);
    expect(await webhookEventsLeft()).toEqual(['evt_retention_8', 'evt_retention_9']);
    expect(await consumptionsLeft()).toBe(2);
    expect(Number((await t.pool.query('select count(*) from outboxd.settlement_consumption')).rows[0].count)).toBe(2);
    expect(await eventsOf(settledLongAgo)).toBe(0);
    expect(await eventsOf(unsettledLongAgo)).toBe(4);
    expect(await eventsOf(settledLately)).toBe(4);
    expect(await eventsOf(recent)).toBe(4);
    expect(await eventsOf(heldLongAgo)).toBe(4);
    expect(await auditOf(heldLongAgo, 'old-flag-held')).toBe(1);
    expect(await auditOf(null, 'old-reconcile-held')).toBe(1);
    const audit = [['old-resolve', settledYearsAgo], ['old-resolve-lately-settled', settledLongAgo], ['old-requeue', unsettledLongAgo], ['old-reconcile', null], ['recent-reconcile', null]] as const;
    expect(await Promise.all(audit.map(([tag, op]) => auditOf(op, tag)))).toEqual([0, 1, 1, 0, 1]);
    // The ledger is kept.
    const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where id = any($1::uuid[])`, [[settledLongAgo, unsettledLongAgo, settledLately, recent]]);
    expect(rows[0].n).toBe(4);
    // Nothing more to do: the next run deletes nothing.
    expect(await pruneHistory(t.pool, days, { scan: 3 })).toEqual({ operationEvents: 0, audit: 0, settlementEvents: 0, settlementConsumption: 0, webhookEvents: 0, rateBudgets: 0 });
  });

  /** A run, three rows a statement, over a timeline of 30,000 rows due and seven webhook events due
   * (`tag`), told to stop `stopAfterMs` into it: it gets through part of the timeline. What is left is
   * pruned after, for the tests after it. */
  async function runOverBacklog(tag: string, budgetMs: number, stopAfterMs?: number) {
    await t.pool.query(`delete from outboxd.operation_events`);
    await historic(200, 150, 30_000);
    await oldWebhookEvents(tag);
    const stop = new AbortController();
    if (stopAfterMs !== undefined) setTimeout(() => stop.abort(), stopAfterMs);
    const pruned = await pruneHistory(t.pool, days, { scan: 3, budgetMs, signal: stop.signal });
    expect(pruned.operationEvents).toBeGreaterThan(0);
    expect(pruned.operationEvents).toBeLessThan(30_000);
    await pruneHistory(t.pool, days);
    return pruned;
  }

  it('a statement deletes one batch; a backlog in the timeline leaves the tables after it their share of the run', async () => {
    await oldWebhookEvents('share_1');
    expect((await t.pool.query(t.pool.sql.pruneWebhookEvents(30, 3))).rows[0].deleted).toBe(3);
    await t.pool.query(`delete from outboxd.webhook_events`);
    // Far more of the timeline to prune than a run of 1.5 s gets through, three rows a statement (and no
    // younger row before them: ids and times grow together). The webhook events' share, some 600 ms, is
    // ample for their three statements on a loaded machine (300 ms in all was not, once in CI).
    expect((await runOverBacklog('share_2', 1_500)).webhookEvents).toBe(7);
  });

  it('a run told to stop (the replica drains) ends after the batch in hand; the tables after it wait for the next run', async () => {
    // Its share of 6 s would reach the webhook events after some 5 s; it stops in the timeline's.
    expect((await runOverBacklog('stop', 6_000, 100)).webhookEvents).toBe(0);
  });

  it('a replica that drains during a long prune run stops it and finishes in its grace: the run ends, its job completes', async () => {
    await t.pool.query(`delete from outboxd.operation_events`);
    for (let i = 0; i < 4; i++) await historic(200, 150, 100_000);
    // The queue holds one job at a time: the last test's replica stopped at once, its run's job still active.
    await t.pool.query(`delete from pgboss.job where name = $1`, [PRUNE_QUEUE]);
    expect(await t.boss.send(PRUNE_QUEUE, {})).not.toBeNull();
    const replica = await startDispatcher(t, new FakeStripe(), 'pruner-stopped', { pruneCron: '0 0 1 1 *' });
    let drained: { finished: boolean } | undefined;
    try {
      const total = 400_000;
      await waitUntil(async () => Number((await t.pool.query(`select count(*) from outboxd.operation_events`)).rows[0].count) < total, 30_000, 'the run under way');
      drained = await replica.dispatcher.drain(1_000);
    } finally {
      await replica.stop();
    }
    expect(drained).toEqual({ finished: true }); // it waited out its grace for the run
    expect((await t.pool.query(`select state from pgboss.job where name = $1 order by created_on desc limit 1`, [PRUNE_QUEUE])).rows[0].state).toBe('completed');
    await pruneHistory(t.pool, days);
  });

  it("a repeated event is aged by the last time it happened", async () => {
    const op = await historic(120, 100, 1);
    await t.pool.query(`update outboxd.operation_events set repeats = 40, last_at = now() - interval '5 days' where operation_id = $1`, [op]);
    await pruneHistory(t.pool, days);
    expect(await eventsOf(op)).toBe(1);
  });

  it('a row repeated lately ends no run early: the scan goes on past it to the rows long due after it', async () => {
    await t.pool.query(`delete from outboxd.operation_events`);
    // Held for review for months: its history is kept, and its flag repeated by every sweep.
    const held = await historic(120, null, 2);
    await t.pool.query(`update outboxd.operation_events set repeats = 3000, last_at = now() - interval '2 minutes'
      where id = (select max(id) from outboxd.operation_events where operation_id = $1)`, [held]);
    const due = await historic(100, 95, 5);
    for (let run = 0; run < 2; run++) await pruneHistory(t.pool, days, { scan: 2 });
    expect(await eventsOf(due)).toBe(0);
    expect(await eventsOf(held)).toBe(2);
  });

  it('runs as a job of the workers, on a queue that runs one job at a time in the whole fleet', async () => {
    const op = await historic(200, 150);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]); // no relay to record
    expect((await t.boss.getQueue(PRUNE_QUEUE))?.policy).toBe('singleton');
    // A schedule that does not come due during the test: the test sends the cron's job itself.
    await t.boss.send(PRUNE_QUEUE, {});
    const replica = await startDispatcher(t, new FakeStripe(), 'pruner', { pruneCron: '0 0 1 1 *' });
    try {
      await waitUntil(async () => (await eventsOf(op)) === 0, 30_000, 'the replica to prune');
    } finally {
      await replica.stop();
    }
  });
});

describe("pg-boss's retention on outboxd's queues", () => {
  it('is set explicitly, also on queues an earlier release created', async () => {
    for (const q of ['charge', 'charge_dead', 'refund', 'settled', 'reconcile', PRUNE_QUEUE]) {
      expect(await t.boss.getQueue(q), q).toMatchObject(JOB_RETENTION);
    }
    // As an earlier release left it: pg-boss's defaults.
    await t.boss.updateQueue('charge', { deleteAfterSeconds: 7 * 86_400 });
    await t.boss.updateQueue(SETTLED_DEAD_QUEUE, { deleteAfterSeconds: 7 * 86_400 });
    await createQueues(t.boss); // outboxd migrate
    expect(await t.boss.getQueue('charge')).toMatchObject(JOB_RETENTION);
    expect(await t.boss.getQueue(SETTLED_DEAD_QUEUE)).toMatchObject({ deleteAfterSeconds: JOB_RETENTION.deleteAfterSeconds, retentionSeconds: 30 * 86_400 });
  });
});
