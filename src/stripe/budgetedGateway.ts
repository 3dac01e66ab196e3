// Every call to Stripe through the fleet's shared budget (budget.ts), around any PaymentGateway: a call
// waits for its token (searches for a search token too: Stripe's Search limit counts against the
// account's as well), then is sent. Waiting is bounded by the call's deadline, so a call holds no lease
// past its TTL waiting (the dispatcher renews its lease meanwhile; the reconcile sweep does not, and its
// wait is bounded well inside the lease); a call that got no token in time is not sent and fails as
// RetryLater, which the executor records as not an attempt. A read that spans pages takes tokens for
// every page: an operation's search or refund list within the call's deadline, the drift report's lists
// (no lease held) each page as long again, at the budget's pace however long they are.
//
// A 429 from Stripe:
//   - `lock_timeout`: another request holds that one object. Not the account's budget: the call is sent
//     again (with a token, like any request) after a short jittered delay, a few times;
//   - anything else (`rate_limit`): the account is over its limit. The budget drops its local reserve and
//     takes nothing for a moment; the call then waits for a token and is sent again, within its deadline.
// Neither was an attempt: nothing executed at Stripe.
//
// Connect: Stripe limits each account, and does not say whether a platform's request on a connected
// account (Stripe-Account) counts against the platform, the connected account or both. We assume both:
// such a request takes a token from that account's own bucket (Budgets.accounts) and from the platform's,
// in that order (the account's is the scarcer); a platform request takes only the platform's. A 429 on a
// connected account backs off that account's budget alone, so one account's limit never pauses the others.
import { Counter, type Registry } from 'prom-client';
import {
  RetryLater,
  type BeforeNextPage,
  type CancelParams,
  type CaptureParams,
  type Charge,
  type CreateChargeParams,
  type PaymentGateway,
  type Refund,
  type CreateRefundParams,
  type SendGuard,
  type StripeAccount,
} from './gateway.ts';
import { BudgetTimeout, type AccountBudgets, type Budget, type BudgetMetrics, type Priority } from './budget.ts';

/** Sends of one call, 429s included. */
const MAX_SENDS = 3;
/** The longest a call put off on a busy account waits before it is tried again. */
const MAX_PUT_OFF_MS = 300_000;
/** A call on a busy account whose token would come within this is not put off, beyond accountWaiters (up
 * to twice as many, never more: an account fast enough for all the slots took them all, and the platform's
 * charges waited behind its whole backlog): the job's round trip (claimed, rescheduled, fetched again by a
 * loop polling each half second) takes as long, and calls come back in bunches of what the loops fetched,
 * which refused again went to the end of the line (a backlog drained at 0.42 of the account's rate, each
 * call put off 4 times). */
const SHORT_WAIT_SECONDS = 0.5;

export interface Budgets {
  /** Every request: the account's limit. */
  requests?: Budget | undefined;
  /** Search requests, which take from `requests` as well. */
  search?: Budget | undefined;
  /** Each connected account's own limit: its requests take from it as well as from `requests`. */
  accounts?: AccountBudgets | undefined;
}

export interface BudgetedGatewayOptions {
  budgets: Budgets;
  /** How long a call may wait for its tokens in all. */
  maxWaitMs: number;
  priority?: Priority;
  metrics?: GatewayMetrics;
  /** Calls on one connected account that wait for its bucket at once in this process (twice as many while
   * its bucket serves them within SHORT_WAIT_SECONDS); more are not sent (RetryLater at once, put off by
   * their caller). Jobs are fetched by kind, not account: without it, a
   * busy account's backlog fills every slot waiting for its own tokens, while the platform's and other
   * accounts' calls, whose tokens are there, wait behind them. Default: no bound. */
  accountWaiters?: number;
}

type Kind = 'request' | 'search';

export class BudgetedGateway implements PaymentGateway {
  private readonly inner: PaymentGateway;
  private readonly opts: BudgetedGatewayOptions;
  readonly metrics: GatewayMetrics;
  /** Per connected account, shared with the gateway at another priority: its calls waiting for its bucket,
   * and when the next call put off is due back. */
  private readonly accountState: { waiting: Map<string, number>; due: Map<string, number> };

  constructor(inner: PaymentGateway, opts: BudgetedGatewayOptions, accountState = { waiting: new Map<string, number>(), due: new Map<string, number>() }) {
    this.inner = inner;
    this.opts = opts;
    this.metrics = opts.metrics ?? gatewayMetrics();
    this.accountState = accountState;
  }

  /** The same gateway and budgets, its calls at another priority. */
  at(priority: Priority): BudgetedGateway {
    return new BudgetedGateway(this.inner, { ...this.opts, priority, metrics: this.metrics }, this.accountState);
  }

  // One line per method: which budgets its request takes from, on which account.
  createCharge(req: CreateChargeParams): Promise<Charge> {
    return this.budgeted('request', req.account ?? null, () => this.inner.createCharge(req), 'call', req.guard);
  }

  retrieveCharge(externalId: string, account: StripeAccount = null): Promise<Charge> {
    return this.budgeted('request', account, () => this.inner.retrieveCharge(externalId, account));
  }

  findCharges(operationId: string, account: StripeAccount = null): Promise<Charge[]> {
    return this.budgeted('search', account, (nextPage) => this.inner.findCharges(operationId, account, nextPage), 'call');
  }

  listCharges(since: Date): Promise<Charge[]> {
    return this.budgeted('request', null, (nextPage) => this.inner.listCharges(since, nextPage), 'page');
  }

  capturePaymentIntent(req: CaptureParams): Promise<Charge> {
    return this.budgeted('request', req.account, () => this.inner.capturePaymentIntent(req), 'call', req.guard);
  }

  cancelPaymentIntent(req: CancelParams): Promise<Charge> {
    return this.budgeted('request', req.account, () => this.inner.cancelPaymentIntent(req), 'call', req.guard);
  }

  createRefund(req: CreateRefundParams): Promise<Refund> {
    return this.budgeted('request', req.account ?? null, () => this.inner.createRefund(req), 'call', req.guard);
  }

  retrieveRefund(externalId: string, account: StripeAccount = null): Promise<Refund> {
    return this.budgeted('request', account, () => this.inner.retrieveRefund(externalId, account));
  }

  // A list, not a Search: the account budgets only.
  findRefunds(paymentIntent: string, account: StripeAccount = null): Promise<Refund[]> {
    return this.budgeted('request', account, (nextPage) => this.inner.findRefunds(paymentIntent, account, nextPage), 'call');
  }

  listRefunds(since: Date): Promise<Refund[]> {
    return this.budgeted('request', null, (nextPage) => this.inner.listRefunds(since, nextPage), 'page');
  }

  /** Metrics of this gateway and its budgets, onto a replica's registry. */
  registerMetrics(registry: Registry): void {
    this.metrics.register(registry);
  }

  close(): void {
    this.opts.budgets.requests?.close();
    this.opts.budgets.search?.close();
    this.opts.budgets.accounts?.close();
  }

  /**
   * `send` gets what paces its further pages. `pages`: how long they may wait for their tokens: within
   * the call's deadline (`call`: the reads of one operation, made under a lease the sweep does not
   * renew), or each as long as a call may (`page`: the drift report's lists, under no lease, at the
   * budget's pace however many pages they run to). A write's `guard`: its wait ends when its call is given
   * up, and each send, resends after a 429 included, goes out only past its check, made last: a lease
   * that ran out while the call waited (its renewals failing) sends nothing, once another claim may hold it.
   */
  private async budgeted<T>(
    kind: Kind,
    account: StripeAccount,
    send: (beforeNextPage: BeforeNextPage) => Promise<T>,
    pages: 'call' | 'page' = 'call',
    guard?: SendGuard,
  ): Promise<T> {
    const deadline = Date.now() + this.opts.maxWaitMs;
    let starved: unknown;
    const beforeNextPage = () =>
      this.tokens(kind, account, pages === 'call' ? deadline : Date.now() + this.opts.maxWaitMs).catch((err: unknown) => {
        starved = err;
        throw err;
      });
    for (let sends = 1; ; sends++) {
      await this.tokens(kind, account, deadline, guard?.signal);
      guard?.beforeSend();
      try {
        return await send(beforeNextPage);
      } catch (err) {
        // A 429 answered a send; a page that got no token in time was never sent, and goes back as it is.
        if (!(err instanceof RetryLater) || err === starved) throw err;
        const code = err.code ?? 'unknown';
        this.metrics.rateLimited.inc({ code });
        const lockTimeout = code === 'lock_timeout';
        const { requests, search, accounts } = this.opts.budgets;
        // A connected account's 429 is its own limit's: its bucket backs off, and without one (its limit is
        // the platform's, the default) nothing does; pausing the platform's would slow every other account.
        const budget = account !== null ? accounts?.for(account) : kind === 'search' ? (search ?? requests) : requests;
        if (!lockTimeout) budget?.backOff();
        // Without a budget to wait for, a rate-limited call goes back to its caller (the dispatcher
        // reschedules it in seconds); a lock timeout is worth a second try either way.
        const delay = lockTimeout ? (50 + Math.random() * 200) * sends : 0;
        // The account's own limit (its bucket's 429), not one busy object's: its other calls may wait too.
        if (sends >= MAX_SENDS || (!lockTimeout && !budget) || Date.now() + delay >= deadline) throw account !== null && budget && !lockTimeout ? ofAccount(err, account) : err;
        await new Promise((r) => setTimeout(r, delay));
      }
    }
  }

  private async tokens(kind: Kind, account: StripeAccount, deadline: number, signal?: AbortSignal): Promise<void> {
    const { requests, search, accounts } = this.opts.budgets;
    const priority = this.opts.priority ?? 'dispatch';
    const take = (budget: Budget | undefined) => budget?.take(priority, deadline, account, signal).catch((err: unknown) => Promise.reject(notSent(err)));
    // The scarcer token first: a requests token held while waiting for a search one would expire unspent.
    if (kind === 'search') await take(search);
    if (account !== null && accounts) await this.accountToken(accounts, account, priority, deadline, signal);
    await take(requests);
  }

  /** A token of the connected account's own bucket, its refusal naming the account: only its calls wait. */
  private async accountToken(accounts: AccountBudgets, account: string, priority: Priority, deadline: number, signal?: AbortSignal): Promise<void> {
    const { waiting, due } = this.accountState;
    const inLine = waiting.get(account) ?? 0;
    // None waiting: the account is not busy now, whatever was put off before (and never came back).
    if (inLine === 0) due.delete(account);
    const waiters = this.opts.accountWaiters ?? Infinity;
    if (inLine >= waiters && (inLine >= 2 * waiters || inLine / accounts.rate > SHORT_WAIT_SECONDS)) {
      const retryAfterSeconds = this.putOff(account, accounts.rate);
      throw new RetryLater(`not sent: ${inLine} calls on ${account} already wait for its budget here`, undefined, undefined, { code: 'budget', account, retryAfterSeconds });
    }
    waiting.set(account, inLine + 1);
    try {
      await accounts.for(account).take(priority, deadline, null, signal);
    } catch (err) {
      throw notSent(err, account);
    } finally {
      const left = waiting.get(account)! - 1;
      if (left) waiting.set(account, left);
      else waiting.delete(account);
    }
  }

  /**
   * When a call put off on a busy account is due back, in seconds: the account's put-off calls are paced
   * at its rate, each after the one before, as in a queue of its own (at most 5 minutes). Put off a few
   * seconds each, its whole backlog came back every few seconds, each time claimed, refused and
   * rescheduled: writes growing with the backlog, not with what the account can take. In fractions of a
   * second, jittered by at most a quarter of its turn: rounded to whole seconds, or jittered by a quarter
   * of the whole delay, calls came back out of turn and together, and most were put off again.
   */
  private putOff(account: string, rate: number): number {
    const { due } = this.accountState;
    const now = Date.now();
    if (due.size > 10_000) for (const [a, at] of due) if (at < now) due.delete(a);
    const at = Math.min(Math.max(now, due.get(account) ?? 0) + 1000 / rate, now + MAX_PUT_OFF_MS);
    due.set(account, at);
    return (at - now) / 1000 + Math.random() / rate / 4;
  }
}

/** A connected account's 429, said to be its own limit's (as its bucket backs off alone): its caller may go
 * on with the platform's and other accounts' calls. */
const ofAccount = (err: RetryLater, account: string): RetryLater =>
  err.account ? err : new RetryLater(err.message, err.httpStatus, err.externalId, { cause: err, code: err.code, account, requestId: err.requestId });

/** A budget that gave no token in time: the call was not sent (RetryLater); any other error as it is. */
function notSent(err: unknown, account?: string): unknown {
  return err instanceof BudgetTimeout ? new RetryLater(`not sent: ${err.message}`, undefined, undefined, { cause: err, code: 'budget', account }) : err;
}

/**
 * The gateway as reconciliation uses it: its calls yield to the dispatcher's (budget.ts, priority).
 * Any other gateway is returned as it is.
 */
export function inBackground(gateway: PaymentGateway): PaymentGateway {
  return gateway instanceof BudgetedGateway ? gateway.at('background') : gateway;
}

export type GatewayMetrics = ReturnType<typeof gatewayMetrics>;

export function gatewayMetrics(budget?: BudgetMetrics) {
  const rateLimited = new Counter({
    name: 'outboxd_stripe_rate_limited_total',
    help: "Stripe's 429 answers by code: rate_limit (the account's limit), lock_timeout (one object busy), …",
    labelNames: ['code'],
    registers: [],
  });
  return {
    rateLimited,
    register(registry: Registry): void {
      registry.registerMetric(rateLimited);
      budget?.register(registry);
    },
  };
}
