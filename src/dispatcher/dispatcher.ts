// The dispatcher: turns jobs into settled operations, for every kind it can carry out, each from its
// kind's queue. pg-boss claims the job (SKIP LOCKED, retries with backoff, heartbeats, dead letter); the
// operation's lease and fencing token make sure that at most one claim writes, whatever pg-boss
// redelivers (docs/architecture.md §3).
//
// Every replica also relays the outbox: requested operations' rows become jobs in batches, woken by
// the outboxes' NOTIFY when it can LISTEN, else polling.
//
// One job:  claim the operation (fence + 1) and count the call its policy chooses, in one statement,
//           while the slots may still be busy (given back uncounted should the replica drain first)
//           ─▶ a free slot ─▶ executeOperation with the token, lease renewed meanwhile
//           ─▶ settled: outcome and lease release in ONE fenced statement; then pg-boss completes the job
//              (fenced to the attempt it fetched; should that be lost, the redelivery finds the operation
//              settled and completes at once)
//           ─▶ unsettled (ambiguous, search not caught up): lease released, the job fails → retried
//              with backoff
//           ─▶ nothing executed (429, 401/403, a check that found nothing done): in one transaction with
//              the outcome, the job completes and a fresh one drives the operation later
//           ─▶ still processing (SEPA Debit, ACH): the same, the fresh job on a slowing schedule
//              (src/engine/processing.ts), spending no retry; past the review age, held for a person
//           ─▶ held for a person (key misuse, a charge that is not this operation's, two charges):
//              dead-lettered at once, not retried 40 times
//           ─▶ leased by a live claim, or its row locked by another transaction: retried later, never dropped
//           ─▶ fenced out: this claim changes nothing; the job completes if the operation settled,
//              and is retried otherwise
//           ─▶ abandoned at shutdown and then failed: nothing recorded, the lease left to expire
import type { Db, Job, JobResult, PgBoss } from 'pg-boss';
import { bossDb, inTransaction, type Pool, type Tx } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';
import type { EffectCall, KindRegistry, Policy } from '../engine/kinds.ts';
import { BUILT_IN_KINDS } from '../kinds/names.ts';
import { storableText } from '../types/input.ts';
import { KIND_QUEUE_OPTIONS, deadQueueFor, ensureKindQueues, enqueueOperation, queueFor, RECONCILE_QUEUE, RELAY_BATCH, relayOutbox, type OperationJob, type RelayPass } from '../outbox/outbox.ts';
import { reconcileSweep } from '../reconcile/sweep.ts';
import { createPruneQueue, DEFAULT_RETENTION_DAYS, PRUNE_QUEUE, pruneHistory, type RetentionDays } from '../outbox/retention.ts';
import { CallAbandoned, CallTimedOut, callTable, executeOperation, KEY_WINDOW_SECONDS } from '../engine/executor.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import {
  claimAttempt,
  claimOperation,
  flagForReview,
  isOperationId,
  isSettled,
  peekOperation,
  clearCreateMayStillAct,
  markCreateMayStillAct,
  releaseLease,
  releaseUnsentClaim,
  renewLease,
  reschedules,
  StaleFenceError,
  type BegunAttempt,
  type OperationState,
  type Outcome,
} from '../engine/operation.ts';
import { traceDispatch, traceOperation, untraced } from '../telemetry/tracing.ts';
import type { Metrics } from '../telemetry/metrics.ts';
import { keepLease, leaseMargin, type LocalLease } from './lease.ts';
import { Slots, type Release } from './slots.ts';

export interface DispatcherOptions {
  workerId: string;
  /** Operations executing at once in this replica, whatever their kind (one set of slots). */
  concurrency: number;
  leaseTtlMs: number;
  keyWindowSeconds?: number;
  /** Schedule the reconcile sweep with this cron (pg-boss runs one at a time across replicas). */
  reconcileCron?: string;
  /** Schedule the retention job (src/outbox/retention.ts) with this cron: one run at a time across replicas. */
  pruneCron?: string;
  retentionDays?: RetentionDays;
  /** How often an idle relay looks for new outbox rows (a full batch is followed at once). */
  relayIntervalMs?: number;
  /** Jobs each loop fetches per round trip (FETCH_BATCH; never more than concurrency). */
  fetchBatch?: number;
  /** A payment still processing this many days after it first was is held for a person (PROCESSING_REVIEW_DAYS). */
  processingReviewDays?: number;
}

/** Jobs fetched per round trip: measured with npm run bench, a batch cuts the statements and commits of
 * a settled operation (fetch and completion are shared by the batch, its claims and outcomes go
 * together) more than anything else in the dispatcher: 8 settled ~12 % more per second at 0 ms than 4
 * (0.95 statements per operation against 1.21), at the price of twice as many jobs waiting in hand. */
export const FETCH_BATCH = 8;

/** Claims a replica holds at once for each of its slots: the one whose call runs, and one made ahead. */
const CLAIMS_PER_SLOT = 2;

/** A call goes out only with its lease found this claim's by a fenced statement (the claim, a renewal)
 * sent within this long: a claim made ahead that waited longer for its slot renews first. Meanwhile the
 * operation may have been settled from outside (a webhook raises the fence: invariant 5) or taken over. */
const LEASE_CONFIRMED_WITHIN_MS = 1_000;

/** How long a sleeping relay waits for a NOTIFY before it looks anyway: for a notification lost in a
 * reconnect, or sent by a row whose trigger ran before the relay's registration committed. */
const ASLEEP_POLL_MS = 1_000;
/** A sleeping relay's registration lives this long, renewed with a third left: a dead replica's lapses,
 * and its writers stop paying for a NOTIFY nobody hears. */
const ASLEEP_TTL_S = 30;
/** How long an awake relay's passes find nothing before it sleeps: under a load that several replicas
 * share, a pass often finds nothing while the next does not, and each registration costs the writers
 * NOTIFYs until the relay leaves again. */
const SLEEP_AFTER_MS = 250;

export interface DispatcherDeps {
  boss: PgBoss;
  pool: Pool;
  /** Stripe, for the reconcile sweep. */
  gateway: PaymentGateway;
  log: Logger;
  metrics: Metrics;
  /** The kinds this replica carries out: the built-in ones and the application's (outboxd.startWorker,
   * `worker --effects`), registered alike (src/kinds/index.ts: kindsFor). */
  kinds: KindRegistry;
  /** A session connection's LISTEN, when the replica has one: rows arriving in an empty outbox wake the
   * relay at once. Without it the relay polls. */
  listener?: Pick<Db, 'listen'>;
}

type Disposition = Omit<JobResult, 'id'>;

/** When a call that executed nothing is tried again: at once after a check found the earlier execution
 * did not happen, soon after a 429 (jittered, so replicas do not return together) or when the refusal
 * said (a busy connected account's calls, paced at its rate), later after a refused key or connection
 * (an operator has something to fix). */
function notAnAttemptDelaySeconds(outcome: Outcome): number {
  if (outcome.kind === 'not_done') return 0;
  if (outcome.kind !== 'rate_limited') return 30;
  return outcome.retryAfterSeconds ?? 1 + Math.floor(Math.random() * 5);
}
/** A reconcile-before-retry create under way: `running` settles when the call returns (`returned`). */
interface RunningCreate {
  operationId: string;
  fence: number;
  running: Promise<void>;
  returned: boolean;
}

const completed: Disposition = { status: 'completed' };
/** A job's output is jsonb: a reason carrying U+0000 or half an emoji made pg-boss refuse the whole
 * disposition (a dead letter became a retry, and another check or call). */
const retryLater = (reason: string): Disposition => ({ status: 'failed', output: { reason: storableText(reason) } });
const deadLetter = (reason: string): Disposition => ({ status: 'deadletter', output: { reason: storableText(reason) } });
/** The operation a job drives, when its payload names one: anything else is a malformed job. */
const operationIdOf = (job: Job<OperationJob>): string | undefined => {
  const id: unknown = job.data?.operationId;
  return typeof id === 'string' && isOperationId(id) ? id : undefined;
};

export class Dispatcher {
  private readonly deps: DispatcherDeps;
  private readonly opts: DispatcherOptions;
  private readonly log: Logger;
  private draining = false;
  /** Aborted as the drain begins: a prune run in progress ends after its batch in hand. */
  private readonly stopping = new AbortController();
  /** Claims made ahead that wait for a slot, each to be told when the drain begins (it gives its claim
   * back). Held only while waiting: a promise per job kept until the drain would grow without bound. */
  private readonly waitingForSlots = new Set<() => void>();
  /** Operations whose claims made ahead are being given back: the drain leaves their leases to that. */
  private readonly givingBack = new Set<string>();
  private relaying: Promise<void> | undefined;
  private wakeRelay: (() => void) | undefined;
  /** Set by a wake-up while the relay was at work: it looks again before it sleeps. */
  private relayWanted = false;
  private relayListening: { close(): Promise<void> } | undefined;
  /** This relay's registration in relay_sleepers lapses then (local clock), if it has one. */
  private asleepUntil: number | undefined;
  /** When the relay's passes began to find nothing, awake. */
  private emptySince: number | undefined;
  private starting = true;
  /** When it heard its last three NOTIFYs, asleep (oldest first). */
  private heardAt: [number, number, number] = [0, 0, 0];
  /** Each kind's policy, and the table its claims choose the call from (callTable). */
  private readonly policies = new Map<string, { policy: Policy; calls: EffectCall[] }>();
  /** One per operation in hand, with its id: aborted when its lease is lost, or all of them when the drain
   * gives up (whose leases it then keeps). A call given up past its timeout that keeps its lease
   * (keepUntilReturned) stays here until it returns. */
  private readonly calls = new Map<AbortController, string>();
  /** Of those, the reconcile-before-retry creates, with their claims' fences: one given up, past its
   * timeout or by the drain, may still act after any check until it returns (holdWhileRunning). */
  private readonly creates = new Map<AbortController, RunningCreate>();
  /** Each kind's calls given up past its timeout and still running. A given-up call frees its slot, so
   * that a hung service holds none; but a kind's next call would then start, hang and be given up in turn,
   * each still running (a reconcile-before-retry create's lease renewed meanwhile): past the concurrency,
   * a given-up call keeps its slot until it returns. */
  private readonly overdue = new Map<string, number>();

  constructor(deps: DispatcherDeps, opts: DispatcherOptions) {
    this.deps = deps;
    this.opts = opts;
    this.log = deps.log;
  }

  get isDraining(): boolean {
    return this.draining;
  }

  /** The kinds whose queues this replica works. */
  get kinds(): readonly string[] {
    return this.deps.kinds.names;
  }

  /**
   * The replica has `concurrency` slots, shared by its kinds (calls in flight at once; the application's
   * kinds together take at most what leaves the built-in ones a quarter: a slot is taken after the claim
   * and given back when the call returns, its outcome recorded outside it; claimed jobs take them in fetch
   * order, whatever their kind), and twice as many claims. Each kind has as many
   * pg-boss loops as slots, each fetching up to fetchBatch jobs per round trip; pg-boss completes a loop's
   * batch in one statement, once all of it is done. A fetched job waits, unclaimed, for a free claim, then
   * claimed (its lease renewed) for a free slot. pg-boss waits out its
   * polling interval after every fetch unless the loop was notified meanwhile, so a loop wakes itself
   * (notifyWorker) once its batch is done: while there is a backlog it fetches again at once, and only an
   * empty fetch waits. NOTIFY wakes idle loops the moment a job is enqueued. As many loops as slots: a
   * loop held up by a slow call holds that call's slot only, so while a slot is free some loop is free to
   * fetch for it, and no slot idles behind a slow call (fewer loops of bigger batches were measured
   * faster at 0 ms, but k slow calls in k loops would idle slots). At most concurrency × fetchBatch jobs
   * of each kind are in hand.
   */
  async start(): Promise<void> {
    const { boss } = this.deps;
    const loop = { perJobResults: true, notifyPollingIntervalSeconds: 2, pollingIntervalSeconds: 0.5 } as const;
    const register = async (queue: string, handle: (job: Job<OperationJob>) => Promise<Disposition>, batchSize = 1) => {
      let loopId: string | undefined;
      loopId = await boss.work<OperationJob>(queue, { ...loop, batchSize }, async (jobs: Job<OperationJob>[]) => {
        // Each job's own disposition: one whose handling threw (its claim's statement failed) is retried
        // alone, where a rejection would fail the whole batch, calls in flight and settled ones included.
        const results = await Promise.all(jobs.map(async (job) => ({ id: job.id, ...(await handle(job).catch((err: unknown) => this.threw(this.log.child({ jobId: job.id, operationId: operationIdOf(job) }), err))) })));
        if (loopId && !this.draining) boss.notifyWorker(loopId);
        return results;
      });
    };
    // The schedules first: a cron pg-boss cannot read then stops the start before any work loop claims.
    if (this.opts.reconcileCron) {
      await boss.schedule(RECONCILE_QUEUE, this.opts.reconcileCron);
      await boss.work(RECONCILE_QUEUE, { batchSize: 1, pollingIntervalSeconds: 5 }, async () => {
        const report = await reconcileSweep(this.deps.pool, this.deps.gateway, {
          owner: this.opts.workerId,
          leaseTtlMs: this.opts.leaseTtlMs,
          log: this.log,
          ...(this.opts.keyWindowSeconds !== undefined ? { keyWindowSeconds: this.opts.keyWindowSeconds } : {}),
          ...(this.opts.processingReviewDays !== undefined ? { processingReviewDays: this.opts.processingReviewDays } : {}),
        });
        const summary = { examined: report.examined, settled: report.settled, needsReview: report.needsReview, undriven: report.undriven.length };
        this.log.info(summary, 'reconcile sweep');
        return summary;
      });
    }
    if (this.opts.pruneCron) {
      await createPruneQueue(boss);
      await boss.schedule(PRUNE_QUEUE, this.opts.pruneCron);
      await boss.work(PRUNE_QUEUE, { batchSize: 1, pollingIntervalSeconds: 30 }, async () => {
        const pruned = await pruneHistory(this.deps.pool, this.opts.retentionDays ?? DEFAULT_RETENTION_DAYS, { signal: this.stopping.signal });
        this.log.info({ pruned }, 'history past its retention pruned');
        return pruned;
      });
    }
    // Calls in flight at once, and claims made ahead of them: a job claims its operation while the slots
    // are busy, so that a slot given back starts its next call at once, without a claim's round trip in
    // it, and the claims of a fetched batch go out together in one statement (measured with npm run
    // bench: 92 % -> 96-97 % of slots / latency at 100 ms; 1.06 -> 0.81-0.88 statements per operation
    // at 0 ms).
    // At most as many claims wait as there are slots: each holds its operation's lease, renewed while it
    // waits.
    const slots = new Slots(this.opts.concurrency);
    const claims = new Slots(CLAIMS_PER_SLOT * this.opts.concurrency);
    // The application's kinds together hold at most what leaves the built-in ones (the payments) a
    // quarter of each (one at least, when there are two): a service of the application's that hangs
    // until its timeoutMs must not keep a charge waiting for a slot behind its backlog.
    const shared = Math.max(1, this.opts.concurrency - Math.max(1, Math.floor(this.opts.concurrency / 4)));
    const applicationSlots = new Slots(shared, slots);
    const applicationClaims = new Slots(CLAIMS_PER_SLOT * shared, claims);
    for (const kind of this.kinds) {
      const builtIn = BUILT_IN_KINDS.includes(kind);
      const [kindSlots, kindClaims] = builtIn ? [slots, claims] : [applicationSlots, applicationClaims];
      await ensureKindQueues(boss, kind); // the built-in ones: by migrate
      const { policy } = this.deps.kinds.get(kind)!;
      this.policies.set(kind, { policy, calls: callTable(policy) });
      const batch = Math.min(this.opts.fetchBatch ?? FETCH_BATCH, this.opts.concurrency);
      const handle = (job: Job<OperationJob>) => traceDispatch(job, async () => {
        const releaseClaim = await kindClaims.take();
        try {
          return await this.handle(job, kind, () => kindSlots.request());
        } finally {
          releaseClaim();
        }
      });
      for (let i = 0; i < this.opts.concurrency; i++) await register(queueFor(kind), handle, batch);
      await register(deadQueueFor(kind), (job) => this.handleDeadLetter(job, kind));
    }
    await this.listenForOutboxRows();
    this.relaying = this.relay();
    this.log.info({ concurrency: this.opts.concurrency, leaseTtlMs: this.opts.leaseTtlMs, kinds: this.kinds }, 'dispatcher started');
  }

  /** The outboxes' NOTIFY (drizzle/0022_outbox_wake.sql), and every reconnect of the listener (a
   * notification may have been missed meanwhile), wake the relay while it sleeps; another replica's
   * registration makes every relay hear them, and one at work has no use for them. A listener that
   * cannot start leaves the relay to its poll. */
  private async listenForOutboxRows(): Promise<void> {
    const { listener, pool } = this.deps;
    if (!listener?.listen) return;
    const wake = () => {
      if (this.asleepUntil === undefined) return;
      this.heardAt = [this.heardAt[1], this.heardAt[2], Date.now()];
      this.relayWanted = true;
      this.wakeRelay?.();
    };
    try {
      this.relayListening = await listener.listen(pool.sql.relayChannel, wake, wake);
    } catch (err) {
      this.log.warn({ err }, 'cannot LISTEN for outbox rows; the relay polls');
    }
  }

  /** Moves confirmed orders' outbox rows to pg-boss jobs, in batches, until draining. */
  private async relay(): Promise<void> {
    const interval = this.opts.relayIntervalMs ?? 50;
    let last: RelayPass = { operations: 0, settlements: 0 };
    while (!this.draining) {
      let pause: number;
      this.relayWanted = false;
      try {
        last = await relayOutbox(this.deps.pool, this.deps.boss, RELAY_BATCH, last);
        const relayed = Math.max(last.operations, last.settlements);
        pause = this.relayListening ? await this.relayPause(relayed, interval) : relayed === RELAY_BATCH ? 0 : interval;
        if (pause === 0 || this.relayWanted) continue; // more waiting, rows arrived while it relayed, or the drain
      } catch (err) {
        this.log.warn({ err }, 'outbox relay failed; retrying');
        last = { operations: 0, settlements: 0 };
        pause = 1_000;
      }
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, pause);
        this.wakeRelay = () => {
          clearTimeout(timer);
          resolve();
        };
      });
    }
  }

  /**
   * After a listening relay's pass that moved `relayed` rows: how long it waits for the next (0: at once),
   * and whether it sleeps, registered in relay_sleepers so that the outboxes' writers NOTIFY it. It
   * registers once its passes have found nothing for SLEEP_AFTER_MS (at once when it starts), and looks
   * once more (rows committed before the registration sent no NOTIFY). Hearing a third NOTIFY within
   * `interval` (an idle order sends two: its charge's row and its settlement event's), or finding a full
   * batch, it leaves and polls every `interval`: a busy outbox costs its writers no NOTIFY, whose lock
   * would serialize their commits.
   */
  private async relayPause(relayed: number, interval: number): Promise<number> {
    const { pool } = this.deps;
    const now = Date.now();
    if (this.asleepUntil === undefined) {
      if (relayed > 0) {
        this.emptySince = undefined;
        return relayed === RELAY_BATCH ? 0 : interval;
      }
      this.emptySince ??= now;
      if (now - this.emptySince < SLEEP_AFTER_MS && !this.starting) return interval;
      this.starting = false;
      if (!(await this.register())) return interval;
      this.heardAt = [0, 0, 0];
      return 0;
    }
    if (relayed === RELAY_BATCH || now - this.heardAt[0] < interval) {
      this.asleepUntil = undefined;
      this.emptySince = undefined;
      await pool.query(pool.sql.relayWakes(this.opts.workerId));
      return relayed === RELAY_BATCH ? 0 : interval;
    }
    if (this.asleepUntil - now < (ASLEEP_TTL_S * 1000) / 3) await this.register();
    return Math.max(interval, ASLEEP_POLL_MS);
  }

  /** Registers (or renews) this relay in relay_sleepers. On a schema without it (a worker started before
   * its migration ran) the relay stops listening and polls. */
  private async register(): Promise<boolean> {
    const { pool } = this.deps;
    try {
      await pool.query(pool.sql.relaySleeps(this.opts.workerId, ASLEEP_TTL_S));
    } catch (err) {
      if ((err as { code?: string }).code !== '42P01') throw err;
      this.log.warn({ err }, 'relay_sleepers is missing (migrate); the relay polls');
      const listening = this.relayListening;
      this.relayListening = undefined;
      void listening?.close().catch(() => {});
      return false;
    }
    this.asleepUntil = Date.now() + ASLEEP_TTL_S * 1000;
    return true;
  }

  /** Stops claiming, lets in-flight operations finish within graceMs, then gives back this replica's
   * leases, but those of calls still running. */
  async drain(graceMs: number): Promise<{ finished: boolean }> {
    this.draining = true;
    this.stopping.abort();
    for (const giveUp of [...this.waitingForSlots]) giveUp();
    this.relayWanted = true; // a relay inside a pass must not then wait out its pause
    this.wakeRelay?.();
    await this.relaying;
    const { boss, pool } = this.deps;
    if (this.asleepUntil !== undefined) {
      await pool.query(pool.sql.relayWakes(this.opts.workerId)).catch((err: Error) => this.log.warn({ err }, 'could not leave relay_sleepers; its registration lapses'));
    }
    // Not awaited: closing a socket to a host that vanished waits on TCP, and the process is leaving.
    void this.relayListening?.close().catch((err: Error) => this.log.warn({ err }, 'could not close the outbox listener'));
    const stopped = Promise.all(
      [...this.kinds.flatMap((kind) => [queueFor(kind), deadQueueFor(kind)]), RECONCILE_QUEUE, PRUNE_QUEUE].map((queue) => boss.offWork(queue, { wait: true })),
    );
    // With the database gone no call in flight can record its outcome: waiting would only delay the
    // exit. Its leases expire and another replica resends with the same key, as after kill -9.
    const reachable = await pool.query('select 1').then(() => true, () => false);
    let timer: NodeJS.Timeout | undefined;
    const finished = await Promise.race([
      stopped.then(() => true),
      new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(false), reachable ? graceMs : 0))),
    ]);
    clearTimeout(timer);
    // Calls still running are abandoned: an application's effect is told so through its signal. Their
    // leases are kept, to expire as after kill -9: the request may still be on its way, and a claim made
    // before it lands would resend it, or check an effect not done yet and execute it again.
    const inFlight = [...this.calls.values(), ...this.givingBack];
    // A create still running may act after this process has let go of it (an application's own worker
    // goes on running after stop()): its operation is held for a person until it returns.
    await Promise.all([...this.creates.values()].map((create) => this.holdWhileRunning(create, this.log.child({ operationId: create.operationId, fence: create.fence }))));
    for (const call of this.calls.keys()) call.abort(new CallAbandoned('the worker is shutting down'));
    const released = await pool.query(pool.sql.releaseLeasesOf(this.opts.workerId, inFlight)).then(
      ({ rows }) => rows.length,
      (err: Error) => this.log.warn({ err }, 'could not release leases: they expire by themselves'),
    );
    this.log.info({ finished, databaseReachable: reachable, leasesReleased: released ?? 0 }, 'dispatcher drained');
    return { finished };
  }

  /** Claims the job's operation, then waits for a slot (`takeSlot`) to make its call; the slot is given
   * back once the call has returned (the outcome is recorded outside it). */
  private async handle(job: Job<OperationJob>, kind: string, takeSlot: () => ReturnType<Slots['request']>): Promise<Disposition> {
    const { pool, kinds, boss, metrics } = this.deps;
    const operationId = operationIdOf(job);
    const log = this.log.child({ jobId: job.id, operationId, kind, jobRetry: job.retryCount });
    if (operationId === undefined) {
      log.error({ data: job.data }, 'malformed job');
      return deadLetter('malformed job');
    }

    // SIGTERM: no new claims. A job that waited until now is left to another replica.
    if (this.draining) return retryLater('this replica is shutting down');

    const keyWindowSeconds = this.opts.keyWindowSeconds ?? KEY_WINDOW_SECONDS;
    const { policy, calls } = this.policies.get(kind)!;
    const claimSentAt = performance.now();
    const claim = await claimAttempt(pool, operationId, this.opts.workerId, this.opts.leaseTtlMs, keyWindowSeconds, kind, policy, calls);
    if (!claim.lease) return this.notClaimed(claim.current, log);
    const { lease } = claim;
    const { fence } = lease;
    traceOperation(lease.operation, fence);
    const opLog = log.child({ fence });
    if (lease.previousOwner) {
      metrics.leaseTakeovers.inc();
      opLog.warn({ previousOwner: lease.previousOwner }, 'took over an expired lease');
    }

    // The lease is kept from the claim on, through the wait for a slot.
    const call = new AbortController();
    const held = keepLease(call, {
      ttlMs: this.opts.leaseTtlMs,
      claimSentAt,
      renew: () => renewLease(pool, operationId, fence, this.opts.leaseTtlMs),
      log: opLog,
    });
    const slot = await this.slotWithin(takeSlot, this.longestWait(lease, policy, keyWindowSeconds), call.signal);
    // A call given up past its timeout while its kind has as many still running keeps the slot until it
    // returns; an application's kind keeps only its share's (of at most all but the built-in kinds' quarter,
    // all of one slot): the replica's slot goes back, or a service hung for good held the payments' last.
    let holdSlotUntil: Promise<void> | undefined;
    const endCall = slot && (() => (holdSlotUntil ? (slot.releaseWithin?.(), void holdSlotUntil.then(slot)) : slot()));
    const givenUp = (running: Promise<void>) => {
      const stillRunning = this.overdue.get(kind) ?? 0;
      if (stillRunning >= this.opts.concurrency) holdSlotUntil = running;
      this.overdue.set(kind, stillRunning + 1);
      void running.then(() => {
        const left = this.overdue.get(kind)! - 1;
        if (left) this.overdue.set(kind, left);
        else this.overdue.delete(kind);
      });
    };
    held.check();
    if (endCall) {
      // Counted with the calls in flight meanwhile: a drain then gives it up and keeps its lease, rather
      // than release the lease of a claim whose renewal may succeed after, and whose call would then go out.
      this.calls.set(call, operationId);
      await held.confirm(LEASE_CONFIRMED_WITHIN_MS);
      this.calls.delete(call);
    }
    if (call.signal.aborted && !(call.signal.reason instanceof CallAbandoned)) {
      // Taken over, or settled from outside, while it waited (a renewal found another fence): no call; the
      // job comes back, and its next claim finds the operation settled or leased.
      held.stop();
      endCall?.();
      metrics.fencedOut.inc();
      return retryLater('the lease was taken over while the claim waited for a slot');
    }
    if (!endCall || call.signal.aborted) {
      // Draining before this claim got a slot, no slot within the longest wait, or its lease's deadline
      // passed while it waited (renewals failed): it sent nothing, so it is given back uncounted, its key
      // window as it was.
      held.stop();
      endCall?.();
      this.givingBack.add(operationId);
      try {
        // A renewal given up at the lease's deadline may still run, holding the row's lock: the give-back
        // waits for it (its slot already free), rather than for a lock_timeout that would leave it counted.
        await held.idle();
        return await this.giveBack(job, kind, operationId, fence, lease.begun, policy);
      } catch (err) {
        opLog.warn({ err }, 'could not give back a claim that sent nothing: its lease expires');
        return retryLater('the claim could not be given back');
      } finally {
        this.givingBack.delete(operationId);
      }
    }

    // A check that found the execution before it never happened, in a job pg-boss has retried (that
    // execution failed): the next execution waits for pg-boss's retry, spent and backed off as any failed
    // attempt's. Replaced by a fresh job, the retries would start again at every check, and an effect
    // that always fails would run every few seconds for ever, never dead-lettered, never held for a person.
    const followsFailure = (outcome: Outcome) => outcome.kind === 'not_done' && job.retryCount > 0;
    metrics.inFlight.inc();
    const started = performance.now();
    this.calls.set(call, operationId);
    const checkedBeforeRetry = policy === 'reconcile-before-retry';
    let released = false;
    let kept = false; // the lease outlives this job: keepUntilReturned ends it
    try {
      const run = await executeOperation(pool, kinds, operationId, fence, {
        keyWindowSeconds,
        claimed: lease.operation,
        begun: lease.begun,
        log: opLog,
        signal: call.signal,
        checkLease: held.check,
        onCallStarted: (made, work) => {
          if (made !== 'create' || !checkedBeforeRetry) return;
          const create: RunningCreate = { operationId, fence, running: work.then(() => {}, () => {}), returned: false };
          void create.running.then(() => (create.returned = true));
          this.creates.set(call, create);
        },
        onCallEnded: endCall,
        onGivenUp: (running) => {
          givenUp(running);
          metrics.callsOverdue.inc();
          void running.finally(() => metrics.callsOverdue.dec());
        },
        ...(this.opts.processingReviewDays !== undefined ? { processingReviewDays: this.opts.processingReviewDays } : {}),
        // Nothing executed, so this was no attempt: it must not spend the job's retries (40 of them would
        // dead-letter an operation that only ever met 429s). Nor may a payment that takes days (it would
        // be dead-lettered after some hours). The job completes, and a fresh one drives the operation
        // again later, in the transaction that records the outcome: no instant without a job.
        onRescheduled: async (tx, op, outcome, recheckSeconds) => {
          if (followsFailure(outcome)) return;
          if (!(await this.replaceJob(tx, job, op, recheckSeconds ?? notAnAttemptDelaySeconds(outcome)))) {
            opLog.warn('job attempt was no longer ours at completion; the operation was recorded all the same');
          }
        },
      });
      const { operation: op, policy, outcome } = run;
      released = outcome !== null; // a recorded (committed) outcome, or a flag for review, ended the lease
      if (run.call && outcome && policy) metrics.gatewayOutcomes.inc({ call: run.call, outcome: outcome.kind, kind: op.kind, policy });
      if (run.possibleDuplicate) metrics.possibleDuplicates.inc({ kind: op.kind });
      if (run.from !== op.status) metrics.transitions.inc({ from: run.from, to: op.status });
      opLog.debug({ durationMs: Math.round(performance.now() - started), status: op.status }, 'job handled');
      if (isSettled(op.status)) {
        metrics.jobs.inc({ result: 'settled' });
        return completed; // by pg-boss, after the outcome
      }
      if (outcome && reschedules(outcome) && !followsFailure(outcome)) {
        metrics.jobs.inc({ result: outcome.kind === 'processing' ? 'processing' : 'rescheduled' });
        return completed; // done in the outcome's transaction, with a new job for later
      }
      if (outcome?.kind === 'needs_review' && !outcome.retry) {
        metrics.jobs.inc({ result: 'review' });
        return deadLetter(outcome.reason);
      }
      metrics.jobs.inc({ result: 'retry' });
      return retryLater(`${op.status}: ${op.last_error ?? outcome?.kind}`);
    } catch (err) {
      if (err instanceof CallTimedOut) {
        released = kept = true;
        await this.keepUntilReturned(err.running, call, held, operationId, fence, opLog);
        metrics.jobs.inc({ result: 'abandoned' });
        return retryLater(err.message);
      }
      if (err instanceof CallAbandoned) {
        released = true; // kept, to expire
        // A create that ignored its signal and outlived its time may act after its lease lapsed.
        const create = this.creates.get(call);
        if (create && err.running) await this.holdWhileRunning(create, opLog);
        opLog.warn({ reason: err.message }, 'call abandoned: no outcome recorded; its lease expires before another claim');
        metrics.jobs.inc({ result: 'abandoned' });
        return retryLater(err.message);
      }
      if (err instanceof StaleFenceError) {
        metrics.fencedOut.inc();
        released = true; // the lease is someone else's now
        metrics.jobs.inc({ result: 'fenced_out' });
        const stale = { fence: err.fence, currentFence: err.currentFence, currentStatus: err.currentStatus };
        // The claim that fenced this one out may let go without settling (an operator's resolution that
        // was refused): the job must go on driving it. Its redelivery waits while another claim is live.
        if (err.currentStatus !== undefined && !isSettled(err.currentStatus)) {
          opLog.warn(stale, 'fenced out: another claim owns this unsettled operation; the job will be retried');
          return retryLater(`fenced out by fence ${err.currentFence}`);
        }
        opLog.warn(stale, 'fenced out: another claim owns this operation; abandoning the job');
        return completed;
      }
      return this.threw(opLog, err);
    } finally {
      endCall();
      metrics.inFlight.dec();
      if (!kept) {
        held.stop();
        this.calls.delete(call);
        this.creates.delete(call);
      }
      if (!released) await releaseLease(pool, operationId, fence).catch(() => {});
    }
  }

  /** A job whose handling failed: retried by pg-boss, with backoff. */
  private threw(log: Logger, err: unknown): Disposition {
    log.error({ err }, 'job failed; it will be retried');
    this.deps.metrics.jobs.inc({ result: 'error' });
    return retryLater(String(err));
  }

  /**
   * A create given up past its kind's timeout under reconcile-before-retry may still act, after any check
   * found it not done: until it returns, its lease is renewed past any deadline (LocalLease.keep), so
   * that no claim, requeue or resolution acts on the operation; its slot and its job go on. It is marked
   * too (markCreateMayStillAct), for what no renewal covers: the lease lapsing all the same (the database
   * away longer than the lease), or this process stopping while the call goes on (an application's own
   * worker): a claim after that holds the operation for a person instead of trusting its check. Once it
   * returns (its result is only logged: the next claim's check establishes what happened) the mark and
   * the lease go, if they are still this claim's.
   */
  private async keepUntilReturned(running: Promise<void>, call: AbortController, held: LocalLease, operationId: string, fence: number, log: Logger): Promise<void> {
    const { pool } = this.deps;
    const since = performance.now();
    held.keep();
    log.warn('call given up past its timeout: it may still act, so its lease is kept until it returns; its slot goes on');
    const create = this.creates.get(call);
    if (create) await this.holdWhileRunning(create, log);
    void running.then(async () => {
      held.stop();
      this.calls.delete(call);
      this.creates.delete(call);
      log.warn({ overdueMs: Math.round(performance.now() - since) }, 'call given up past its timeout returned: its lease is released, and the next claim checks what it did');
      if (!(call.signal.reason instanceof CallAbandoned)) await releaseLease(pool, operationId, fence).catch(() => {});
    });
  }

  /**
   * Holds the operation of a create that has not returned for a person (markCreateMayStillAct: fenced,
   * its lease kept), until it returns, when the mark goes (if still this claim's): a claim meanwhile, its
   * lease lapsed, trusts no check that finds nothing done. Marked first, so that no clear comes before it.
   */
  private async holdWhileRunning(create: RunningCreate, log: Logger): Promise<void> {
    const { pool } = this.deps;
    const { operationId, fence } = create;
    if (create.returned) return;
    await markCreateMayStillAct(pool, operationId, fence).catch((err: Error) =>
      log.error({ err }, 'could not mark a create that may still act: a claim after its lease checks it, and may execute it again'),
    );
    void create.running.then(() =>
      clearCreateMayStillAct(pool, operationId, fence).catch((err: Error) => log.warn({ err }, 'could not clear the mark of a create that returned: a person resolves it')),
    );
  }

  /**
   * Gives back a claim made ahead that sent nothing. Draining: the job goes back to pg-boss for another
   * replica (a retry spent). Otherwise no slot came in time: that was no attempt, so, in the transaction
   * that gives the claim back, the job completes and a fresh one drives the operation at once, spending
   * no retry (whichever replica has a slot takes it; a claim of it chooses its call anew).
   */
  private async giveBack(job: Job<OperationJob>, kind: string, id: string, fence: number, begun: BegunAttempt | undefined, policy: Policy): Promise<Disposition> {
    const { pool, metrics } = this.deps;
    if (this.draining) {
      await releaseUnsentClaim(pool, id, fence, begun, policy);
      return retryLater('this replica is shutting down');
    }
    await inTransaction(pool, async (tx) => {
      await releaseUnsentClaim(tx, id, fence, begun, policy);
      await this.replaceJob(tx, job, { id, kind }, 0);
    });
    metrics.jobs.inc({ result: 'rescheduled' });
    return completed;
  }

  /** In `tx`: completes `job`, fenced to the attempt this delivery fetched, and enqueues a fresh job for
   * `op` in `delaySeconds`, spending no retry. False (nothing enqueued) when the attempt was no longer
   * this delivery's: the job was redelivered, and its other delivery drives the operation. */
  private async replaceJob(tx: Tx, job: Job<OperationJob>, op: { id: string; kind: string }, delaySeconds: number): Promise<boolean> {
    const { boss } = this.deps;
    // `affected` is returned at runtime though not declared.
    const { affected } = (await boss.complete(queueFor(op.kind), { id: job.id, retryCount: job.retryCount }, null, { db: bossDb(tx) })) as { affected: number };
    if (affected === 0) return false;
    await untraced(() => enqueueOperation(boss, bossDb(tx), op, delaySeconds));
    return true;
  }

  /**
   * How long a claim made ahead may wait for a slot: its lease's TTL, so that a replica whose slots are
   * stuck (an effect that never returns) keeps no operation from other replicas for long; and a create
   * sent again under a key the provider already holds (idempotent-key) must go out inside the key window
   * its claim judged it in (measured on the database's clock: the claim's now() is updated_at), or be
   * claimed anew, which then reconciles instead. An at-least-once create has no key window: bounded by
   * one, a create first sent over a window ago would be given back at once, and claimed again, without end.
   */
  private longestWait(lease: { operation: { updated_at: Date }; begun?: BegunAttempt | undefined }, policy: Policy, keyWindowSeconds: number): number {
    const ttl = this.opts.leaseTtlMs;
    const sentBefore = policy === 'idempotent-key' && lease.begun?.call === 'create' ? lease.begun.attempt.prev_first_attempted_at : null;
    if (!sentBefore) return ttl;
    const windowLeft = sentBefore.getTime() + keyWindowSeconds * 1000 - lease.operation.updated_at.getTime();
    return Math.max(0, Math.min(ttl, windowLeft - leaseMargin(ttl)));
  }

  /** A slot's release, or undefined once the drain has begun, `maxWaitMs` passed or the claim's lease was
   * lost (`lost` aborted) first: the request is then withdrawn, and a slot given meanwhile goes on at
   * once to the next in line. */
  private slotWithin(takeSlot: () => ReturnType<Slots['request']>, maxWaitMs: number, lost: AbortSignal): Promise<Release | undefined> {
    if (this.draining || lost.aborted) return Promise.resolve(undefined);
    return new Promise((resolve) => {
      const slot = takeSlot();
      const giveUp = () => {
        clearTimeout(timer);
        lost.removeEventListener('abort', giveUp);
        this.waitingForSlots.delete(giveUp);
        slot.cancel();
        resolve(undefined);
      };
      const timer = setTimeout(giveUp, maxWaitMs);
      lost.addEventListener('abort', giveUp);
      this.waitingForSlots.add(giveUp);
      void slot.taken.then((release) => {
        if (!this.waitingForSlots.delete(giveUp)) return release();
        clearTimeout(timer);
        lost.removeEventListener('abort', giveUp);
        resolve(release);
      });
    });
  }

  /** No claim: settled (nothing to do), unknown (a broken job), or leased by a live claim or locked by
   * another transaction (later: a claim never waits behind an application's lock). */
  private notClaimed(now: (Pick<OperationState, 'status' | 'lease_owner'> & { locked?: boolean }) | undefined, log: Logger): Disposition {
    if (!now) {
      log.error('job for an operation that does not exist');
      return deadLetter('no such operation');
    }
    if (isSettled(now.status)) return completed;
    if (now.locked) {
      log.info('operation row locked by another transaction; retrying later');
      return retryLater('row locked by another transaction');
    }
    this.deps.metrics.leaseBusy.inc();
    log.info({ holder: now.lease_owner }, 'operation leased by another live claim; retrying later');
    return retryLater(`leased by ${now.lease_owner}`);
  }

  /** Retries ran out, or the outcome held the operation for a person at once: it is flagged (never
   * silently dropped), keeping a reason the executor already recorded. Should this handler itself keep
   * failing, the reconcile sweep flags any unsettled operation that no job drives. */
  private async handleDeadLetter(job: Job<OperationJob>, kind: string): Promise<Disposition> {
    const { pool } = this.deps;
    const operationId = operationIdOf(job);
    const log = this.log.child({ jobId: job.id, operationId, queue: deadQueueFor(kind) });
    if (operationId === undefined) return completed; // malformed: no operation to hold for a person
    const lease = await claimOperation(pool, operationId, this.opts.workerId, this.opts.leaseTtlMs, 0);
    if (!lease) return this.notClaimed(await peekOperation(pool, operationId), log);
    const op = lease.operation;
    const reason = op.review_reason ?? `retries exhausted: the ${kind} job was dead-lettered after ${KIND_QUEUE_OPTIONS.retryLimit} retries (last error: ${op.last_error ?? 'none'})`;
    try {
      await flagForReview(pool, operationId, lease.fence, reason);
    } catch (err) {
      await releaseLease(pool, operationId, lease.fence).catch(() => {});
      throw err;
    }
    log.error({ reason }, 'operation needs review');
    return completed;
  }
}
