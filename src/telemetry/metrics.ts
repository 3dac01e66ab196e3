// Prometheus metrics of one replica. Counters move with the work; gauges that describe the whole
// system (queue depth, oldest unsettled, review count) are read from PostgreSQL when scraped.
import { Counter, Gauge, Registry, collectDefaultMetrics } from 'prom-client';
import type { PgBoss } from 'pg-boss';
import type { StripeMode } from '../runtime/config.ts';
import type { Queryable } from '../db/pool.ts';
import { BUILT_IN_KINDS } from '../kinds/names.ts';
import { queueFor } from '../outbox/outbox.ts';
import { SETTLED_DEAD_QUEUE, SETTLED_EVENT, SETTLED_QUEUE } from '../outbox/settlements.ts';

export type Metrics = ReturnType<typeof createMetrics>;

/** hostHealth's row (src/sql/statements.ts). */
export interface HostHealth {
  oldest_xmin_seconds: number;
  oldest_xmin_age: number;
  tables: { table: string; dead: number; live: number }[];
}

/** `kinds`: whose queues to report (default: the built-in ones). */
export function createMetrics(source: { db: Queryable; boss: PgBoss; kinds?: readonly string[] }) {
  const registry = new Registry();
  collectDefaultMetrics({ register: registry, prefix: 'outboxd_' });
  const r = [registry];
  // One query per scrape feeds every gauge that comes from it.
  const readHealth = perScrape<{ needs_review: number; oldest_unsettled_seconds: number }>(() => source.db.query(source.db.sql.operationHealth()));
  const readHost = perScrape<HostHealth>(() => source.db.query(source.db.sql.hostHealth()));
  const readSettlementOutbox = perScrape<{ waiting: number; unrelayed: number }>(() => source.db.query(source.db.sql.settlementOutboxDepth(SETTLED_EVENT)));

  return {
    registry,
    /** The exposition text. Concurrent scrapes, and those within a second of the last, share one reading:
     * each reads PostgreSQL and pg-boss on the replica's own pools, which requests to /metrics (open on
     * the webhooks' listener) would otherwise fill, queueing the dispatcher's claims behind them. */
    scrape: sharedFor(1_000, () => registry.metrics()),
    transitions: new Counter({
      name: 'outboxd_operation_transitions_total',
      help: 'Status changes of payment operations made by this replica',
      labelNames: ['from', 'to'],
      registers: r,
    }),
    gatewayOutcomes: new Counter({
      name: 'outboxd_gateway_outcomes_total',
      help: 'Calls that carry out or check an effect, by call, outcome class, kind and the kind\'s policy on an ambiguous outcome',
      labelNames: ['call', 'outcome', 'kind', 'policy'],
      registers: r,
    }),
    possibleDuplicates: new Counter({
      name: 'outboxd_effect_possible_duplicates_total',
      help: 'Executions of an at-least-once effect after an execution that may have acted: possible duplicates, by kind',
      labelNames: ['kind'],
      registers: r,
    }),
    fencedOut: new Counter({
      name: 'outboxd_fenced_out_writes_total',
      help: 'Writes rejected because another claim took the operation over (a stale worker stopped)',
      registers: r,
    }),
    leaseTakeovers: new Counter({
      name: 'outboxd_lease_takeovers_total',
      help: 'Claims that took over an expired lease of another holder',
      registers: r,
    }),
    leaseBusy: new Counter({
      name: 'outboxd_lease_busy_total',
      help: 'Jobs retried later because another live lease held their operation',
      registers: r,
    }),
    unhandledRejections: new Counter({
      name: 'outboxd_unhandled_rejections_total',
      help: "Promises rejected with no handler in an `outboxd worker --effects` process (an effect's, most likely): logged at error, the worker goes on",
      registers: r,
    }),
    webhookRefusals: new Counter({
      name: 'outboxd_webhook_refusals_total',
      help: 'POST /webhooks/stripe refused before its event was read: reason=bad_signature (a wrong STRIPE_WEBHOOK_SECRET, or not from Stripe), busy (503: Stripe sends it again)',
      labelNames: ['reason'],
      registers: r,
    }),
    webhookMismatches: new Counter({
      name: 'outboxd_webhook_mismatches_total',
      help: 'Stripe events whose PaymentIntent does not match the unsettled operation it names (result=mismatch: flagged for review) or contradicts a settled one (result=contradiction)',
      labelNames: ['result'],
      registers: r,
    }),
    tokenRefusals: new Counter({
      name: 'outboxd_token_refusals_total',
      help: 'Tokens refused by this replica, at the console\'s sign-in or on the admin API: a wrong token, or one not looked at because its client (or operator name) must wait after too many (throttled)',
      labelNames: ['reason', 'where'],
      registers: r,
    }),
    jobs: new Counter({ name: 'outboxd_jobs_total', help: 'Jobs handled, by result', labelNames: ['result'], registers: r }),
    inFlight: new Gauge({ name: 'outboxd_in_flight', help: 'Operations being executed by this replica', registers: r }),
    callsOverdue: new Gauge({
      name: 'outboxd_calls_overdue',
      help: "Calls of this replica given up past their kind's timeout that have not returned (outside WORKER_CONCURRENCY); a reconcile-before-retry execute among them keeps its operation's lease",
      registers: r,
    }),
    queueDepth: new Gauge({
      name: 'outboxd_queue_depth',
      help: 'Jobs queued (created or retry) by kind, as pg-boss last counted them',
      labelNames: ['kind'],
      registers: r,
      async collect() {
        const kinds = source.kinds ?? BUILT_IN_KINDS;
        const queues = await Promise.all(kinds.map((kind) => source.boss.getQueue(queueFor(kind)).catch(() => null)));
        kinds.forEach((kind, i) => {
          const q = queues[i];
          if (q) this.set({ kind }, q.queuedCount);
        });
      },
    }),
    outboxRows: new Gauge({
      name: 'outboxd_outbox_rows',
      help: 'Requested operations whose outbox row waits to be relayed to a job',
      registers: r,
      async collect() {
        this.set((await source.db.query(source.db.sql.outboxDepth())).rows[0].rows);
      },
    }),
    settlementOutboxRows: new Gauge({
      name: 'outboxd_settlement_outbox_rows',
      help: 'Settlement events the relay has still to take: to copy to the named subscribers\' queues (none while nobody is subscribed by name), or, until the unnamed onSettled handlers take events from their table, to relay to the queue settled',
      registers: r,
      async collect() {
        this.set((await readSettlementOutbox()).unrelayed);
      },
    }),
    settlementEvents: new Gauge({
      name: 'outboxd_settlement_events',
      help: 'Settlement events for the application\'s unnamed onSettled handlers (waiting: no handler has taken them yet; dead: their handler kept failing)',
      labelNames: ['state'],
      registers: r,
      async collect() {
        // Waiting: in settlement_outbox, and in the queue `settled` where an earlier release's workers put them.
        const [table, legacy, dead] = await Promise.all([
          readSettlementOutbox(),
          ...[SETTLED_QUEUE, SETTLED_DEAD_QUEUE].map((q) => source.boss.getQueue(q).catch(() => null)),
        ]);
        this.set({ state: 'waiting' }, table.waiting + (legacy?.queuedCount ?? 0));
        if (dead) this.set({ state: 'dead' }, dead.queuedCount);
      },
    }),
    subscriberEvents: new Gauge({
      name: 'outboxd_settlement_subscriber_events_waiting',
      help: 'Settlement events a named onSettled subscriber has not consumed yet (its dead ones count in outboxd_settlement_events)',
      labelNames: ['subscriber'],
      registers: r,
      async collect() {
        const { rows } = await source.db.query(source.db.sql.settlementSubscriberQueues(SETTLED_EVENT));
        const queues = await Promise.all(rows.map((q: { name: string }) => source.boss.getQueue(q.name).catch(() => null)));
        this.reset();
        for (const q of queues) if (q) this.set({ subscriber: q.name.slice(SETTLED_QUEUE.length + 1) }, q.queuedCount);
      },
    }),
    oldestUnsettled: new Gauge({
      name: 'outboxd_oldest_unsettled_age_seconds',
      help: 'Age of the oldest pending or unknown operation',
      registers: r,
      async collect() {
        this.set((await readHealth()).oldest_unsettled_seconds);
      },
    }),
    needsReview: new Gauge({
      name: 'outboxd_needs_review',
      help: 'Unsettled operations held for a person',
      registers: r,
      async collect() {
        this.set((await readHealth()).needs_review);
      },
    }),
    // The host database, shared with the application: what outboxd's rows cost depends on it.
    oldestXmin: new Gauge({
      name: 'outboxd_db_oldest_xmin_seconds',
      help: "Age of the oldest transaction holding the database's xmin horizon back (nothing it could still see is vacuumed meanwhile, in any table)",
      registers: r,
      async collect() {
        this.set((await readHost()).oldest_xmin_seconds);
      },
    }),
    oldestXminAge: new Gauge({
      name: 'outboxd_db_oldest_xmin_age_transactions',
      help: 'Transactions since the xmin horizon the oldest transaction holds (age(backend_xmin))',
      registers: r,
      async collect() {
        this.set((await readHost()).oldest_xmin_age);
      },
    }),
    deadTuples: new Gauge({
      name: 'outboxd_db_dead_tuples',
      help: "Dead rows not yet vacuumed in outboxd's tables and pg-boss's (table=pg-boss: its job partitions together), as pg_stat_user_tables counts them",
      labelNames: ['table'],
      registers: r,
      async collect() {
        for (const t of (await readHost()).tables) this.set({ table: t.table }, t.dead);
      },
    }),
    liveTuples: new Gauge({
      name: 'outboxd_db_live_tuples',
      help: "Live rows in outboxd's tables and pg-boss's, as pg_stat_user_tables estimates them (beside the dead ones)",
      labelNames: ['table'],
      registers: r,
      async collect() {
        for (const t of (await readHost()).tables) this.set({ table: t.table }, t.live);
      },
    }),
  };
}

/** Which Stripe this replica pays through, one series per mode, the current one 1: alert on emulator/test in production. */
export function registerStripeMode(registry: Registry, mode: StripeMode): void {
  const gauge = new Gauge({
    name: 'outboxd_stripe_mode',
    help: 'Stripe mode of this replica: emulator (no money moves), test or live',
    labelNames: ['mode'],
    registers: [registry],
  });
  for (const m of ['emulator', 'test', 'live'] as const) gauge.set({ mode: m }, m === mode ? 1 : 0);
}

/** A shared read that has not ended after this long is no longer shared: one that hangs (a dead socket
 * pg-boss's pool has no timeout for) holds up its own callers, not every scrape after them. */
const SHARED_READ_WAIT_MS = 10_000;

/** `read`, shared by every caller while it runs (up to `waitMs`) and for `ms` after. */
export function sharedFor<T>(ms: number, read: () => Promise<T>, waitMs = SHARED_READ_WAIT_MS): () => Promise<T> {
  let last: Promise<T> | undefined;
  const forget = (reading: Promise<T>) => () => {
    if (last === reading) last = undefined;
  };
  return () => {
    if (last) return last;
    const reading = read();
    const stale = setTimeout(forget(reading), waitMs).unref();
    last = reading;
    void reading
      .finally(() => {
        clearTimeout(stale);
        setTimeout(forget(reading), ms).unref();
      })
      .catch(() => {});
    return reading;
  };
}

/** `read`'s first row, read once for every gauge of a scrape that asks within half a second. */
function perScrape<T>(read: () => Promise<{ rows: unknown[] }>): () => Promise<T> {
  return sharedFor(500, () => read().then((x) => x.rows[0] as T));
}
