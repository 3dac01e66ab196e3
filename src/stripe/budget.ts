// Stripe's rate limit as a budget shared by every replica. Stripe limits the account (live 100
// requests/s, test mode 25, search 20), not a process, so the tokens live in PostgreSQL: one bucket row
// per budget, refilled by the database clock and taken from by one statement under the row's lock
// (takeRateBudget). However many replicas run, together they never get more than rate × elapsed + capacity.
//
// A statement per Stripe call would add a round trip to every call, so each replica takes tokens in
// small batches into a local reserve and hands them to its waiting calls:
//   - it asks for what its waiting calls need, plus what it spent in the last quarter second (prefetch),
//     never more than the bucket's capacity (0.4 s of the rate): no replica can take much at once;
//   - a token not spent within TOKEN_TTL_MS expires: a replica holds no budget another one could use;
//   - when the bucket runs short it comes back when the bucket should hold what it still needs, after
//     a random 50–100 % of that time, so replicas interleave instead of polling in step, and the bucket
//     is polled before it can overflow (no refill is lost while anyone waits).
//
// Priority: dispatch calls (creates and the dispatcher's own retrieves and searches) go first; background
// calls (the reconcile sweep, the drift report) take a token only when no dispatch call waits in this
// replica, and get nothing from the bucket while a dispatch take anywhere in the fleet came up short in
// the last YIELD_MS (the row remembers when one last did). Under a sustained backlog, reconciliation waits.
// Within a priority, the calls of each account (a connected account, or the platform's own) are served
// in turn, oldest first: a busy account's queue of calls never holds another account's call behind it.
//
// Connect (AccountBudgets): a request on a connected account also takes from that account's own bucket,
// one row per account (`<budget>@acct_…`), its Budget made on the account's first call and dropped once
// idle, so a replica keeps only the accounts it used lately, whatever their number.
import { Counter, Gauge, Histogram, type Registry } from 'prom-client';
import type { Queryable } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';

export type Priority = 'dispatch' | 'background';

/** The bucket's capacity, and so the most one replica takes at once, in seconds of the rate. */
const CAPACITY_SECONDS = 0.4;
/** Unspent local tokens expire this soon. */
const TOKEN_TTL_MS = 250;
/** Background takes yield this long after a dispatch take came up short. */
const YIELD_MS = 1_000;
/** Never poll the bucket more often than this (per replica and budget)... */
const MIN_POLL_MS = 10;
/** ...nor less often while calls wait (a low rate would otherwise sleep past their deadlines). */
const MAX_POLL_MS = 1_000;

export interface BudgetOptions {
  /** The bucket's row: one per budget and installation (OUTBOXD_SCHEMA). */
  name: string;
  /** Tokens per second for the whole fleet. */
  rate: number;
  /** The `budget` label of its metrics (default: name): one for every connected account's bucket, so
   * that their number never multiplies the metrics' series. */
  label?: string;
  log?: Logger;
  metrics?: BudgetMetrics;
}

/** Whose call a take is: a connected account, or null for the platform's own. */
export type AccountKey = string | null;

/** A take that got no token before its deadline. */
export class BudgetTimeout extends Error {
  override name = 'BudgetTimeout';
}

interface Waiter {
  priority: Priority;
  account: AccountKey;
  since: number;
  resolve(): void;
  reject(err: Error): void;
  timer: NodeJS.Timeout;
}

/** One priority's waiting calls: a queue per account, the accounts served in turn. */
class Turns {
  /** In turn order: the account served goes to the back. */
  private readonly byAccount = new Map<AccountKey, Waiter[]>();
  length = 0;

  push(w: Waiter): void {
    const queue = this.byAccount.get(w.account);
    if (queue) queue.push(w);
    else this.byAccount.set(w.account, [w]);
    this.length++;
  }

  remove(w: Waiter): boolean {
    const queue = this.byAccount.get(w.account);
    const at = queue ? queue.indexOf(w) : -1;
    if (at < 0) return false;
    queue!.splice(at, 1);
    if (queue!.length === 0) this.byAccount.delete(w.account);
    this.length--;
    return true;
  }

  /** The oldest call of the account whose turn it is. */
  shift(): Waiter | undefined {
    const next = this.byAccount.entries().next();
    if (next.done) return undefined;
    const [account, queue] = next.value;
    const w = queue.shift()!;
    this.byAccount.delete(account);
    if (queue.length > 0) this.byAccount.set(account, queue);
    this.length--;
    return w;
  }

  drain(): Waiter[] {
    const all = [...this.byAccount.values()].flat();
    this.byAccount.clear();
    this.length = 0;
    return all;
  }
}

export class Budget {
  readonly name: string;
  readonly rate: number;
  readonly capacity: number;
  private readonly label: string;
  private readonly db: Queryable;
  private readonly log: Logger | undefined;
  private readonly metrics: BudgetMetrics;
  /** Expiry (performance.now()) of each token in the local reserve, oldest first. */
  private readonly reserve: number[] = [];
  private readonly queues: Record<Priority, Turns> = { dispatch: new Turns(), background: new Turns() };
  private running = false;
  private closed = false;
  private pausedUntil = 0;
  private sleeping: { priority: Priority; wake(): void } | undefined;
  /** Takes in the last second or so (an exponentially decaying count). */
  private demand = 0;
  private demandAt = performance.now();

  constructor(db: Queryable, opts: BudgetOptions) {
    if (!(opts.rate > 0)) throw new Error(`a budget's rate must be positive, not ${opts.rate}`);
    this.db = db;
    this.name = opts.name;
    this.label = opts.label ?? opts.name;
    this.rate = opts.rate;
    this.capacity = Math.max(1, Math.round(opts.rate * CAPACITY_SECONDS));
    this.log = opts.log;
    this.metrics = opts.metrics ?? budgetMetrics();
    this.metrics.limit.set({ budget: this.label }, this.rate);
  }

  /**
   * Resolves once a token is this caller's; rejects with BudgetTimeout at `deadline` (Date.now() ms), or
   * with `signal`'s reason once it aborts (the call was given up: its place in the queue goes to others).
   * `account`: whose call it is (null: the platform's), for the turns.
   */
  take(priority: Priority, deadline: number, account: AccountKey = null, signal?: AbortSignal): Promise<void> {
    const started = performance.now();
    this.noteDemand(started);
    if (signal?.aborted) return Promise.reject(signal.reason);
    if (this.closed) return Promise.reject(new BudgetTimeout(`the ${this.name} budget is closed`));
    this.dropExpired(started);
    if (this.reserve.length > 0 && (priority === 'dispatch' || this.queues.dispatch.length === 0)) {
      this.reserve.shift();
      this.metrics.waited.observe({ budget: this.label, priority }, 0);
      return Promise.resolve();
    }
    return new Promise<void>((resolve, reject) => {
      const givenUp = () => {
        if (!this.queues[priority].remove(waiter)) return;
        clearTimeout(waiter.timer);
        reject(signal!.reason);
      };
      const waiter: Waiter = {
        priority,
        account,
        since: started,
        resolve: () => {
          signal?.removeEventListener('abort', givenUp);
          resolve();
        },
        reject: (err) => {
          signal?.removeEventListener('abort', givenUp);
          reject(err);
        },
        timer: setTimeout(() => {
          if (!this.queues[priority].remove(waiter)) return;
          this.metrics.timeouts.inc({ budget: this.label, priority });
          waiter.reject(new BudgetTimeout(`no ${this.name} token within ${Math.round(performance.now() - started)} ms (${this.rate}/s for the fleet)`));
        }, Math.max(0, deadline - Date.now())),
      };
      signal?.addEventListener('abort', givenUp, { once: true });
      this.queues[priority].push(waiter);
      if (priority === 'dispatch' && this.sleeping?.priority === 'background') this.sleeping.wake();
      this.kick();
    });
  }

  /**
   * Stripe answered 429 rate_limit: the account is over its limit whatever the bucket says (another
   * client of the account, a limit lowered by Stripe). Drop the local reserve and take nothing for a
   * moment, jittered so that replicas do not come back together.
   */
  backOff(ms = 500 + Math.random() * 500): void {
    this.metrics.backOffs.inc({ budget: this.label });
    this.metrics.expired.inc({ budget: this.label }, this.reserve.length);
    this.reserve.length = 0;
    this.pausedUntil = Math.max(this.pausedUntil, performance.now() + ms);
  }

  /** Stops taking; calls still waiting get BudgetTimeout at once. */
  close(): void {
    this.closed = true;
    this.sleeping?.wake();
    for (const queue of Object.values(this.queues)) {
      for (const w of queue.drain()) {
        clearTimeout(w.timer);
        w.reject(new BudgetTimeout(`the ${this.name} budget closed while a call waited`));
      }
    }
  }

  /** Nothing waits, is paused or was taken for `ms`: dropping it loses nothing the bucket's row does not keep. */
  idleFor(ms: number): boolean {
    const now = performance.now();
    return !this.running && this.waiting() === 0 && now >= this.pausedUntil && now - this.demandAt >= ms;
  }

  private waiting(): number {
    return this.queues.dispatch.length + this.queues.background.length;
  }

  private kick(): void {
    if (this.running || this.closed) return;
    this.running = true;
    void this.refill().finally(() => {
      this.running = false;
      if (this.waiting() > 0) this.kick();
    });
  }

  /** One loop per budget and replica while calls wait: at most one statement in flight. */
  private async refill(): Promise<void> {
    while (!this.closed && this.waiting() > 0) {
      const paused = this.pausedUntil - performance.now();
      if (paused > 0) {
        await this.sleep(paused, 'dispatch');
        continue;
      }
      const background = this.queues.dispatch.length === 0;
      const want = Math.min(this.capacity, this.waiting() + this.prefetch());
      let grant: { granted: number; remaining: number; yielded: boolean };
      try {
        grant = await this.fetch(want, background);
      } catch (err) {
        // The database is away: waiting calls time out by their deadlines; nothing is sent unbudgeted.
        this.log?.warn({ err, budget: this.name }, 'could not take from the shared Stripe budget; retrying');
        await this.sleep(1_000, 'dispatch');
        continue;
      }
      const expires = performance.now() + TOKEN_TTL_MS;
      for (let i = 0; i < grant.granted; i++) this.reserve.push(expires);
      this.handOut();
      if (this.waiting() === 0) break;
      const need = Math.min(this.capacity, this.waiting());
      const ms = grant.yielded ? YIELD_MS : ((need - grant.remaining) / this.rate) * 1000;
      await this.sleep(Math.min(MAX_POLL_MS, Math.max(MIN_POLL_MS, ms * (0.5 + Math.random() / 2))), background ? 'background' : 'dispatch');
    }
  }

  private async fetch(want: number, background: boolean): Promise<{ granted: number; remaining: number; yielded: boolean }> {
    const take = () => this.db.query(this.db.sql.takeRateBudget(this.name, this.rate, this.capacity, want, background, YIELD_MS / 1000));
    this.metrics.statements.inc({ budget: this.label });
    let { rows } = await take();
    if (!rows[0]) {
      this.metrics.statements.inc({ budget: this.label }, 2);
      await this.db.query(this.db.sql.ensureRateBudget(this.name));
      ({ rows } = await take());
    }
    const row = rows[0] ?? { granted: 0, remaining: 0, yielded: false };
    this.metrics.granted.inc({ budget: this.label }, row.granted);
    return row;
  }

  /** Dispatch calls first, each queue oldest first. */
  private handOut(): void {
    const now = performance.now();
    this.dropExpired(now);
    while (this.reserve.length > 0) {
      const waiter = this.queues.dispatch.shift() ?? this.queues.background.shift();
      if (!waiter) return;
      this.reserve.shift();
      clearTimeout(waiter.timer);
      this.metrics.waited.observe({ budget: this.label, priority: waiter.priority }, (now - waiter.since) / 1000);
      waiter.resolve();
    }
  }

  private dropExpired(now: number): void {
    let n = 0;
    while (n < this.reserve.length && this.reserve[n]! <= now) n++;
    if (n === 0) return;
    this.reserve.splice(0, n);
    this.metrics.expired.inc({ budget: this.label }, n);
  }

  private noteDemand(now: number): void {
    this.demand = this.demand * Math.exp(-(now - this.demandAt) / 1000) + 1;
    this.demandAt = now;
  }

  /** What this replica will likely spend within a token's lifetime, beyond the calls waiting now. */
  private prefetch(): number {
    const perSecond = this.demand * Math.exp(-(performance.now() - this.demandAt) / 1000);
    return Math.floor((perSecond * TOKEN_TTL_MS) / 1000);
  }

  /** A pause of the refill loop; a dispatch call arriving during a background pause, or close(), ends it. */
  private sleep(ms: number, priority: Priority): Promise<void> {
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.sleeping = undefined;
        resolve();
      };
      const timer = setTimeout(done, ms);
      this.sleeping = { priority, wake: done };
    });
  }
}

/** A connected account's Budget is dropped once nothing was taken from it for this long. */
const ACCOUNT_IDLE_MS = 5_000;

export interface AccountBudgetsOptions {
  /** The platform's budget's name: an account's row is `<name>@<account>`. */
  name: string;
  /** Tokens per second, per connected account, for the whole fleet. */
  rate: number;
  /** Only for tests: how long an account's Budget is kept idle (default ACCOUNT_IDLE_MS). */
  idleMs?: number;
  log?: Logger;
  metrics?: BudgetMetrics;
}

/**
 * Every connected account's own bucket: a Budget per account, made on its first call and kept in order
 * of last use, so the least recently used are dropped once idle (Budget.idleFor) as others are used. A
 * replica holds only the accounts of its last few seconds, plus those with calls waiting (bounded by its
 * slots); an idle Budget holds no timer, and all of them share the gateway's pool.
 */
export class AccountBudgets {
  readonly rate: number;
  private readonly db: Queryable;
  private readonly opts: AccountBudgetsOptions;
  private readonly idleMs: number;
  private readonly metrics: BudgetMetrics;
  private readonly byAccount = new Map<string, Budget>();
  private closed = false;

  constructor(db: Queryable, opts: AccountBudgetsOptions) {
    this.db = db;
    this.opts = opts;
    this.rate = opts.rate;
    this.idleMs = opts.idleMs ?? ACCOUNT_IDLE_MS;
    this.metrics = opts.metrics ?? budgetMetrics();
  }

  /** The account's Budget, made now if it has none. */
  for(account: string): Budget {
    let budget = this.byAccount.get(account);
    if (budget) {
      this.byAccount.delete(account);
    } else {
      this.evictIdle();
      budget = new Budget(this.db, { name: `${this.opts.name}@${account}`, label: `${this.opts.name}_account`, rate: this.rate, log: this.opts.log, metrics: this.metrics });
      if (this.closed) budget.close();
    }
    this.byAccount.set(account, budget);
    return budget;
  }

  /** Accounts whose Budget this replica holds now. */
  get size(): number {
    return this.byAccount.size;
  }

  close(): void {
    this.closed = true;
    for (const budget of this.byAccount.values()) budget.close();
  }

  /** The least recently used first, until one is still in use. */
  private evictIdle(): void {
    for (const [account, budget] of this.byAccount) {
      if (!budget.idleFor(this.idleMs)) return;
      this.byAccount.delete(account);
    }
  }
}

export type BudgetMetrics = ReturnType<typeof budgetMetrics>;

/** The budget's metrics, on no registry until registered (a CLI command has none to serve). */
export function budgetMetrics() {
  const metrics = {
    limit: new Gauge({ name: 'outboxd_stripe_budget_limit', help: 'Requests/s the fleet may send to Stripe, by budget', labelNames: ['budget'], registers: [] }),
    granted: new Counter({
      name: 'outboxd_stripe_budget_granted_total',
      help: 'Tokens this replica took from the shared Stripe budget (the budget it used)',
      labelNames: ['budget'],
      registers: [],
    }),
    expired: new Counter({
      name: 'outboxd_stripe_budget_expired_total',
      help: 'Tokens this replica took but did not spend in time (dropped, or drained after a 429)',
      labelNames: ['budget'],
      registers: [],
    }),
    statements: new Counter({
      name: 'outboxd_stripe_budget_statements_total',
      help: 'Statements this replica ran against the shared bucket (round trips the budget costs)',
      labelNames: ['budget'],
      registers: [],
    }),
    backOffs: new Counter({
      name: 'outboxd_stripe_budget_back_offs_total',
      help: 'Times Stripe answered 429 rate_limit and this replica dropped its reserve and paused (the budget was wrong)',
      labelNames: ['budget'],
      registers: [],
    }),
    waited: new Histogram({
      name: 'outboxd_stripe_budget_wait_seconds',
      help: 'How long a Stripe call waited for its token, by budget and priority',
      labelNames: ['budget', 'priority'],
      buckets: [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10],
      registers: [],
    }),
    timeouts: new Counter({
      name: 'outboxd_stripe_budget_timeouts_total',
      help: 'Stripe calls that got no token in time and were not sent (retried later, not an attempt)',
      labelNames: ['budget', 'priority'],
      registers: [],
    }),
  };
  return {
    ...metrics,
    register(registry: Registry): void {
      for (const m of Object.values(metrics)) registry.registerMetric(m);
    },
  };
}
