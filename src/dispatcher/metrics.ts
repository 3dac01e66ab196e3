// Prometheus metrics of one replica. Counters move with the work; gauges that describe the whole
// system (queue depth, oldest unsettled, review count) are read from PostgreSQL when scraped.
import { Counter, Gauge, Registry, collectDefaultMetrics } from 'prom-client';
import type { PgBoss } from 'pg-boss';
import type { StripeMode } from '../config.ts';
import type { Queryable } from '../db/pool.ts';
import { CHARGE_QUEUE } from '../outbox.ts';
import * as sql from '../sql/statements.ts';

export type Metrics = ReturnType<typeof createMetrics>;

export function createMetrics(source: { db: Queryable; boss: PgBoss }) {
  const registry = new Registry();
  collectDefaultMetrics({ register: registry, prefix: 'outboxd_process_' });
  const r = [registry];
  let health: Promise<{ needs_review: number; unsettled: number; oldest_unsettled_seconds: number }> | undefined;
  // One query per scrape feeds the three gauges that come from it.
  const readHealth = () => (health ??= source.db.query(sql.operationHealth()).then((x) => x.rows[0]).finally(() => setTimeout(() => (health = undefined), 500)));

  return {
    registry,
    transitions: new Counter({
      name: 'outboxd_operation_transitions_total',
      help: 'Status changes of payment operations made by this replica',
      labelNames: ['from', 'to'],
      registers: r,
    }),
    gatewayOutcomes: new Counter({
      name: 'outboxd_gateway_outcomes_total',
      help: 'Gateway calls by call and outcome class',
      labelNames: ['call', 'outcome'],
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
    jobs: new Counter({ name: 'outboxd_jobs_total', help: 'Charge jobs handled, by result', labelNames: ['result'], registers: r }),
    inFlight: new Gauge({ name: 'outboxd_in_flight', help: 'Operations being executed by this replica', registers: r }),
    queueDepth: new Gauge({
      name: 'outboxd_queue_depth',
      help: 'Charge jobs queued (created or retry), as pg-boss last counted them',
      registers: r,
      async collect() {
        const q = await source.boss.getQueue(CHARGE_QUEUE).catch(() => null);
        if (q) this.set(q.queuedCount);
      },
    }),
    outboxRows: new Gauge({
      name: 'outboxd_outbox_rows',
      help: 'Confirmed orders whose outbox row waits to be relayed to a charge job',
      registers: r,
      async collect() {
        this.set((await source.db.query(sql.outboxDepth())).rows[0].rows);
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
