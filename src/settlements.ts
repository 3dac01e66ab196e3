// Settlement events: the way back to the application. Every statement that settles an operation
// (src/payments/operation.ts) inserts its settlement_outbox row, so the event commits or rolls back
// with the status change. Workers relay the rows to the pg-boss `settled` queue in batches, like the
// charge outbox; an application's onSettled handlers work that queue. Delivery is at least once: a
// handler that throws is retried with backoff, one that keeps failing is dead-lettered to
// `settled_dead` (counted in /metrics) until `outboxd settlements redrive` sends it again.
import type { PgBoss, Queue } from 'pg-boss';
import { bossDb, inTransaction, type Pool } from './db/pool.ts';
import type { SettlementSource } from './payments/operation.ts';
import { traceDelivery } from './tracing.ts';

export const SETTLED_QUEUE = 'settled';
export const SETTLED_DEAD_QUEUE = 'settled_dead';

/** What onSettled handlers receive, once per settled operation (at least once). */
export interface SettlementEvent {
  operationId: string;
  /** A charge's or a refund's order (null for an application's own kind). */
  orderId: string | null;
  /** `charge`, `refund`, or a kind the application defines. */
  kind: string;
  /** A refund's or an application effect's key (null for a charge). */
  key: string | null;
  status: 'succeeded' | 'failed';
  /** The PaymentIntent (pi_…) of a charge, the Refund (re_…) of a refund; null when Stripe made none. */
  externalId: string | null;
  /** A charge's or a refund's (null for an application's own kind). */
  amount: number | null;
  currency: string | null;
  settledAt: Date;
  source: SettlementSource;
}

/** The job's data: the event as JSON. */
type SettledJob = Omit<SettlementEvent, 'settledAt'> & {
  settledAt: string;
  /** The payment's trace context, for the delivery span's link; not part of the event. */
  traceparent?: string | null;
};

/**
 * Retries of a throwing handler: backoff from 1 s to 5 min, a few hours in all, then the dead letter.
 * heartbeatSeconds: the event of an application process that died mid-handler comes back within a
 * minute; expireInSeconds bounds one handler run.
 */
export const settledQueueOptions: Omit<Queue, 'name'> = {
  retryLimit: 40,
  retryDelay: 1,
  retryBackoff: true,
  retryDelayMax: 300,
  heartbeatSeconds: 30,
  expireInSeconds: 15 * 60,
  deadLetter: SETTLED_DEAD_QUEUE,
  notify: true,
};

export async function createSettlementQueues(boss: PgBoss): Promise<void> {
  // Nobody works the dead letter: it keeps its events (30 days) for a redrive once the handler is fixed.
  await boss.createQueue(SETTLED_DEAD_QUEUE, { retentionSeconds: 30 * 86400 });
  await boss.createQueue(SETTLED_QUEUE, settledQueueOptions);
}

/** Moves up to `limit` settlement events to `settled` jobs in one transaction, as relayOutbox does for charges. */
export async function relaySettlements(db: Pool, boss: PgBoss, limit: number): Promise<number> {
  const { rows: any } = await db.query(db.sql.settlementOutboxHasRows());
  if (!any[0].any) return 0;
  return inTransaction(db, async (tx) => {
    const { rows } = await tx.query(tx.sql.takeSettlementBatch(limit));
    if (rows.length === 0) return 0;
    const jobs = rows.map((r) => ({
      data: {
        operationId: r.operation_id,
        orderId: r.order_id,
        kind: r.kind,
        key: r.effect_key,
        status: r.status,
        externalId: r.external_id,
        amount: r.amount,
        currency: r.currency,
        settledAt: (r.settled_at as Date).toISOString(),
        source: r.source,
        traceparent: r.traceparent,
      } satisfies SettledJob,
    }));
    await boss.insert(SETTLED_QUEUE, jobs, { db: bossDb(tx) });
    return rows.length;
  });
}

/** Events in hand at once per subscribed process, handled concurrently (each is another operation's). */
export const SETTLED_BATCH = 10;

/**
 * Works the `settled` queue with `handle`: each event's job completes when `handle` resolves for it,
 * and is retried when it throws. Resolves once subscribed.
 */
export async function workSettlements(boss: PgBoss, handle: (event: SettlementEvent) => Promise<void>): Promise<void> {
  // pg-boss waits out its polling interval after every fetch unless woken: the loop wakes itself after
  // a batch, so a backlog drains at the handlers' pace, and only an empty fetch waits (or NOTIFY ends
  // the wait for a new event; a retry's backoff ends silently, so the loop also polls).
  const loop = { batchSize: SETTLED_BATCH, perJobResults: true, pollingIntervalSeconds: 1, notifyPollingIntervalSeconds: 2 } as const;
  let loopId: string | undefined;
  loopId = await boss.work<SettledJob>(SETTLED_QUEUE, loop, async (jobs) => {
    const results = await Promise.all(
      jobs.map(async (job) => {
        const { settledAt, traceparent, ...event } = job.data;
        try {
          await traceDelivery({ ...event, traceparent }, job.retryCount, () => handle({ ...event, settledAt: new Date(settledAt) }));
          return { id: job.id, status: 'completed' as const };
        } catch (err) {
          return { id: job.id, status: 'failed' as const, output: { message: String((err as Error)?.message ?? err) } };
        }
      }),
    );
    if (loopId && jobs.length > 0) boss.notifyWorker(loopId);
    return results;
  });
}

/** Sends dead-lettered events to `settled` again (once the failing handler is fixed). How many it sent. */
export async function redriveSettlements(boss: PgBoss, limit = 1000): Promise<number> {
  const dead = await boss.fetch<SettledJob>(SETTLED_DEAD_QUEUE, { batchSize: limit });
  if (dead.length === 0) return 0;
  // A crash between the two leaves the dead jobs to expire and be sent again: at least once, as ever.
  await boss.insert(SETTLED_QUEUE, dead.map((j) => ({ data: j.data })));
  await boss.complete(SETTLED_DEAD_QUEUE, dead.map((j) => j.id));
  return dead.length;
}
