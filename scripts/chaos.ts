// `npm run chaos`: N worker replicas as OS processes, M orders confirmed while faults run (kill -9 and
// restart, SIGSTOP past the lease, lost responses, 500s after commit, 429s, latency, search lag,
// pg_terminate_backend of worker sessions, a PostgreSQL restart), and refunds of the charges that
// succeeded requested meanwhile (partial ones, two of one charge, the same key twice, one too many),
// meeting faults of their own. A share of the orders are authorizations (manual capture), some orders
// are on connected accounts or destination charges; once a hold succeeds it is captured (all or part,
// some answers lost) or cancelled, a capture and a cancel are requested at once (one is refused), or
// captured, cancelled or expired from outside (as a dashboard would) while outboxd's own capture or
// cancel is in flight. Then the emulator's ledger is read as the truth and every operation, charge,
// refund, capture and cancel, is checked against it, with the key and the account of every request.
// Exit 1 on any violation. A seed reproduces the plan (which order meets which fault, which refunds,
// captures and cancels are asked, which replica is killed); timing is the machine's.
import { parseArgs } from 'node:util';
import { inTransaction } from '../src/db/pool.ts';
import { confirmOrder } from '../src/exampleApp/confirm.ts';
import { queueFor } from '../src/outbox/outbox.ts';
import { reconcileSweep } from '../src/reconcile/sweep.ts';
import { createLogger } from '../src/telemetry/log.ts';
import { KEY_WINDOW_SECONDS } from '../src/engine/executor.ts';
import { RefundRefused, requestRefund, type RefundRequested } from '../src/kinds/refund/request.ts';
import { AuthorizationRefused, requestCancel, requestCapture, type ChangeRequested } from '../src/kinds/hold/request.ts';
import type { Fault } from '../src/emulator/index.ts';
import type { StripeAccount } from '../src/stripe/gateway.ts';
import { checkAgainstLedger, OUTSIDE_KEY_PREFIX, type Violation } from '../harness/ledger.ts';
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
/** The fault a capture or a cancel meets at its first send(s), by weight; matched by the charge's customer. */
const CHANGE_FAULTS: [weight: number, fault: Fault | null, count: number][] = [
  [30, null, 0],
  [14, { kind: 'lose_response_after_commit', mode: 'truncate' }, 1],
  [14, { kind: 'lose_response_after_commit', mode: 'reset' }, 2],
  [6, { kind: 'lose_response_after_commit', mode: 'hang' }, 1],
  [6, { kind: 'error_after_commit', status: 500 }, 1],
  [10, { kind: 'error_before_commit', status: 503 }, 2],
  [10, { kind: 'rate_limit' }, 2],
];
/** How long outboxd's own capture or cancel stays in flight while the outside acts on its authorization. */
const IN_FLIGHT_MS = 1_000;
/** Connected accounts: some charges are made on one (Stripe-Account), some transfer to one (destination charges). */
const ACCOUNTS = ['acct_1ChaosShopA', 'acct_1ChaosShopB'];
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
/** Where a charge is made: on the platform, on a connected account, or a destination charge. */
type Connect = { stripeAccount?: string; transferData?: { destination: string }; applicationFeeAmount?: number };
function planConnect(amount: number): Connect {
  const r = random();
  if (r < 0.2) return { stripeAccount: pick(ACCOUNTS), ...(random() < 0.5 ? { applicationFeeAmount: Math.floor(amount / 10) } : {}) };
  if (r < 0.35) return { transferData: { destination: pick(ACCOUNTS) }, applicationFeeAmount: Math.floor(amount / 10) };
  return {};
}

/**
 * What happens to an authorization once it holds: captured through outboxd (all, or `amount`; `again`
 * asks the same key twice), cancelled, a capture and a cancel requested at once (`race`: one is refused
 * at request time), outboxd's own change in flight while the outside captures, cancels or expires it, or
 * kept as it is.
 */
type Change =
  | { kind: 'capture'; amount?: number; again: boolean }
  | { kind: 'cancel' }
  | { kind: 'race' }
  | { kind: 'outside'; ours: 'capture' | 'cancel'; amount?: number; outside: 'capture' | 'cancel' | 'expire' }
  | { kind: 'keep' };
function planChange(amount: number): Change {
  const r = random() * 100;
  const part = () => (random() < 0.5 ? { amount: 1 + Math.floor(random() * (amount - 1)) } : {});
  if (r < 34) return { kind: 'capture', ...part(), again: random() < 0.3 };
  if (r < 46) return { kind: 'cancel' };
  if (r < 56) return { kind: 'race' };
  if (r < 66) return { kind: 'outside', ours: 'capture', ...part(), outside: 'cancel' };
  if (r < 78) return { kind: 'outside', ours: 'capture', ...part(), outside: 'capture' };
  if (r < 86) return { kind: 'outside', ours: 'cancel', outside: 'capture' };
  if (r < 92) return { kind: 'outside', ours: 'capture', ...part(), outside: 'expire' };
  return { kind: 'keep' };
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
const holdStats = { planned: 0, captures: 0, cancels: 0, sameKeyAgain: 0, races: 0, refusedAtRequest: 0, outside: 0, outsideDone: 0, skipped: 0 };
/** Refunds whose request did not do what it must (a repeated key that made another refund, too much accepted). */
const refundRequestViolations: { kind: 'refund_request'; operationId: string | null; detail: string }[] = [];
/** Captures and cancels whose request did not do what it must (refused while the hold held, a repeated
 * key that made another, a capture and a cancel both accepted or both refused). */
const changeRequestViolations: { kind: 'change_request'; operationId: string | null; detail: string }[] = [];
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

/** The charge's authorization as its succeeded operation shows it: the PaymentIntent and its account. */
interface Held {
  charge: string;
  paymentIntent: string;
  account: StripeAccount;
  amount: number;
}

const changeOf = (kind: 'capture' | 'cancel', held: Held, key: string, amount?: number) =>
  retrying(() =>
    inTransaction(world.pool, (tx) =>
      kind === 'capture'
        ? requestCapture(tx, { chargeOperationId: held.charge, key, ...(amount !== undefined ? { amount } : {}) })
        : requestCancel(tx, { chargeOperationId: held.charge, key, reason: 'requested_by_customer' }),
    ),
  );

/** Waits for an operation to settle (or the run to near its end): its status then. */
async function settled(operationId: string, until: number): Promise<string | undefined> {
  while (Date.now() < until) {
    const { rows } = await world.pool.query(`select status from outboxd.payment_operations where id = $1`, [operationId]).catch(() => ({ rows: [] as { status: string }[] }));
    if (rows[0]?.status === 'succeeded' || rows[0]?.status === 'failed') return rows[0].status;
    await sleep(300);
  }
  return undefined;
}

/** Carries out what the plan says happens to an authorization that holds, checking each request's answer. */
async function changeHold(i: number, held: Held, change: Change, refunds: RefundAsk[]): Promise<void> {
  const flag = (detail: string): void => {
    changeRequestViolations.push({ kind: 'change_request', operationId: held.charge, detail });
  };
  switch (change.kind) {
    case 'keep':
      return;
    case 'capture': {
      // Nothing is captured yet: a refund must be refused at request time.
      const early = await retrying(() => inTransaction(world.pool, (tx) => requestRefund(tx, { chargeOperationId: held.charge, amount: 1, key: `r-${i}-early` }))).catch((err: Error) => err);
      if (!(early instanceof RefundRefused && early.code === 'charge_not_captured')) {
        refundRequestViolations.push({ kind: 'refund_request', operationId: held.charge, detail: `a refund before any capture was not refused: ${JSON.stringify(early)}` });
      }
      const first = await changeOf('capture', held, `cap-${i}`, change.amount).catch((err: Error) => err);
      if (first instanceof Error) return flag(`capture cap-${i} of a held authorization refused: ${first.message}`);
      holdStats.captures++;
      if (change.again) {
        holdStats.sameKeyAgain++;
        const again = await changeOf('capture', held, `cap-${i}`, change.amount).catch((err: Error) => err);
        if (again instanceof Error || again.operationId !== first.operationId || again.created) flag(`key cap-${i} asked again gave ${JSON.stringify(again)}, not ${first.operationId}`);
      }
      if (refunds.length > 0 && (await settled(first.operationId, t0 + RUN_MS * 0.85)) === 'succeeded') await askRefunds(held.charge, refunds);
      else refundStats.skipped += refunds.length;
      return;
    }
    case 'cancel': {
      const done = await changeOf('cancel', held, `can-${i}`).catch((err: Error) => err);
      if (done instanceof Error) return flag(`cancel can-${i} of a held authorization refused: ${done.message}`);
      holdStats.cancels++;
      return;
    }
    case 'race': {
      // Two requests at once, each in its own transaction: the charge's lock orders them, and the second
      // must be refused (an authorization is captured or cancelled, once).
      holdStats.races++;
      const answers = await Promise.all([changeOf('capture', held, `race-cap-${i}`), changeOf('cancel', held, `race-can-${i}`)].map((p) => p.catch((err: Error) => err)));
      const accepted = answers.filter((a): a is ChangeRequested => !(a instanceof Error));
      const refused = answers.filter((a) => a instanceof AuthorizationRefused && (a.code === 'already_captured' || a.code === 'canceled'));
      if (accepted.length !== 1 || refused.length !== 1) flag(`a capture and a cancel at once: ${answers.map((a) => (a instanceof Error ? `${a.name} ${(a as AuthorizationRefused).code ?? a.message}` : `accepted ${a.operationId}`)).join('; ')}`);
      else holdStats.refusedAtRequest++;
      return;
    }
    case 'outside': {
      const ours = await changeOf(change.ours, held, `${change.ours}-${i}`, change.amount).catch((err: Error) => err);
      if (ours instanceof Error) return flag(`${change.ours} ${change.ours}-${i} of a held authorization refused: ${ours.message}`);
      // Once its request is in Stripe (held there IN_FLIGHT_MS by its latency), the outside acts.
      const key = `${change.ours}-op:${ours.operationId}`;
      const until = Date.now() + 15_000;
      while (!world.emulator.requests().some((r) => r.idempotencyKey === key) && Date.now() < until) await sleep(20);
      await sleep(100);
      holdStats.outside++;
      const outsideKey = `${OUTSIDE_KEY_PREFIX}${change.outside}-${i}`;
      const acted =
        change.outside === 'expire'
          ? Promise.resolve().then(() => world.emulator.expire(held.paymentIntent))
          : change.outside === 'capture'
            ? world.gateway.capturePaymentIntent({ paymentIntent: held.paymentIntent, amount: held.amount, idempotencyKey: outsideKey, account: held.account })
            : world.gateway.cancelPaymentIntent({ paymentIntent: held.paymentIntent, reason: 'abandoned', idempotencyKey: outsideKey, account: held.account });
      // Refused when outboxd's change came first: both endings are checked against the ledger.
      if (await acted.then(() => true, () => false)) holdStats.outsideDone++;
      return;
    }
  }
}

/** A request that meets a restart or a terminated session is simply made again. */
async function retrying<T>(fn: () => Promise<T>): Promise<T> {
  for (let attempt = 0; ; attempt++) {
    try {
      return await fn();
    } catch (err) {
      if (err instanceof RefundRefused || err instanceof AuthorizationRefused || attempt > 50) throw err;
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
    const connect = planConnect(amount);
    if (random() >= 0.4) return { i, pm: pick(PAYMENT_METHODS), fault: pickFault(), amount, connect, refunds: planRefunds(i, amount), refundFault: pickFault(REFUND_FAULTS) };
    // An authorization: a card that holds or declines (a processing payment method is no card); its
    // refunds, of what a capture through outboxd took, once that capture succeeded.
    const change = planChange(amount);
    const captured = change.kind === 'capture' ? (change.amount ?? amount) : 0;
    const hold = { change, changeFault: change.kind === 'capture' || change.kind === 'cancel' ? pickFault(CHANGE_FAULTS) : ([null, 0] as const) };
    return { i, pm: random() < 0.85 ? 'pm_card_visa' : 'pm_card_chargeDeclined', fault: pickFault(), amount, connect, hold, refunds: captured ? planRefunds(i, captured) : [], refundFault: pickFault(REFUND_FAULTS) };
  });
  // Every create takes a little while, as Stripe's do, so that calls overlap kills and pauses.
  world.emulator.addFault({ fault: { kind: 'latency', ms: 150 }, count: Infinity });
  world.emulator.addFault({ endpoint: 'create_refund', fault: { kind: 'latency', ms: 150 }, count: Infinity });
  for (const { i, fault: [fault, count], refunds, refundFault: [refundFault, refundCount], hold } of plan) {
    const match = { customer: `cus_chaos_${i}` };
    if (fault) world.emulator.addFault({ match, fault, count });
    if (refunds.length && refundFault) world.emulator.addFault({ endpoint: 'create_refund', match, fault: refundFault, count: refundCount });
    const [changeFault, changeCount] = hold?.changeFault ?? [null, 0];
    if (changeFault && (hold?.change.kind === 'capture' || hold?.change.kind === 'cancel')) world.emulator.addFault({ endpoint: hold.change.kind, match, fault: changeFault, count: changeCount });
    // outboxd's own change waits this long in Stripe (after its key is taken), while the outside acts.
    if (hold?.change.kind === 'outside') world.emulator.addFault({ endpoint: hold.change.ours, match, fault: { kind: 'latency', ms: IN_FLIGHT_MS }, count: 1 });
  }
  for (const endpoint of ['capture', 'cancel'] as const) world.emulator.addFault({ endpoint, fault: { kind: 'latency', ms: 150 }, count: Infinity });
  refundStats.planned = plan.reduce((n, p) => n + p.refunds.length, 0);
  holdStats.planned = plan.filter((p) => p.hold).length;

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
    const waiting = plan.filter((p) => p.refunds.length > 0 && !p.hold);
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

  // Each authorization, once it holds, is changed as planned until 80% of the run (so that its change has
  // time to settle); the changes run side by side.
  const holding = (async () => {
    const waiting = plan.filter((p) => p.hold);
    const changes: Promise<void>[] = [];
    while (waiting.length > 0 && Date.now() - t0 < RUN_MS * 0.8) {
      await sleep(300);
      const known = waiting.filter((p) => chargeOf.has(p.i));
      if (known.length === 0) continue;
      const { rows } = await world.pool
        .query(`select id, status, external_id, payload, result from outboxd.payment_operations where id = any($1)`, [known.map((p) => chargeOf.get(p.i)!)])
        .catch(() => ({ rows: [] as { id: string; status: string; external_id: string; payload: { stripe_account?: string }; result: { amount_capturable: number } }[] }));
      const byId = new Map(rows.map((r) => [r.id, r]));
      for (const p of known) {
        const op = byId.get(chargeOf.get(p.i)!);
        if (op?.status === 'failed') waiting.splice(waiting.indexOf(p), 1);
        if (op?.status !== 'succeeded') continue;
        waiting.splice(waiting.indexOf(p), 1);
        const held: Held = { charge: op.id, paymentIntent: op.external_id, account: op.payload.stripe_account ?? null, amount: Number(op.result.amount_capturable) };
        changes.push(changeHold(p.i, held, p.hold!.change, p.refunds));
      }
    }
    holdStats.skipped = waiting.length;
    await Promise.all(changes);
  })();

  // Orders arrive over the first 60% of the run; a confirmation that meets a restart is simply retried
  // (confirming the same order again is idempotent).
  const confirmed: string[] = [];
  for (const { i, pm, amount, connect, hold } of plan) {
    const due = t0 + (RUN_MS * 0.6 * i) / ORDERS;
    if (due > Date.now()) await sleep(due - Date.now());
    for (let attempt = 0; ; attempt++) {
      try {
        const { operationId } = await confirmOrder(world.pool, {
          orderId: `chaos-${SEED}-${i}`,
          amount,
          currency: 'eur',
          customer: `cus_chaos_${i}`,
          paymentMethod: pm,
          ...connect,
          ...(hold ? { captureMethod: 'manual' } : {}),
        });
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
  await Promise.all([refunding, holding]);
  log(`${holdStats.planned} authorizations: ${holdStats.captures} captures, ${holdStats.cancels} cancels, ${holdStats.races} capture and cancel at once, ${holdStats.outside} changed from outside while outboxd's was in flight (${holdStats.outsideDone} done), ${holdStats.skipped} not held in time`);
  log(`${refundStats.requested} refunds requested (${refundStats.sameKeyAgain} keys asked twice, ${refundStats.refused} refused as too much, ${refundStats.skipped} not asked: their charge did not succeed in time)`);
  while (Date.now() - t0 < RUN_MS) await sleep(200);
  stopping = true;
  await chaosRun;
  log('faults stop; waiting for the operations to settle');

  // Settling: everything but the operations whose stored 500 Stripe replays for the key's 24 h (named
  // by the key: a capture's or cancel's request names its charge), and those a person decides.
  const legitimate = () =>
    new Set(world.emulator.requests().filter((r) => r.replayed && r.status === 500).map((r) => /^(?:payment|refund|capture|cancel)-op:(.+)$/.exec(r.idempotencyKey ?? '')?.[1] ?? r.operationId));
  const until = Date.now() + SETTLE_TIMEOUT_MS;
  for (;;) {
    const open = (await world.pool.query(`select id from outboxd.payment_operations where status in ('pending','unknown') and review_reason is null`)).rows.map((r) => r.id as string);
    const waiting = open.filter((id) => !legitimate().has(id));
    if (waiting.length === 0 || Date.now() > until) break;
    await sleep(1_000);
  }

  // One reconcile sweep, as the replicas' cron (every 5 minutes, longer than this run) would run it: it
  // records what a change live when the outside acted left unrecorded (its failed cancel of a hold the
  // outside captured, its failed capture of one the outside released), which the ledger check requires.
  const swept = await reconcileSweep(world.pool, world.gateway, { owner: 'chaos-sweep', leaseTtlMs: 30_000, log: createLogger('silent') });
  log(`one reconcile sweep: ${swept.followedUp.length} authorization(s) changed outside recorded`);
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
    // Checked against its PaymentIntent above (capture_mismatch, cancel_mismatch): in review only when captured from outside for another amount.
    else if (op.review_reason && (op.kind === 'capture' || op.kind === 'cancel')) why = `in review, for a person: ${op.review_reason}`;
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
  const changeOps = operations.filter((o) => o.kind === 'capture' || o.kind === 'cancel');
  const changesByStatus = Object.fromEntries(['pending', 'unknown', 'succeeded', 'failed'].map((s) => [s, changeOps.filter((o) => o.status === s).length]));
  const holds = world.emulator.ledger().filter((l) => l.paymentIntent.capture_method === 'manual');
  const holdsByStatus = Object.fromEntries(['requires_capture', 'succeeded', 'canceled', 'requires_payment_method'].map((s) => [s, holds.filter((l) => l.paymentIntent.status === s).length]));
  const allViolations = [
    ...violations,
    ...refundRequestViolations,
    ...changeRequestViolations,
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
    authorizations: holds.length,
    authorizationsByStatus: holdsByStatus,
    onConnectedAccounts: world.emulator.ledger().filter((l) => l.account !== null).length,
    destinationCharges: world.emulator.ledger().filter((l) => l.paymentIntent.transfer_data !== null).length,
    changeOperations: changeOps.length,
    changesByStatus,
    changesInReview: changeOps.filter((o) => o.review_reason).length,
    changeRequests: holdStats,
    violations: allViolations,
    unsettled,
    settleMs: { p50: q(50), p95: q(95), max: settleTimes.at(-1) ?? 0 },
    faults: stats,
  };
  if (args.json) console.log(JSON.stringify(report, null, 2));
  else {
    console.log(`\nchaos seed ${SEED}: ${report.operations} operations (${Object.entries(byStatus).map(([k, v]) => `${v} ${k}`).join(', ')}), ${report.charges} PaymentIntents (${report.succeededCharges} succeeded)`);
    console.log(`refunds: ${refundOps.length} operations (${Object.entries(refundsByStatus).map(([k, v]) => `${v} ${k}`).join(', ')}), ${report.refunds} Refunds (${report.succeededRefunds} succeeded); ${refundStats.sameKeyAgain} keys asked twice, ${refundStats.refused} refused as too much`);
    console.log(`authorizations: ${holds.length} (${Object.entries(holdsByStatus).map(([k, v]) => `${v} ${k}`).join(', ')}); ${report.onConnectedAccounts} PaymentIntents on connected accounts, ${report.destinationCharges} destination charges`);
    console.log(`captures and cancels: ${changeOps.length} operations (${Object.entries(changesByStatus).map(([k, v]) => `${v} ${k}`).join(', ')}; ${report.changesInReview} in review); ${holdStats.sameKeyAgain} keys asked twice, ${holdStats.refusedAtRequest} of ${holdStats.races} raced refused at request, ${holdStats.outsideDone} of ${holdStats.outside} changed from outside`);
    console.log(`faults: ${stats.kills} kill -9, ${stats.stops} SIGSTOP, ${stats.terminated} sessions terminated, ${stats.pgRestarts} PostgreSQL restart(s); ${stats.takeovers} lease takeovers, ${stats.fencedOut} fenced-out writes`);
    console.log(`time to settle: p50 ${report.settleMs.p50} ms, p95 ${report.settleMs.p95} ms, max ${report.settleMs.max} ms`);
    console.log(`replicas that crashed (not killed by chaos): ${crashes.length}`);
    console.log(`double charges: ${allViolations.filter((v) => v.kind === 'double_charge').length}; failed but charged: ${allViolations.filter((v) => v.kind === 'failed_but_charged').length}; succeeded without charge: ${allViolations.filter((v) => v.kind === 'succeeded_without_charge').length}; orphans: ${allViolations.filter((v) => v.kind === 'orphan_charge').length}; creates without our key: ${allViolations.filter((v) => v.kind === 'create_without_our_key').length}; lost: ${lost.length}`);
    const count = (kind: string) => allViolations.filter((v) => v.kind === kind).length;
    console.log(`double refunds: ${count('double_refund')}; refunds without operation: ${count('refund_without_operation')}; succeeded without refund: ${count('succeeded_without_refund')}; failed but refunded: ${count('failed_but_refunded')}; over-refunds: ${count('over_refund')}; refund requests not idempotent or not refused: ${count('refund_request')}`);
    console.log(`authorizations not changed exactly once: ${count('double_capture')}; over-captures: ${count('over_capture')}; captures and cancels against their PaymentIntent: ${count('capture_mismatch')} and ${count('cancel_mismatch')}; two live changes: ${count('double_change')}; changes without our key: ${count('change_without_our_key')}; change requests wrongly answered: ${count('change_request')}; wrong account: ${count('wrong_account')}`);
    for (const u of unsettled) console.log(`  unsettled ${u.operationId} (${u.status}): ${u.why}`);
    for (const v of allViolations) console.log(`  ✗ ${v.kind} ${v.operationId ?? ''}: ${v.detail}`);
    console.log(allViolations.length === 0 ? 'chaos: 0 violations' : `chaos: ${allViolations.length} VIOLATION(S)`);
  }
  exitCode = allViolations.length === 0 ? 0 : 1;
} finally {
  await world.close();
}
process.exit(exitCode);
