// `npm run chaos`: N worker replicas as OS processes, M orders confirmed while faults run (kill -9 and
// restart, SIGSTOP past the lease, lost responses, 500s after commit, 429s, latency, search lag,
// pg_terminate_backend of worker sessions, a PostgreSQL restart), and refunds of the charges that
// succeeded requested meanwhile (partial ones, two of one charge, the same key twice, one too many),
// meeting faults of their own. Then the emulator's ledger is read as the truth and every operation,
// charge and refund, is checked against it. Exit 1 on any violation. A seed reproduces the plan (which
// order meets which fault, which refunds are asked, which replica is killed); timing is the machine's.
import { parseArgs } from 'node:util';
import { inTransaction } from '../src/db/pool.ts';
import { confirmOrder } from '../src/exampleApp/confirm.ts';
import { queueFor } from '../src/outbox/outbox.ts';
import { KEY_WINDOW_SECONDS } from '../src/engine/executor.ts';
import { RefundRefused, requestRefund, type RefundRequested } from '../src/kinds/refund/request.ts';
import type { Fault } from '../src/emulator/index.ts';
import { checkAgainstLedger, type Violation } from '../harness/ledger.ts';
import { seededRandom } from '../harness/random.ts';
import type { Replica } from '../harness/replica.ts';
import { startWorld } from '../harness/world.ts';

const { values: args } = parseArgs({
  options: {
    orders: { type: 'string', default: '200' },
    replicas: { type: 'string', default: '3' },
    'kill-every': { type: 'string', default: '4' },
    seconds: { type: 'string', default: '60' },
    seed: { type: 'string', default: String(Date.now() % 100_000) },
    json: { type: 'boolean', default: false },
  },
});
const ORDERS = Number(args.orders);
const REPLICAS = Number(args.replicas);
const KILL_EVERY_MS = Number(args['kill-every']) * 1000;
const RUN_MS = Number(args.seconds) * 1000;
const SEED = Number(args.seed);
const LEASE_TTL_MS = 3_000;
const SETTLE_TIMEOUT_MS = 150_000;
/** Long enough for the job heartbeat to lapse (10 s), a supervisor pass (5 s), a retry and a takeover. */
const PAUSE_MS = 25_000;

const random = seededRandom(SEED);
const pick = <T>(items: readonly T[]): T => items[Math.floor(random() * items.length)]!;
const log = (msg: string) => process.stderr.write(`[chaos ${((Date.now() - t0) / 1000).toFixed(1).padStart(5)}s] ${msg}\n`);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const t0 = Date.now();

/** The fault an order meets at its first create(s), by weight. */
const FAULTS: [weight: number, fault: Fault | null, count: number][] = [
  [40, null, 0],
  [8, { kind: 'lose_response_after_commit', mode: 'truncate' }, 1],
  [8, { kind: 'lose_response_after_commit', mode: 'reset' }, 2],
  [4, { kind: 'lose_response_after_commit', mode: 'hang' }, 1],
  [3, { kind: 'error_after_commit', status: 500 }, 1],
  [8, { kind: 'error_before_commit', status: 503 }, 2],
  [10, { kind: 'rate_limit' }, 2],
  [15, { kind: 'latency', ms: 400 }, 1],
];
/** The fault a refund meets at its first create(s), by weight; it is matched by the charge's customer. */
const REFUND_FAULTS: [weight: number, fault: Fault | null, count: number][] = [
  [35, null, 0],
  [10, { kind: 'lose_response_after_commit', mode: 'truncate' }, 1],
  [8, { kind: 'lose_response_after_commit', mode: 'reset' }, 2],
  [4, { kind: 'lose_response_after_commit', mode: 'hang' }, 1],
  [3, { kind: 'error_after_commit', status: 500 }, 1],
  [8, { kind: 'error_before_commit', status: 503 }, 2],
  [8, { kind: 'rate_limit' }, 2],
  [12, { kind: 'refund_status', status: 'pending' }, 1],
  [12, { kind: 'latency', ms: 400 }, 1],
];
const PAYMENT_METHODS = ['pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_chargeDeclined', 'pm_card_processing', 'pm_card_authenticationRequired'];
function pickFault(table = FAULTS): [Fault | null, number] {
  let r = random() * table.reduce((s, [w]) => s + w, 0);
  for (const [w, fault, count] of table) if ((r -= w) < 0) return [fault, count];
  return [null, 0];
}

/** The refunds asked of a charge once it succeeded, in order: each with its key; `again` asks the same
 * key twice (it must name the same refund), `tooMuch` asks more than remains (it must be refused). */
interface RefundAsk {
  key: string;
  amount: number;
  again?: boolean;
  tooMuch?: boolean;
}
function planRefunds(i: number, amount: number): RefundAsk[] {
  if (random() >= 0.45) return [];
  const first = 1 + Math.floor(random() * (amount - 1));
  const asks: RefundAsk[] = [{ key: `r-${i}-1`, amount: first, again: random() < 0.3 }];
  const rest = amount - first;
  if (rest > 0 && random() < 0.5) asks.push({ key: `r-${i}-2`, amount: rest });
  else if (random() < 0.5) asks.push({ key: `r-${i}-x`, amount: rest + 1, tooMuch: true });
  return asks;
}

const world = await startWorld({
  name: 'chaos',
  emulator: { searchLagMs: 2_000, processingSettleMs: 2_000 },
  replicaEnv: { WORKER_CONCURRENCY: '4', LEASE_TTL_MS: String(LEASE_TTL_MS), STRIPE_TIMEOUT_MS: '1500', SHUTDOWN_GRACE_MS: '3000' },
});
const stats = { fencedOut: 0, takeovers: 0, kills: 0, stops: 0, terminated: 0, pgRestarts: 0 };
const refundStats = { planned: 0, requested: 0, sameKeyAgain: 0, refused: 0, skipped: 0 };
/** Refunds whose request did not do what it must (a repeated key that made another refund, too much accepted). */
const refundRequestViolations: { kind: 'refund_request'; operationId: string | null; detail: string }[] = [];
const onLog = (entry: Record<string, unknown>) => {
  if (entry.msg === 'fenced out: another claim owns this operation; abandoning the job') stats.fencedOut++;
  if (entry.msg === 'took over an expired lease') stats.takeovers++;
};
const live: Replica[] = [];
/** Replicas this run killed on purpose; any other exit before the end is a crash, and a violation. */
const killedOnPurpose = new Set<Replica>();
const crashes: string[] = [];
let finishing = false;
const spawnReplica = async () => {
  const r = await world.startReplica({}, onLog);
  void r.exited.then(({ code, signal }) => {
    if (!killedOnPurpose.has(r) && !finishing) crashes.push(`replica ${r.proc.pid} exited by itself (code ${code}, signal ${signal}): ${JSON.stringify(r.logs.slice(-2))}`);
  });
  live.push(r);
};

/** Asks a succeeded charge's refunds, in order, checking what each request answers. */
async function askRefunds(charge: string, asks: RefundAsk[]): Promise<void> {
  for (const ask of asks) {
    const request = () => retrying(() => inTransaction(world.pool, (tx) => requestRefund(tx, { chargeOperationId: charge, amount: ask.amount, key: ask.key })));
    const outcome: RefundRequested | Error = await request().catch((err: Error) => err);
    if (ask.tooMuch) {
      if (outcome instanceof RefundRefused && outcome.code === 'exceeds_remaining') refundStats.refused++;
      else refundRequestViolations.push({ kind: 'refund_request', operationId: charge, detail: `${ask.amount} beyond what remains was not refused: ${JSON.stringify(outcome)}` });
      continue;
    }
    if (outcome instanceof Error) {
      refundRequestViolations.push({ kind: 'refund_request', operationId: charge, detail: `refund ${ask.key} of ${ask.amount} refused: ${outcome.message}` });
      continue;
    }
    refundStats.requested++;
    if (!ask.again) continue;
    refundStats.sameKeyAgain++;
    const again = await request().catch((err: Error) => err);
    if (again instanceof Error || again.operationId !== outcome.operationId || again.created) {
      refundRequestViolations.push({ kind: 'refund_request', operationId: charge, detail: `key ${ask.key} asked again gave ${JSON.stringify(again)}, not ${outcome.operationId}` });
    }
  }
}

/** A request that meets a restart or a terminated session is simply made again. */
async function retrying<T>(fn: () => Promise<T>): Promise<T> {
  for (let attempt = 0; ; attempt++) {
    try {
      return await fn();
    } catch (err) {
      if (err instanceof RefundRefused || attempt > 50) throw err;
      await sleep(200);
    }
  }
}

let exitCode = 1;
try {
  log(`seed ${SEED}: ${ORDERS} orders, ${REPLICAS} replicas, kill -9 every ${KILL_EVERY_MS / 1000}s, ${RUN_MS / 1000}s of faults`);
  await Promise.all(Array.from({ length: REPLICAS }, spawnReplica));

  // The plan, drawn from the seed before anything runs.
  const plan = Array.from({ length: ORDERS }, (_, i) => {
    const amount = 100 + Math.floor(random() * 50_000);
    return { i, pm: pick(PAYMENT_METHODS), fault: pickFault(), amount, refunds: planRefunds(i, amount), refundFault: pickFault(REFUND_FAULTS) };
  });
  // Every create takes a little while, as Stripe's do, so that calls overlap kills and pauses.
  world.emulator.addFault({ fault: { kind: 'latency', ms: 150 }, count: Infinity });
  world.emulator.addFault({ endpoint: 'create_refund', fault: { kind: 'latency', ms: 150 }, count: Infinity });
  for (const { i, fault: [fault, count], refunds, refundFault: [refundFault, refundCount] } of plan) {
    if (fault) world.emulator.addFault({ match: { customer: `cus_chaos_${i}` }, fault, count });
    if (refunds.length && refundFault) world.emulator.addFault({ endpoint: 'create_refund', match: { customer: `cus_chaos_${i}` }, fault: refundFault, count: refundCount });
  }
  refundStats.planned = plan.reduce((n, p) => n + p.refunds.length, 0);

  let stopping = false;
  let paused: Replica | undefined;
  const chaos = async () => {
    let nextKill = Date.now() + KILL_EVERY_MS;
    let nextTerminate = Date.now() + 5_000;
    let stopped = false;
    let restarted = false;
    while (!stopping) {
      await sleep(200);
      const elapsed = Date.now() - t0;
      const killable = live.filter((r) => r !== paused);
      if (Date.now() >= nextKill && killable.length > 0) {
        nextKill += KILL_EVERY_MS;
        const victim = killable[Math.floor(random() * killable.length)]!;
        live.splice(live.indexOf(victim), 1);
        killedOnPurpose.add(victim);
        victim.kill('SIGCONT');
        victim.kill('SIGKILL');
        stats.kills++;
        log(`kill -9 replica ${victim.proc.pid}; starting another`);
        await spawnReplica();
      }
      if (!stopped && elapsed > RUN_MS * 0.3 && live.length > 1) {
        stopped = true;
        // A replica with a call in flight, spared from kill -9 until it resumes: its stale writes on
        // resuming are the point.
        let victim = pick(live);
        for (let tries = 0; tries < 30; tries++) {
          const busy = await Promise.all(live.map(async (r) => ((await r.metric('outboxd_in_flight').catch(() => 0)) > 0 ? r : undefined)));
          const found = busy.find((r) => r !== undefined);
          if (found) {
            victim = found;
            break;
          }
          await sleep(100);
        }
        paused = victim;
        victim.kill('SIGSTOP');
        stats.stops++;
        log(`SIGSTOP replica ${victim.proc.pid} for ${PAUSE_MS} ms (past its lease and its job heartbeat)`);
        setTimeout(() => {
          victim.kill('SIGCONT');
          paused = undefined;
          log(`SIGCONT replica ${victim.proc.pid}`);
        }, PAUSE_MS);
      }
      if (Date.now() >= nextTerminate) {
        nextTerminate += 5_000;
        const { rows } = await world.pool
          .query(`select pg_terminate_backend(pid) from pg_stat_activity where application_name in ('outboxd-worker', 'outboxd-boss-worker') and pid <> pg_backend_pid()`)
          .catch(() => ({ rows: [] }));
        stats.terminated += rows.length;
        if (rows.length) log(`pg_terminate_backend: ${rows.length} worker session(s)`);
      }
      if (!restarted && elapsed > RUN_MS * 0.5 && world.canRestartPostgres) {
        restarted = true;
        log('restarting PostgreSQL');
        await world.restartPostgres(1_500);
        stats.pgRestarts++;
        log('PostgreSQL is back');
      }
    }
  };
  const chaosRun = chaos();

  // Refunds are asked of each charge once it has succeeded, until 85% of the run (so that they have time
  // to settle); a request that meets a restart is retried (the same key is the same refund).
  const chargeOf = new Map<number, string>();
  const refunding = (async () => {
    const waiting = plan.filter((p) => p.refunds.length > 0);
    while (waiting.length > 0 && Date.now() - t0 < RUN_MS * 0.85) {
      await sleep(300);
      const known = waiting.filter((p) => chargeOf.has(p.i));
      if (known.length === 0) continue;
      const { rows } = await world.pool
        .query(`select id, status from outboxd.payment_operations where id = any($1)`, [known.map((p) => chargeOf.get(p.i)!)])
        .catch(() => ({ rows: [] as { id: string; status: string }[] }));
      const status = new Map(rows.map((r) => [r.id, r.status]));
      for (const p of known) {
        const charge = chargeOf.get(p.i)!;
        if (status.get(charge) === 'failed') waiting.splice(waiting.indexOf(p), 1);
        if (status.get(charge) !== 'succeeded') continue;
        waiting.splice(waiting.indexOf(p), 1);
        await askRefunds(charge, p.refunds);
      }
    }
    refundStats.skipped = waiting.reduce((n, p) => n + p.refunds.length, 0);
  })();

  // Orders arrive over the first 60% of the run; a confirmation that meets a restart is simply retried
  // (confirming the same order again is idempotent).
  const confirmed: string[] = [];
  for (const { i, pm, amount } of plan) {
    const due = t0 + (RUN_MS * 0.6 * i) / ORDERS;
    if (due > Date.now()) await sleep(due - Date.now());
    for (let attempt = 0; ; attempt++) {
      try {
        const { operationId } = await confirmOrder(world.pool, { orderId: `chaos-${SEED}-${i}`, amount, currency: 'eur', customer: `cus_chaos_${i}`, paymentMethod: pm });
        confirmed.push(operationId);
        chargeOf.set(i, operationId);
        break;
      } catch (err) {
        if (attempt > 50) throw err;
        await sleep(200);
      }
    }
  }
  log(`${confirmed.length} orders confirmed`);
  await refunding;
  log(`${refundStats.requested} refunds requested (${refundStats.sameKeyAgain} keys asked twice, ${refundStats.refused} refused as too much, ${refundStats.skipped} not asked: their charge did not succeed in time)`);
  while (Date.now() - t0 < RUN_MS) await sleep(200);
  stopping = true;
  await chaosRun;
  log('faults stop; waiting for the operations to settle');

  // Settling: everything but the operations whose stored 500 Stripe replays for the key's 24 h.
  const legitimate = () => new Set(world.emulator.requests().filter((r) => r.replayed && r.status === 500).map((r) => r.operationId));
  const until = Date.now() + SETTLE_TIMEOUT_MS;
  for (;;) {
    const open = (await world.pool.query(`select id from outboxd.payment_operations where status in ('pending','unknown')`)).rows.map((r) => r.id as string);
    const waiting = open.filter((id) => !legitimate().has(id));
    if (waiting.length === 0 || Date.now() > until) break;
    await sleep(1_000);
  }

  const { operations, violations } = await checkAgainstLedger(world.pool, world.emulator);
  const unsettled: { operationId: string; status: string; why: string }[] = [];
  const lost: Violation[] = [];
  for (const op of operations.filter((o) => o.status === 'pending' || o.status === 'unknown')) {
    const jobs = await world.boss.findJobs(queueFor(op.kind), { data: { operationId: op.id } });
    const liveJob = jobs.find((j) => ['created', 'retry', 'active'].includes(j.state));
    const inWindow = op.first_attempted_at && Date.now() - op.first_attempted_at.getTime() < KEY_WINDOW_SECONDS * 1000;
    let why: string;
    const inOutbox = (await world.pool.query(`select 1 from outboxd.charge_outbox where operation_id = $1`, [op.id])).rows.length > 0;
    if (legitimate().has(op.id) && inWindow) why = 'inside the key window: Stripe replays the stored 500 for this key (legitimate; reconcile settles it after the window)';
    else if (inOutbox) why = 'waiting in the outbox to be relayed to a job';
    else if (liveJob) why = `still being retried (job ${liveJob.state}, next start ${liveJob.startAfter.toISOString()}): ${op.last_error ?? ''}`;
    else {
      why = 'no outbox row, no live job: nothing would ever drive it';
      lost.push({ kind: 'succeeded_without_charge', operationId: op.id, detail: 'lost: unsettled with no outbox row and no job' });
    }
    unsettled.push({ operationId: op.id, status: op.status, why });
  }
  const settleTimes = operations
    .filter((o) => o.settled_at)
    .map((o) => o.settled_at!.getTime() - o.created_at.getTime())
    .sort((a, b) => a - b);
  const q = (p: number) => settleTimes[Math.min(settleTimes.length - 1, Math.floor((p / 100) * settleTimes.length))] ?? 0;
  const byStatus = Object.fromEntries(['pending', 'unknown', 'succeeded', 'failed'].map((s) => [s, operations.filter((o) => o.status === s).length]));
  const refundOps = operations.filter((o) => o.kind === 'refund');
  const refundsByStatus = Object.fromEntries(['pending', 'unknown', 'succeeded', 'failed'].map((s) => [s, refundOps.filter((o) => o.status === s).length]));
  const allViolations = [
    ...violations,
    ...refundRequestViolations,
    ...lost.map((v) => ({ ...v, kind: 'lost_operation' as const })),
    ...crashes.map((detail) => ({ kind: 'replica_crashed' as const, operationId: null, detail })),
  ];
  finishing = true;
  const report = {
    seed: SEED,
    orders: ORDERS,
    operations: operations.length,
    byStatus,
    charges: world.emulator.ledger().length,
    succeededCharges: world.emulator.ledger().filter((l) => l.paymentIntent.status === 'succeeded').length,
    refundOperations: refundOps.length,
    refundsByStatus,
    refunds: world.emulator.refundLedger().length,
    succeededRefunds: world.emulator.refundLedger().filter((r) => r.refund.status === 'succeeded').length,
    refundRequests: refundStats,
    violations: allViolations,
    unsettled,
    settleMs: { p50: q(50), p95: q(95), max: settleTimes.at(-1) ?? 0 },
    faults: stats,
  };
  if (args.json) console.log(JSON.stringify(report, null, 2));
  else {
    console.log(`\nchaos seed ${SEED}: ${report.operations} operations (${Object.entries(byStatus).map(([k, v]) => `${v} ${k}`).join(', ')}), ${report.charges} PaymentIntents (${report.succeededCharges} succeeded)`);
    console.log(`refunds: ${refundOps.length} operations (${Object.entries(refundsByStatus).map(([k, v]) => `${v} ${k}`).join(', ')}), ${report.refunds} Refunds (${report.succeededRefunds} succeeded); ${refundStats.sameKeyAgain} keys asked twice, ${refundStats.refused} refused as too much`);
    console.log(`faults: ${stats.kills} kill -9, ${stats.stops} SIGSTOP, ${stats.terminated} sessions terminated, ${stats.pgRestarts} PostgreSQL restart(s); ${stats.takeovers} lease takeovers, ${stats.fencedOut} fenced-out writes`);
    console.log(`time to settle: p50 ${report.settleMs.p50} ms, p95 ${report.settleMs.p95} ms, max ${report.settleMs.max} ms`);
    console.log(`replicas that crashed (not killed by chaos): ${crashes.length}`);
    console.log(`double charges: ${allViolations.filter((v) => v.kind === 'double_charge').length}; failed but charged: ${allViolations.filter((v) => v.kind === 'failed_but_charged').length}; succeeded without charge: ${allViolations.filter((v) => v.kind === 'succeeded_without_charge').length}; orphans: ${allViolations.filter((v) => v.kind === 'orphan_charge').length}; creates without our key: ${allViolations.filter((v) => v.kind === 'create_without_our_key').length}; lost: ${lost.length}`);
    const count = (kind: string) => allViolations.filter((v) => v.kind === kind).length;
    console.log(`double refunds: ${count('double_refund')}; refunds without operation: ${count('refund_without_operation')}; succeeded without refund: ${count('succeeded_without_refund')}; failed but refunded: ${count('failed_but_refunded')}; over-refunds: ${count('over_refund')}; refund requests not idempotent or not refused: ${count('refund_request')}`);
    for (const u of unsettled) console.log(`  unsettled ${u.operationId} (${u.status}): ${u.why}`);
    for (const v of allViolations) console.log(`  ✗ ${v.kind} ${v.operationId ?? ''}: ${v.detail}`);
    console.log(allViolations.length === 0 ? 'chaos: 0 violations' : `chaos: ${allViolations.length} VIOLATION(S)`);
  }
  exitCode = allViolations.length === 0 ? 0 : 1;
} finally {
  await world.close();
}
process.exit(exitCode);
