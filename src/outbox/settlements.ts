// Settlement events: the way back to the application. Every statement that settles an operation
// (src/engine/operation.ts) inserts its settlement_outbox row, so the event commits or rolls back with the
// status change. The application's unnamed onSettled handlers take the events from that table
// (deliverSettlements): a lease, then a delete, and no job of its own per event, which cost the database
// about 1.9 KB of WAL per settled operation more (docs/benchmarks.md). A named subscriber (onSettled's
// `subscriber`, and every transactional one) has a pg-boss queue of its own, `settled.<name>`, to which
// the workers' relay copies each event settled after it subscribed, once. Delivery is at least once: a
// handler that throws or outlives SETTLEMENT_HANDLER_TIMEOUT_MS is retried with backoff, one that keeps
// failing is dead-lettered to `settled_dead` (counted in /metrics) until `outboxd settlements redrive`
// sends it again.
//
// Releases before this delivery relayed every event to the pg-boss queue `settled`, which is where their
// applications look. So the workers go on doing that until the first application of this release
// subscribes (settlement_delivery gets its row), and this release's handlers drain `settled` too
// (docs/runbook.md, "Upgrading").
import { randomUUID } from 'node:crypto';
import { hostname } from 'node:os';
import type pg from 'pg';
import type { QueryConfig, QueryResult, QueryResultRow } from 'pg';
import type { Db as IDatabase, Job, PgBoss, Queue, WorkHandler, WorkOptions } from 'pg-boss';
import { serializeError } from 'serialize-error';
import { bossDb, inTransaction, type Pool, type Queryable } from '../db/pool.ts';
import type { SettlementSource } from '../engine/operation.ts';
import type { Statements } from '../sql/statements.ts';
import { traceDelivery } from '../telemetry/tracing.ts';
import { withinDeadline } from '../types/deadline.ts';
import { messageOf, storableJson, storableReason, storableText, textOf } from '../types/input.ts';

export const SETTLED_QUEUE = 'settled';
export const SETTLED_DEAD_QUEUE = 'settled_dead';

/** What onSettled handlers receive, once per settled operation (at least once). */
export interface SettlementEvent {
  operationId: string;
  /** A charge's or a refund's order (null for an application's own kind). */
  orderId: string | null;
  /** `charge`, `refund`, `capture`, `cancel`, or a kind the application defines. */
  kind: string;
  /** A refund's, capture's, cancel's or application effect's key (null for a charge). */
  key: string | null;
  status: 'succeeded' | 'failed';
  /** The PaymentIntent (pi_…) of a charge, the Refund (re_…) of a refund; null when Stripe made none. */
  externalId: string | null;
  /** A charge's or a refund's (null for an application's own kind); of an authorization found captured
   * already when it settled, what Stripe took. */
  amount: number | null;
  currency: string | null;
  settledAt: Date;
  source: SettlementSource;
  /** Set when the settled operation is an authorization (a charge requested with captureMethod manual):
   * its success means Stripe HOLDS the funds, until captureBefore (when Stripe said) — a capture operation
   * takes them, a cancel releases them. Null for every other operation: a charge without it charged. */
  hold: { captureBefore: Date | null } | null;
}

/** The job's data: the event as JSON. */
type SettledJob = Omit<SettlementEvent, 'settledAt' | 'hold'> & {
  settledAt: string;
  /** Absent from a job relayed by a release before authorizations: none was one. */
  hold?: { captureBefore: string | null } | null;
  /** The payment's trace context, for the delivery span's link; not part of the event. */
  traceparent?: string | null;
  /** A named subscriber's queue (redrive sends a dead copy back there); absent for the unnamed handlers. */
  queue?: string;
  /** A dead letter of the unnamed handlers': their last error (a named subscriber's is its job's output). */
  lastError?: string;
};

/**
 * Retries of a throwing handler: backoff from 1 s to 5 min, a few hours in all, then the dead letter.
 * heartbeatSeconds: the event of an application process that died mid-handler comes back within a
 * minute; expireInSeconds bounds one handler run (MAX_SETTLEMENT_HANDLER_TIMEOUT_MS in src/runtime/config.ts
 * stays below it).
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

/** The job (or dead letter) of an event as takeSettlementBatch and takeSettlementEvent read it. */
const settledJobOf = (r: Record<string, any>): SettledJob => ({
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
  hold: r.hold,
  traceparent: r.traceparent,
});

/**
 * Relays up to `limit` settlement events in one transaction, as relayOutbox does for charges: a job on
 * each named subscriber's queue that subscribed before the event settled. Once the unnamed handlers take
 * events from settlement_outbox, the rows stay there, marked copied; before, every event is also a job
 * on the queue `settled`, and its row goes. Which, is read in the pass's transaction, under the switch's
 * lock: a pass never takes rows the old way after the switch.
 */
export async function relaySettlements(db: Pool, boss: PgBoss, limit: number): Promise<number> {
  return inTransaction(db, async (tx) => {
    const fromTable: boolean = (await tx.query(tx.sql.settlementRelayMode())).rows[0].table_delivery;
    const take = fromTable ? tx.sql.takeSettlementBatch : tx.sql.takeSettlementBatchForQueue;
    const { rows } = await tx.query(take(limit, SETTLED_EVENT));
    const byQueue = new Map<string, { data: SettledJob }[]>();
    const send = (queue: string, data: SettledJob) => (byQueue.get(queue) ?? byQueue.set(queue, []).get(queue)!).push({ data });
    for (const row of rows) {
      const data = settledJobOf(row);
      if (!fromTable) send(SETTLED_QUEUE, data);
      for (const name of row.subscribers as string[]) send(name, { ...data, queue: name });
    }
    for (const [queue, jobs] of byQueue) await boss.insert(queue, jobs, { db: bossDb(tx) });
    return rows.length;
  });
}

/** A named subscriber's events: a queue of its own, so that each subscriber consumes each event once,
 * independently of the others (a throwing "send receipt" never redelivers to "mark paid"). */
export const settledQueueFor = (subscriber: string): string => `${SETTLED_QUEUE}.${subscriber}`;
/** The pg-boss event whose subscriptions (pg-boss's `subscription` table) are the named subscribers' queues. */
export const SETTLED_EVENT = 'settled';
/** A subscriber's name: it identifies the subscriber across processes and restarts. */
export const SUBSCRIBER_NAME = /^[a-z0-9][a-z0-9_-]{0,39}$/;

/** Creates a named subscriber's queue and records its subscription: every settlement event settled after
 * it is also a job on that queue (idempotent: the first subscription's time stays). */
export async function subscribeSettlements(boss: PgBoss, subscriber: string): Promise<string> {
  const queue = settledQueueFor(subscriber);
  await boss.createQueue(queue, settledQueueOptions);
  await boss.subscribe(SETTLED_EVENT, queue);
  return queue;
}

/** Deliveries in hand at once per subscription of a process, each in a slot of its own. */
export const SETTLED_SLOTS = 10;
/** A transactional subscriber's slots: each holds a connection (its transaction) while its handler runs. */
export const TRANSACTIONAL_SLOTS = 4;

/** The transaction a transactional handler runs in: pg's `query(text, values)` (or a query config). */
export interface SettlementTransaction {
  query<R extends QueryResultRow = any>(text: string | QueryConfig, values?: unknown[]): Promise<QueryResult<R>>;
}

/** A delivery whose handler ran past the settlement handler timeout: failed, and retried with backoff. */
class SettlementTimeoutError extends Error {
  override name = 'SettlementTimeoutError';
}

/** A transactional handler that ended its delivery's transaction itself: failed, and retried (a retry of
 * an event whose consumption that handler committed finds it consumed, and commits nothing more). */
class SettlementTransactionEnded extends Error {
  override name = 'SettlementTransactionEnded';
}

/** The event a job carries, its times as Dates. */
function eventOf(data: SettledJob): SettlementEvent {
  const { settledAt, hold, traceparent: _traceparent, queue: _queue, lastError: _lastError, ...event } = data;
  const captureBefore = hold?.captureBefore;
  return { ...event, hold: hold ? { captureBefore: captureBefore ? new Date(captureBefore) : null } : null, settledAt: new Date(settledAt) };
}

/**
 * Works `queue` with `handle`: a job completes when `handle` resolves for its event, and is retried
 * with backoff when it throws or outlives `timeoutMs`. Resolves once subscribed.
 */
export async function workSettlements(
  boss: PgBoss,
  work: { queue: string; slots: number; timeoutMs: number; idlePollSeconds?: IdlePollSeconds },
  handle: (event: SettlementEvent) => Promise<void>,
): Promise<void> {
  await workSlots(boss, work.queue, work.slots, { idlePollSeconds: work.idlePollSeconds }, async (job) => {
    const event = eventOf(job.data);
    await traceDelivery({ ...event, traceparent: job.data.traceparent }, job.retryCount, () => withinTimeout(() => handle(event), work.timeoutMs));
  });
}

/** A delivery's lease lasts the handler's timeout and this: the event of an application process that died
 * mid-handler comes back about this long after the handler's time (the named queues' heartbeat). */
const LEASE_MARGIN_SECONDS = settledQueueOptions.heartbeatSeconds!;
/** How often an idle delivery loop looks for events (a named queue's first slot polls as often). */
const IDLE_POLL_MS = 1_000;
/** A waiting delivery's registration in settlement_sleepers lasts this long, renewed while it waits. */
const ASLEEP_TTL_S = 60;
/** NOTIFYs heard within IDLE_POLL_MS that tell a load has come: the delivery leaves settlement_sleepers,
 * so that the workers' settling transactions stop sending them (a NOTIFY serializes their commits), and
 * polls. It registers again after REJOIN_AFTER_MS, doubled at each leave in a row up to the registration's
 * TTL, and not while it hears a load another process's registration lets through: a steady load costs the
 * settling transactions a NOTIFY for a few events a minute; a trickle, one each, which nobody notices. */
const HEARD_UNDER_LOAD = 10;
const REJOIN_AFTER_MS = 5_000;
/** Deliveries registered at once in the whole fleet: each NOTIFY wakes a loop in each, and one suffices
 * (the others poll). Two registering at the same instant may both count the others below it; each one's
 * next renewal counts them all, and one leaves. */
const MAX_SLEEPERS = 3;
/** How long stop() waits for a LISTEN still connecting (on a healthy network a few milliseconds), so that
 * it returns with the connection closed; one slower than that is closed once it is up. */
const LISTEN_CONNECT_WAIT_MS = 3_000;

/** How often the unnamed handlers look into the pg-boss queue `settled`, where only workers of the release
 * before table delivery put events (a rolling upgrade's): its first loop, and each other. */
export const LEGACY_POLL_SECONDS: IdlePollSeconds = { first: 5, others: 60 };

/** Delivering the events of settlement_outbox, until stop() (a handler in hand finishes first). */
export interface SettlementDelivery {
  stop(): Promise<void>;
}

/**
 * Delivers the events waiting in settlement_outbox to `handle` (the unnamed handlers), in `slots` loops of
 * one event each, so that a slow or hung handler holds only its own slot. Each delivery leases its event
 * (takeSettlementEvent) for the handler's timeout and a margin, fenced by its attempt. A handler that
 * returns deletes the event; one that throws or outlives timeoutMs puts it off with backoff, as the named
 * subscribers' queues do (1 s doubling to 5 min, with jitter), and its 41st failure dead-letters it to
 * `settled_dead` in the transaction that deletes it. An event whose last delivery never finished (its lease
 * lapsed: the process died or stalled in the handler) may be what killed it, and is delivered alone: no
 * other event is taken or run while it is in hand (one whose take was under way waits for it), and it
 * runs once the handlers in hand have returned, so that if it kills this process
 * too it takes no other event with it (each would come back lapsed, and be dead-lettered after 41 such
 * deaths though its own handler never failed). A loop that got an event wakes a sleeping one (a
 * backlog spreads over the slots) and looks again itself once done; while idle, one looks every
 * `idlePollMs` (IDLE_POLL_MS). With a `listener` (a session connection's LISTEN), a loop that finds
 * nothing registers the delivery in settlement_sleepers, and the table's NOTIFY of an event it may take
 * wakes one loop at once (drizzle/0026_settlement_wake.sql).
 * `db` runs single statements, `pool` the dead letter's transaction; `onError`: what failed around a
 * handler (never a handler's own throw, which is retried).
 */
export function deliverSettlements(
  { db, pool, boss, listener }: { db: Queryable; pool: pg.Pool; boss: PgBoss; listener?: Pick<IDatabase, 'listen'> | undefined },
  work: { slots: number; timeoutMs: number; onError: (err: Error) => void; idlePollMs?: number; rejoinAfterMs?: number },
  handle: (event: SettlementEvent) => Promise<void>,
): SettlementDelivery {
  const leaseSeconds = Math.ceil(work.timeoutMs / 1000) + LEASE_MARGIN_SECONDS;
  // A delivery alone first waits for the handlers in hand, each bounded by the timeout (its lease is then
  // taken again for its own handler).
  const lapsedLeaseSeconds = leaseSeconds + Math.ceil(work.timeoutMs / 1000);
  const idlePollMs = work.idlePollMs ?? IDLE_POLL_MS;
  let stopped = false;
  /** The loops asleep on an empty table (or a failed look), each woken by one call. */
  const asleep: (() => void)[] = [];
  const sleep = () => new Promise<void>((resolve) => asleep.push(resolve));
  const wakeOne = () => asleep.shift()?.();
  // One sleeping loop looks again every idlePollMs, whichever is free: a hung handler's slot never
  // is the only one that would have looked.
  const poll = setInterval(wakeOne, idlePollMs);
  const reportError = (err: unknown) => {
    try {
      work.onError(err instanceof Error ? err : new Error(String(err)));
    } catch {
      // The application's own onError threw: there is no one else to tell, and the loop must go on.
    }
  };

  async function settleDelivery(row: Record<string, any>, failure: unknown): Promise<void> {
    const { id, attempts } = row as { id: number; attempts: number };
    if (failure === undefined) {
      await db.query(db.sql.settlementEventDone(id, attempts));
      return;
    }
    const lastError = storableReason(messageOf(failure));
    if (attempts > settledQueueOptions.retryLimit!) {
      await inTransaction(pool, async (tx) => {
        const { rowCount } = await tx.query(tx.sql.settlementEventDone(id, attempts));
        if (rowCount) await boss.insert(SETTLED_DEAD_QUEUE, [{ data: { ...settledJobOf(row), lastError } }], { db: bossDb(tx) });
      }, db.sql);
    } else {
      const backoff = Math.min(settledQueueOptions.retryDelayMax!, settledQueueOptions.retryDelay! * 2 ** (attempts - 1));
      await db.query(db.sql.settlementEventRetry(id, attempts, backoff * (0.5 + Math.random() / 2), lastError));
    }
  }

  /** Events in hand in this process, but one delivered alone (a handler counts until its timeout), and
   * the delivery alone waiting for none. */
  let inHand = 0;
  const noneInHand: (() => void)[] = [];
  /** Set while an event whose last delivery lapsed is in hand: nothing else is taken or run until it ends. */
  let alone: { ended: Promise<void>; end: () => void } | undefined;
  const noneAlone = async () => {
    while (alone) await alone.ended;
  };

  async function run(row: Record<string, any>): Promise<unknown> {
    const job = settledJobOf(row);
    const event = eventOf(job);
    try {
      await traceDelivery({ ...event, traceparent: job.traceparent }, row.attempts - 1, () => withinTimeout(() => handle(event), work.timeoutMs));
      return undefined;
    } catch (err) {
      return err ?? new Error('the handler threw nothing');
    }
  }

  /** Takes and delivers one event; false when there was none to take. The loops take at once; an event
   * taken while another is delivered alone (its take was under way) waits for that one to end. */
  async function deliverOne(): Promise<boolean> {
    await noneAlone();
    if (stopped) return false;
    const row = (await db.query(db.sql.takeSettlementEvent(leaseSeconds, SETTLED_EVENT, lapsedLeaseSeconds))).rows[0];
    if (!row) return false;
    wakeOne();
    if (row.lapsed) {
      // Checked and set with no await between: two lapsed events never go alone at once.
      while (alone) await alone.ended;
      // Taken by a look begun before stop() (perhaps as another gave it back): given back, still lapsed.
      if (stopped) {
        await db.query(db.sql.leaseSettlementEvent(row.id, row.attempts, 0));
        return true;
      }
      let end!: () => void;
      alone = { ended: new Promise<void>((resolve) => (end = resolve)), end };
    } else {
      while (alone) {
        await noneAlone();
        // However long it waited, its handler gets its whole lease; taken over meanwhile, it is left alone.
        if (!(await db.query(db.sql.leaseSettlementEvent(row.id, row.attempts, leaseSeconds))).rowCount) return true;
      }
      // Counted from a moment no delivery alone is under way, with no wait before its handler: one that
      // begins after this waits for it.
      inHand++;
    }
    try {
      if (row.orphan) {
        // Its operation does not exist: there is nothing to tell, and it would be leased again for ever.
        await db.query(db.sql.settlementEventDone(row.id, row.attempts));
        return true;
      }
      if (row.attempts > settledQueueOptions.retryLimit! + 1) {
        // Its deliveries since its last recorded failure never finished (each process died or stalled in
        // the handler, its lease lapsing): an event that kills its process is dead-lettered like one that throws.
        const lapsed = 'its last deliveries never finished: the process died or stalled in the handler';
        await settleDelivery(row, new Error(row.last_error ? `${row.last_error} (then ${lapsed})` : lapsed));
        return true;
      }
      if (row.lapsed && inHand > 0) {
        await new Promise<void>((resolve) => noneInHand.push(resolve));
        // However long the wait was, the handler gets its whole lease, or the event is given back (still
        // lapsed: delivered alone again) when the delivery stopped meanwhile.
        // Read once: a stop() while the lease is taken again lets the handler run, as it does one in hand.
        const giveBack = stopped;
        const { rowCount } = await db.query(db.sql.leaseSettlementEvent(row.id, row.attempts, giveBack ? 0 : leaseSeconds));
        if (!rowCount || giveBack) return true;
      }
      await settleDelivery(row, await run(row));
      return true;
    } finally {
      if (row.lapsed) {
        alone?.end();
        alone = undefined;
      } else if (--inHand === 0) noneInHand.splice(0).forEach((resolve) => resolve());
    }
  }

  const sleeper = listener?.listen
    ? settlementSleeper(db, listener.listen.bind(listener), { onHeard: wakeOne, onError: reportError, rejoinAfterMs: work.rejoinAfterMs ?? REJOIN_AFTER_MS })
    : undefined;

  async function loop(): Promise<void> {
    while (!stopped) {
      let found = false;
      try {
        found = await deliverOne();
      } catch (err) {
        // The database failed: a delivery not recorded is a lease that lapses, and the event comes back.
        reportError(err);
      }
      if (found || stopped) continue;
      // A loop that found nothing registers the delivery (the others may be busy in handlers, even hung),
      // then looks once more: an event committed before the registration sent no NOTIFY.
      if (await sleeper?.sleeps().catch((err: unknown) => void reportError(err))) continue;
      if (stopped) break; // stop() woke the sleepers while this loop registered
      await sleep();
    }
  }

  const loops = Array.from({ length: work.slots }, loop);
  return {
    async stop() {
      stopped = true;
      clearInterval(poll);
      asleep.splice(0).forEach((wake) => wake());
      await Promise.all(loops);
      await sleeper?.stop();
    },
  };
}

/**
 * A delivery's registration in settlement_sleepers, and its LISTEN (a session connection of its own,
 * beside pg-boss's). `sleeps()`, when a loop found nothing: registers (or renews, near its expiry) and
 * says so; false when it was registered already or another loop is registering it, within its wait after
 * leaving under a load or being refused (MAX_SLEEPERS others are registered), while it hears a load, or
 * when it cannot register. While registered, each NOTIFY calls onHeard, and hearing HEARD_UNDER_LOAD
 * within IDLE_POLL_MS it leaves; each reconnect of the listener calls onHeard (one may have been missed).
 * A schema without the table (a migration not run yet) or a role that may not write it: one onError, and
 * the delivery polls until the process restarts. Times are the process's monotonic clock.
 */
function settlementSleeper(
  db: Queryable,
  listen: NonNullable<IDatabase['listen']>,
  { onHeard, onError, rejoinAfterMs }: { onHeard: () => void; onError: (err: unknown) => void; rejoinAfterMs: number },
) {
  const deliveryId = `${hostname()}:${process.pid}:${randomUUID()}`;
  const ttlMs = ASLEEP_TTL_S * 1000;
  let asleepUntil: number | undefined;
  let heardAt: number[] = [];
  /** No registration before then: the wait after leaving under a load (`rejoinAfter`), or after a refusal. */
  let notBefore = 0;
  let rejoinAfter = rejoinAfterMs;
  let registering = false;
  let leaves = 0;
  let gaveUp = false;
  const leave = () => {
    asleepUntil = undefined;
    leaves++;
    return db.query(db.sql.settlementWakes(deliveryId)).then(() => {}, onError);
  };
  const hearingALoad = (now: number) => (heardAt = heardAt.filter((at) => now - at < IDLE_POLL_MS)).length >= HEARD_UNDER_LOAD;
  // Unregistered, its loops poll: another process's registration is no reason to wake them, but what it
  // lets through is counted, so that this one does not register into a load.
  const heard = () => {
    const now = performance.now();
    heardAt.push(now);
    const loaded = hearingALoad(now); // which keeps only the last IDLE_POLL_MS's
    if (asleepUntil === undefined || asleepUntil <= now) return;
    onHeard();
    if (!loaded) return;
    notBefore = now + rejoinAfter;
    rejoinAfter = Math.min(2 * rejoinAfter, ttlMs);
    void leave();
  };
  // Until the LISTEN is up the loops poll (its connection may take as long as the network lets it); then
  // one looks, and registers.
  let handle: Awaited<ReturnType<typeof listen>> | undefined;
  const listening = listen(db.sql.settlementChannel, heard, onHeard).then(
    (h) => {
      handle = h;
      onHeard();
      return h;
    },
    (err: unknown) => {
      onError(err);
      gaveUp = true;
      return undefined;
    },
  );
  return {
    async sleeps(): Promise<boolean> {
      if (gaveUp || !handle || registering) return false;
      const now = performance.now();
      if (asleepUntil !== undefined && asleepUntil <= now) asleepUntil = undefined; // lapsed in the database too
      if (asleepUntil !== undefined) {
        if (asleepUntil - now > ttlMs / 3) return false;
      } else if (now < notBefore || hearingALoad(now)) {
        return false;
      }
      const renewing = asleepUntil !== undefined;
      registering = true;
      const leavesBefore = leaves;
      let registered: boolean;
      try {
        registered = ((await db.query(db.sql.settlementSleeps(deliveryId, ASLEEP_TTL_S, MAX_SLEEPERS))).rowCount ?? 0) > 0;
      } catch (err) {
        onError(err);
        if (['42P01', '42501'].includes((err as { code?: string } | null)?.code ?? '')) {
          gaveUp = true;
          asleepUntil = undefined;
          await handle?.close().catch(onError);
        }
        return false;
      } finally {
        registering = false;
      }
      if (leaves !== leavesBefore) {
        // A load made it leave meanwhile, and this upsert may have committed after that delete.
        void leave();
        return false;
      }
      if (!registered) {
        if (renewing) void leave();
        notBefore = performance.now() + ttlMs / 3;
        return false;
      }
      // Renewed: the registration outlived a third of its time without a load, and the next leave waits the least.
      if (renewing) rejoinAfter = rejoinAfterMs;
      asleepUntil = performance.now() + ttlMs;
      if (!renewing) heardAt = [];
      return true;
    },
    async stop(): Promise<void> {
      if (asleepUntil !== undefined) await leave();
      let waited: ReturnType<typeof setTimeout> | undefined;
      const up = await Promise.race([listening, new Promise<undefined>((resolve) => (waited = setTimeout(() => resolve(undefined), LISTEN_CONNECT_WAIT_MS)))]);
      clearTimeout(waited);
      if (up) await up.close().catch(onError);
      else void listening.then((h) => h?.close().catch(onError));
    },
  };
}

/**
 * Works a transactional subscriber's queue: each delivery is one transaction (pg-boss's transactional
 * worker) in which outboxd records the event consumed by `subscriber`, `handle` runs its writes, and
 * the job completes, fenced on the attempt this delivery claimed. So they commit together or not at
 * all: a throw, a timeout or a claim taken over (the job expired and another process holds it) rolls
 * everything back. An event this subscriber consumed already (a redriven copy) commits without the
 * handler running. Resolves once subscribed.
 */
export async function workSettlementsInTransaction(
  boss: PgBoss,
  sql: Statements,
  work: { queue: string; subscriber: string; slots: number; timeoutMs: number; handlerTypes: pg.CustomTypesConfig | undefined },
  handle: (event: SettlementEvent, tx: SettlementTransaction) => Promise<void>,
): Promise<void> {
  // The database's own bounds on the transaction (pg-boss's transaction_timeout where the server has it,
  // and the idle one) are a few seconds past the handler's: the process's own timeout comes first, with
  // a clean rollback; they are for a process that stops issuing statements without ever returning.
  const transactionTimeoutSeconds = Math.ceil(work.timeoutMs / 1000) + 5;
  await workSlots(boss, work.queue, work.slots, { transactional: true, transactionTimeoutSeconds }, async (job, txDb) => {
    const event = eventOf(job.data);
    // Closed the moment the delivery is over (the handler returned, threw or ran out of time), before
    // pg-boss sends its COMMIT or ROLLBACK: a statement the handler issues later would otherwise queue
    // behind the ROLLBACK on the same connection and run on its own, committed, outside the transaction.
    let open = true;
    const tx: SettlementTransaction = {
      query: (text, values) =>
        open
          ? (txDb!.executeSql(asTheApplicationReads(text, work.handlerTypes) as never, values) as never)
          : Promise.reject(new Error('this settlement delivery is over (returned, threw or timed out): its transaction is settled, nothing more is written')),
    };
    await traceDelivery({ ...event, traceparent: job.data.traceparent }, job.retryCount, async () => {
      // No statement of the handler's runs longer than the handler may take.
      await tx.query(sql.boundSettlementTransaction(work.timeoutMs, transactionTimeoutSeconds * 1000));
      const { rows } = await tx.query(sql.consumeSettlement(work.subscriber, event.operationId));
      if (rows.length === 0) return;
      try {
        await withinTimeout(() => handle(event, tx), work.timeoutMs);
      } finally {
        open = false;
      }
      // Still the transaction the consumption was recorded in: a handler that ended it (a COMMIT or a
      // ROLLBACK sent through tx, as a library's own transaction() does) left the job to complete on its
      // own, with nothing consumed or with its writes committed outside the fenced completion.
      const now = (await txDb!.executeSql(sql.currentTransactionId().text, [])).rows[0]?.xid;
      if (now !== rows[0].xid) {
        throw new SettlementTransactionEnded(
          'the handler ended the delivery\'s transaction (a COMMIT or ROLLBACK through tx, as a transaction() of a library over it sends): nest with SAVEPOINT; the event comes back',
        );
      }
    });
  });
}

/**
 * A transactional handler's statement, to read as the application's own connections do: on pg-boss's pool
 * (whose parsers are the built-in ones) with `types`, pg's global parsers; on the application's pool
 * (`types` undefined) with that pool's. Always a QueryConfig, which pg-boss's interface runs as it is (a
 * string would be taken for one of pg-boss's own). One that names its parsers (outboxd's, drizzle's)
 * keeps them; one whose fields are getters (a tagged template's statement) keeps them through its prototype.
 */
function asTheApplicationReads(text: string | QueryConfig, types: pg.CustomTypesConfig | undefined): QueryConfig {
  if (typeof text === 'string') return types ? { text, types } : { text };
  if (!types || text.types) return text;
  return Object.assign(Object.create(text) as QueryConfig, { types });
}

/** How often an idle pg-boss loop of a subscription polls: its first, and each other (NOTIFY wakes them sooner where they listen). */
type IdlePollSeconds = { first: number; others: number };

/**
 * `slots` pg-boss loops on `queue`, one job each, so that a slow or hung handler holds only its own slot
 * and every other event keeps flowing. A loop that got a job wakes the next one (a backlog spreads over
 * the slots) and looks again itself once done; only the first polls often when idle (by default every
 * second or two, the others every few seconds), so an idle subscription costs about what one loop did.
 */
async function workSlots(
  boss: PgBoss,
  queue: string,
  slots: number,
  { idlePollSeconds = { first: 1, others: 5 }, ...options }: { transactional?: true; transactionTimeoutSeconds?: number; idlePollSeconds?: IdlePollSeconds | undefined },
  deliver: (job: Job<SettledJob>, tx: IDatabase | undefined) => Promise<void>,
): Promise<void> {
  const ids: string[] = [];
  for (let slot = 0; slot < slots; slot++) {
    const seconds = slot === 0 ? idlePollSeconds.first : idlePollSeconds.others;
    const polling = { pollingIntervalSeconds: seconds, notifyPollingIntervalSeconds: 2 * seconds };
    const handler = async (jobs: Job<SettledJob>[], tx?: IDatabase) => {
      if (jobs.length === 0) return;
      const next = ids[(slot + 1) % slots];
      if (next) boss.notifyWorker(next);
      try {
        await deliver(jobs[0]!, tx);
      } catch (err) {
        throw recordable(err);
      } finally {
        const self = ids[slot];
        if (self) boss.notifyWorker(self);
      }
    };
    ids.push(await boss.work<SettledJob>(queue, { ...options, ...polling, batchSize: 1 } as WorkOptions, handler as WorkHandler<SettledJob>));
  }
}

/**
 * A handler's failure as pg-boss can record it: what it throws becomes the job's output (jsonb), as
 * serialize-error renders it (every field, nested ones too; a value that is no object as `{ value }`),
 * and jsonb cannot hold U+0000 or half a surrogate pair. With one, the failure was never recorded and the
 * job stayed active, unseen, until it expired. Such a failure is recorded as an Error of its name, message
 * and stack, as storable text.
 */
function recordable(err: unknown): unknown {
  const stored = JSON.stringify(serializeError(typeof err === 'object' && err !== null ? err : { value: err }));
  if (storableJson(stored) === stored) return err;
  const { name, stack } = err instanceof Error ? err : new Error();
  return Object.assign(new Error(storableText(messageOf(err))), { name: storableText(textOf(name)), stack: storableText(textOf(stack ?? '')) });
}

/** `fn`'s promise, or a SettlementTimeoutError once `ms` have passed. The handler itself cannot be
 * stopped: it is abandoned (a transactional one's transaction is rolled back, and refuses its later
 * statements), and its slot takes the next event. */
function withinTimeout<T>(fn: () => Promise<T> | T, ms: number): Promise<T> {
  return withinDeadline(Promise.resolve().then(fn), ms, () => new SettlementTimeoutError(`the settlement handler did not return within ${ms} ms (SETTLEMENT_HANDLER_TIMEOUT_MS)`));
}

/**
 * Sends every dead-lettered event back where it died (once the failing handler is fixed), `batch` at a
 * time until a batch comes back short, each batch in one transaction: taken from the dead letter, sent
 * and completed together, so an interrupted redrive loses or doubles no event and spends no retry of the
 * dead letter (the batches before it stay sent). A named subscriber's goes back to its queue, an unnamed
 * handlers' to settlement_outbox. One of a subscriber whose queue was deleted (retired), or of an
 * operation that does not exist, has nowhere to go: it is completed, not sent. How many it sent.
 */
export async function redriveSettlements(db: Pool, boss: PgBoss, batch = 1000): Promise<number> {
  let sent = 0;
  for (;;) {
    const { taken, sent: more } = await redriveBatch(db, boss, batch);
    sent += more;
    // Short: the dead letter held no more when it was read. It ends: a redriven event dies again only
    // after its 41 deliveries with backoff, hours later.
    if (taken < batch) return sent;
  }
}

async function redriveBatch(db: Pool, boss: PgBoss, limit: number): Promise<{ taken: number; sent: number }> {
  return inTransaction(db, async (tx) => {
    const dead = await boss.fetch<SettledJob>(SETTLED_DEAD_QUEUE, { batchSize: limit, db: bossDb(tx) });
    if (dead.length === 0) return { taken: 0, sent: 0 };
    const byQueue = new Map<string, { data: SettledJob }[]>();
    let sent = 0;
    for (const j of dead) {
      if (j.data.queue === undefined) {
        sent += (await tx.query(tx.sql.redriveSettlementEvent(j.data.operationId, j.data.source))).rowCount ?? 0;
        continue;
      }
      (byQueue.get(j.data.queue) ?? byQueue.set(j.data.queue, []).get(j.data.queue)!).push({ data: j.data });
    }
    for (const [queue, jobs] of byQueue) {
      if (!(await boss.getQueue(queue))) continue;
      await boss.insert(queue, jobs, { db: bossDb(tx) });
      sent += jobs.length;
    }
    await boss.complete(SETTLED_DEAD_QUEUE, dead, undefined, { db: bossDb(tx) });
    return { taken: dead.length, sent };
  });
}
