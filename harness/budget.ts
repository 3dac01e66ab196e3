// A fleet against Stripe's rate limit: replicas (real worker processes) drain a backlog through an
// emulator that enforces the account's limit, and we measure how much of the budget they used while the
// backlog lasted, how many calls Stripe answered 429, what the shared budget cost in statements, and
// whether every operation was charged exactly once (the emulator's ledger). npm run bench prints it;
// test/processes/budgetFleet.test.ts holds it to its goals.
import { randomUUID } from 'node:crypto';
import type { Pool } from '../src/db/pool.ts';
import { confirmOrder } from '../src/exampleApp/confirm.ts';
import type { StripeEmulator } from '../src/emulator/index.ts';
import { checkAgainstLedger, type Violation } from './ledger.ts';
import { waitUntil, type Replica } from './replica.ts';

export interface FleetOptions {
  replicas: number;
  concurrency: number;
  /** The emulator's limit, requests/s for the account. */
  limit: number;
  latencyMs: number;
  backlog: number;
  /** STRIPE_RATE_LIMIT of the replicas; undefined: no budget (what the issue measured). */
  budget: number | undefined;
  timeoutMs?: number;
}

export interface FleetResult {
  /** Requests Stripe accepted per second while the backlog lasted, over the limit. */
  budgetUse: number;
  /** Of every request the fleet sent. */
  rateLimitedShare: number;
  requests: number;
  seconds: number;
  /** Statements against the shared bucket per request sent. */
  statementsPerRequest: number;
  meanWaitMs: number;
  violations: Violation[];
  /** Backlog operations not succeeded, or charged other than once. */
  notOnce: number;
}

export async function runFleet(
  deps: { pool: Pool; emulator: StripeEmulator; startReplica(env: Record<string, string>): Promise<Replica> },
  opts: FleetOptions,
): Promise<FleetResult> {
  const { pool, emulator } = deps;
  emulator.setRateLimit(opts.limit);
  emulator.addFault({ fault: { kind: 'latency', ms: opts.latencyMs }, count: Infinity, endpoint: 'any' });
  const seen = emulator.requests().length;
  const ids: string[] = [];
  try {
    await Promise.all(
      Array.from({ length: 16 }, async (_, c) => {
        for (let i = c; i < opts.backlog; i += 16) {
          const order = { orderId: `fleet-${randomUUID()}`, amount: 1000, currency: 'eur', customer: 'cus_fleet', paymentMethod: 'pm_card_visa' };
          ids.push((await confirmOrder(pool, order)).operationId);
        }
      }),
    );
    const env = { WORKER_CONCURRENCY: String(opts.concurrency), LOG_LEVEL: 'warn', ...(opts.budget !== undefined ? { STRIPE_RATE_LIMIT: String(opts.budget) } : {}) };
    const replicas = await Promise.all(Array.from({ length: opts.replicas }, () => deps.startReplica(env)));
    const settled = () => pool.query(`select count(*)::int as n from outboxd.payment_operations where id = any($1::uuid[]) and status = 'succeeded'`, [ids]);
    await waitUntil(async () => (await settled()).rows[0].n === ids.length, opts.timeoutMs ?? 120_000, 'the backlog to settle');
    const sum = async (name: string) => (await Promise.all(replicas.map((r) => r.metric(name)))).reduce((a, b) => a + b, 0);
    const statements = await sum('outboxd_stripe_budget_statements_total');
    const waitedSeconds = await sum('outboxd_stripe_budget_wait_seconds_sum');
    const waits = await sum('outboxd_stripe_budget_wait_seconds_count');
    for (const r of replicas) r.kill('SIGTERM');
    await Promise.all(replicas.map((r) => r.exited));

    const requests = emulator.requests().slice(seen);
    const accepted = requests.filter((r) => r.status !== 429);
    // The backlog lasts until the last create: until then calls were waiting. Its first second is left
    // out: a bucket that filled while the replicas started sends its capacity at once.
    const first = requests[0]!.at + 1_000;
    const last = Math.max(...accepted.filter((r) => r.endpoint === 'create').map((r) => r.at));
    const inWindow = accepted.filter((r) => r.at >= first && r.at <= last).length;
    const seconds = (last - first) / 1000;
    const agreement = await checkAgainstLedger(pool, emulator);
    // The fleet's backlog only: the emulator may carry charges of others (npm run bench's peer names none).
    const ours = new Set(ids);
    const { rows } = await pool.query(`select id from outboxd.payment_operations where id = any($1::uuid[]) and status = 'succeeded'`, [ids]);
    const notOnce = ids.length - rows.filter((r: { id: string }) => agreement.paid.get(r.id) === 1).length;
    return {
      budgetUse: (inWindow - 1) / (opts.limit * seconds),
      rateLimitedShare: (requests.length - accepted.length) / requests.length,
      requests: requests.length,
      seconds,
      statementsPerRequest: statements / requests.length,
      meanWaitMs: waits ? (1000 * waitedSeconds) / waits : 0,
      violations: agreement.violations.filter((v) => v.operationId !== null && ours.has(v.operationId)),
      notOnce,
    };
  } finally {
    emulator.setRateLimit(null);
    emulator.clearFaults();
  }
}
