// Bounded growth (issue 22): the ledger (payment_operations) is kept; the history around it is not.
// The timeline (operation_events) is kept OPERATION_EVENTS_RETENTION_DAYS after its operation settled,
// the audit trail AUDIT_RETENTION_DAYS; an unsettled operation's history is kept whatever its age (a
// person may need it). A settlement event no unnamed onSettled handler took goes after 14 days, as a job
// pg-boss never handed out does; a transactional subscriber's consumption of an event after 60 days; a
// stored webhook event after WEBHOOK_RETENTION_DAYS. Console sessions are
// pruned when they expire; pg-boss deletes its completed jobs by the retention set on outboxd's queues
// (src/outbox/outbox.ts).
//
// Pruning is a pg-boss cron job on a singleton queue: one replica at a time in the whole fleet, never in
// a dispatch path, in small batches (each its own short statement: no long transaction, no lock held
// between them, and no session state, so it runs behind a transaction pooler).
import type { PgBoss } from 'pg-boss';
import type { Pool } from '../db/pool.ts';

/** The retention job's queue, and how often it runs (UTC cron). */
export const PRUNE_QUEUE = 'prune';
export const PRUNE_CRON = '*/10 * * * *';

/** Rows each statement reads; a run stops after PRUNE_BUDGET_MS and the next one goes on. */
const PRUNE_SCAN = 1_000;
const PRUNE_BUDGET_MS = 60_000;

export interface RetentionDays {
  operationEvents: number;
  audit: number;
  webhookEvents: number;
}

/** How long a settlement event waits for an unnamed onSettled handler: pg-boss's retention of a job
 * never taken (JOB_RETENTION in src/outbox/outbox.ts), which delivered them before. */
export const SETTLEMENT_EVENT_RETENTION_DAYS = 14;

/** How long a transactional subscriber's consumption of an event is kept: longer than another copy of
 * the event lives, 14 days waiting in its queue, some hours of retries, then 30 in `settled_dead`
 * (src/outbox/settlements.ts), from which `settlements redrive` may send it back for 14 more. A copy
 * arriving later (dead-lettered and redriven again) would be consumed again. */
export const SETTLEMENT_CONSUMPTION_RETENTION_DAYS = 60;

/** A connected account's Stripe budget bucket idle this long is dropped (full by then; made again, empty,
 * when next used). */
export const RATE_BUDGET_IDLE_HOURS = 24;
export const DEFAULT_RETENTION_DAYS: RetentionDays = { operationEvents: 90, audit: 365, webhookEvents: 30 };

export async function createPruneQueue(boss: PgBoss): Promise<void> {
  await boss.createQueue(PRUNE_QUEUE, { policy: 'singleton', retryLimit: 0, expireInSeconds: 15 * 60 });
}

/** Deletes what has outlived its retention, batch by batch, for at most budgetMs. Each table has a share
 * of what is left of it, and at least one batch: a backlog in one (the first run after an upgrade) leaves
 * the others their turn. Once `signal` aborts (the replica stops), it ends after the batch in hand: the
 * stop waited out its whole grace for a run of up to budgetMs, and one cut off by the pool's end stayed
 * active, pruning nothing, until its job expired. */
export async function pruneHistory(
  pool: Pool,
  days: RetentionDays,
  opts: { scan?: number; budgetMs?: number; signal?: AbortSignal } = {},
): Promise<{ operationEvents: number; audit: number; settlementEvents: number; settlementConsumption: number; webhookEvents: number; rateBudgets: number }> {
  const end = performance.now() + (opts.budgetMs ?? PRUNE_BUDGET_MS);
  const scan = opts.scan ?? PRUNE_SCAN;
  const shareOf = (tablesLeft: number) => performance.now() + (end - performance.now()) / tablesLeft;
  /** A table's batches, until one says nothing more is due or its share of the budget is spent; at least one
   * unless stopped. */
  const inBatches = async (until: number, batch: () => Promise<{ deleted: number; done: boolean }>): Promise<number> => {
    let deleted = 0;
    while (!opts.signal?.aborted) {
      const r = await batch();
      deleted += r.deleted;
      if (r.done || performance.now() >= until) break;
    }
    return deleted;
  };
  /** The batches of a table scanned in id order, each going on after the last id the one before read. */
  const byId = (statement: (afterId: number) => ReturnType<Pool['sql']['pruneOperationEvents']>) => {
    let after = 0;
    return async () => {
      const r = (await pool.query(statement(after))).rows[0] as { last_id: number | null; deleted: number; reached_window: boolean };
      if (r.last_id !== null) after = r.last_id;
      return { deleted: r.deleted, done: r.last_id === null || r.reached_window };
    };
  };
  /** The batches of a table read oldest first through an index, until one deletes fewer than it may. */
  const oldestFirst = (statement: ReturnType<Pool['sql']['pruneWebhookEvents' | 'pruneSettlementConsumption' | 'pruneRateBudgets']>) => async () => {
    const { deleted } = (await pool.query(statement)).rows[0] as { deleted: number };
    return { deleted, done: deleted < scan };
  };
  return {
    operationEvents: await inBatches(shareOf(6), byId((after) => pool.sql.pruneOperationEvents(days.operationEvents, after, scan))),
    audit: await inBatches(shareOf(5), byId((after) => pool.sql.pruneAdminAudit(days.audit, after, scan))),
    settlementEvents: await inBatches(shareOf(4), byId((after) => pool.sql.pruneSettlementOutbox(SETTLEMENT_EVENT_RETENTION_DAYS, after, scan))),
    settlementConsumption: await inBatches(shareOf(3), oldestFirst(pool.sql.pruneSettlementConsumption(SETTLEMENT_CONSUMPTION_RETENTION_DAYS, scan))),
    webhookEvents: await inBatches(shareOf(2), oldestFirst(pool.sql.pruneWebhookEvents(days.webhookEvents, scan))),
    rateBudgets: await inBatches(shareOf(1), oldestFirst(pool.sql.pruneRateBudgets(RATE_BUDGET_IDLE_HOURS, scan))),
  };
}
