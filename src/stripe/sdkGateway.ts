// PaymentGateway over the real Stripe SDK. It reports what Stripe said, classified by HTTP status and
// raw error type (docs/architecture.md §2.4 and §5), never by error class alone: a 409 is a StripeAPIError but
// means "the same key is still executing"; a cut-off body is a StripeConnectionError.
import Stripe from 'stripe';
import {
  AccessRevoked,
  AmbiguousOutcome,
  Declined,
  GatewayError,
  IdempotencyKeyMisuse,
  NotExecuted,
  Rejected,
  RetryLater,
  type BeforeNextPage,
  type CancelParams,
  type CaptureParams,
  type Charge,
  type CreateChargeParams,
  type PaymentGateway,
  type Refund,
  type CreateRefundParams,
  type StripeAccount,
} from './gateway.ts';
import { boundedHttpClient } from './boundedHttpClient.ts';
import { tracedHttpClient } from './tracedHttpClient.ts';

export interface StripeGatewayOptions {
  secretKey: string;
  /** e.g. http://127.0.0.1:12111; unset: api.stripe.com */
  apiBase?: string | undefined;
  /** Per attempt (the SDK's timeout is not a total). */
  timeoutMs: number;
  /** The SDK's own retries; they reuse our key. A reset connection is retried once even at 0. */
  maxNetworkRetries?: number;
}

export function stripeClient(opts: StripeGatewayOptions): Stripe {
  const base = opts.apiBase ? new URL(opts.apiBase) : undefined;
  return new Stripe(opts.secretKey, {
    maxNetworkRetries: opts.maxNetworkRetries ?? 0,
    timeout: opts.timeoutMs,
    telemetry: false,
    httpClient: tracedHttpClient(boundedHttpClient()),
    ...(base
      ? {
          host: base.hostname,
          port: Number(base.port || (base.protocol === 'https:' ? 443 : 80)),
          protocol: base.protocol === 'https:' ? 'https' : 'http',
        }
      : {}),
  });
}

const SEARCH_PAGE = 100;
/** Stripe's largest list page. */
const LIST_PAGE = 100;

export class StripeGateway implements PaymentGateway {
  private readonly stripe: Stripe;
  /** Sends of each create in flight, by idempotency key (the SDK emits 'request' for every send). */
  private readonly sends = new Map<string, number>();

  constructor(opts: StripeGatewayOptions) {
    this.stripe = stripeClient(opts);
    this.stripe.on('request', (event: { idempotency_key?: string }) => {
      const key = event.idempotency_key;
      if (key !== undefined && this.sends.has(key)) this.sends.set(key, this.sends.get(key)! + 1);
    });
  }

  async createCharge(req: CreateChargeParams): Promise<Charge> {
    const manual = req.captureMethod === 'manual';
    const pi = await this.create(req.idempotencyKey, () =>
      this.stripe.paymentIntents.create(
        {
          amount: req.amount,
          currency: req.currency,
          customer: req.customer,
          payment_method: req.paymentMethod,
          confirm: true,
          off_session: true,
          // The same parameters on every send of the key: what a manual charge adds, only for it.
          ...(manual ? { capture_method: 'manual' as const, expand: EXPAND } : {}),
          ...(req.transferDestination ? { transfer_data: { destination: req.transferDestination } } : {}),
          ...(req.applicationFeeAmount != null ? { application_fee_amount: req.applicationFeeAmount } : {}),
          // operation_id last: reconciliation finds the charge by it, whatever the application sent.
          metadata: { ...req.metadata, operation_id: req.operationId },
        },
        onAccount(req.account ?? null, req.idempotencyKey),
      ),
    );
    return toCharge(pi, req.account ?? null);
  }

  async capturePaymentIntent(req: CaptureParams): Promise<Charge> {
    const pi = await this.create(req.idempotencyKey, () =>
      this.stripe.paymentIntents.capture(req.paymentIntent, { amount_to_capture: req.amount, expand: EXPAND }, onAccount(req.account, req.idempotencyKey)),
    );
    return toCharge(pi, req.account);
  }

  async cancelPaymentIntent(req: CancelParams): Promise<Charge> {
    const pi = await this.create(req.idempotencyKey, () =>
      this.stripe.paymentIntents.cancel(
        req.paymentIntent,
        { ...(req.reason ? { cancellation_reason: req.reason } : {}), expand: EXPAND },
        onAccount(req.account, req.idempotencyKey),
      ),
    );
    return toCharge(pi, req.account);
  }

  async createRefund(req: CreateRefundParams): Promise<Refund> {
    const refund = await this.create(req.idempotencyKey, () =>
      this.stripe.refunds.create(
        {
          payment_intent: req.paymentIntent,
          amount: req.amount,
          ...(req.reason ? { reason: req.reason } : {}),
          ...(req.reverseTransfer ? { reverse_transfer: true } : {}),
          ...(req.refundApplicationFee ? { refund_application_fee: true } : {}),
          metadata: { operation_id: req.operationId },
        },
        onAccount(req.account ?? null, req.idempotencyKey),
      ),
    );
    return toRefund(refund, req.account ?? null);
  }

  /**
   * A create under `key`. The SDK resends once after a reset even with retries off, and that earlier
   * send may have executed: an answer that proves nothing ran (a 429, a 401/403, a refused connection)
   * proves it only for a request that was sent once.
   */
  private async create<T>(key: string, send: () => Promise<T>): Promise<T> {
    this.sends.set(key, 0);
    try {
      return await send();
    } catch (err) {
      const classified = classify(err);
      const sends = this.sends.get(key) ?? 0;
      if ((classified instanceof RetryLater || classified instanceof NotExecuted || classified instanceof AccessRevoked) && sends !== 1) {
        throw new AmbiguousOutcome(`sent ${sends} times; an earlier send may have executed: ${classified.message}`, classified.httpStatus, undefined, { cause: err, requestId: classified.requestId });
      }
      throw classified;
    } finally {
      this.sends.delete(key);
    }
  }

  async retrieveCharge(externalId: string, account: StripeAccount = null): Promise<Charge> {
    try {
      return toCharge(await this.stripe.paymentIntents.retrieve(externalId, { expand: EXPAND }, onAccount(account)), account);
    } catch (err) {
      throw classify(err);
    }
  }

  async findCharges(operationId: string, account: StripeAccount = null, beforeNextPage?: BeforeNextPage): Promise<Charge[]> {
    const found: Charge[] = [];
    let page: string | undefined;
    try {
      for (;;) {
        const result = await this.stripe.paymentIntents.search({
          query: `metadata['operation_id']:'${operationId.replaceAll("'", "\\'")}'`,
          limit: SEARCH_PAGE,
          ...(page ? { page } : {}),
        }, onAccount(account));
        found.push(...result.data.map((pi) => toCharge(pi, account)));
        if (!result.has_more) return found;
        // More matches, and no way to them: an answer cut short is no evidence of what is not there.
        if (!result.next_page) throw new AmbiguousOutcome('a search page said has_more without next_page');
        page = result.next_page;
        await beforeNextPage?.();
      }
    } catch (err) {
      throw classify(err);
    }
  }

  async listCharges(since: Date, beforeNextPage?: BeforeNextPage): Promise<Charge[]> {
    const created = { gte: Math.floor(since.getTime() / 1000) };
    return this.pages((after) => this.stripe.paymentIntents.list({ created, limit: LIST_PAGE, ...after }), (pi) => toCharge(pi, null), beforeNextPage);
  }

  async retrieveRefund(externalId: string, account: StripeAccount = null): Promise<Refund> {
    try {
      return toRefund(await this.stripe.refunds.retrieve(externalId, {}, onAccount(account)), account);
    } catch (err) {
      throw classify(err);
    }
  }

  async findRefunds(paymentIntent: string, account: StripeAccount = null, beforeNextPage?: BeforeNextPage): Promise<Refund[]> {
    return this.refunds({ payment_intent: paymentIntent }, account, beforeNextPage);
  }

  async listRefunds(since: Date, beforeNextPage?: BeforeNextPage): Promise<Refund[]> {
    return this.refunds({ created: { gte: Math.floor(since.getTime() / 1000) } }, null, beforeNextPage);
  }

  private async refunds(params: Stripe.RefundListParams, account: StripeAccount, beforeNextPage?: BeforeNextPage): Promise<Refund[]> {
    return this.pages((after) => this.stripe.refunds.list({ ...params, limit: LIST_PAGE, ...after }, onAccount(account)), (r) => toRefund(r, account), beforeNextPage);
  }

  /** Every item of a Stripe list, page by page (`starting_after` the last item of the page before), so
   * that each further page is a request the caller can pace (the SDK's auto-paging sends them unasked);
   * each page's items kept as `map` makes them, not whole (the drift report lists days of them). */
  private async pages<T extends { id: string }, R>(list: (after: { starting_after?: string }) => Promise<Stripe.ApiList<T>>, map: (item: T) => R, beforeNextPage?: BeforeNextPage): Promise<R[]> {
    const found: R[] = [];
    try {
      for (let page = await list({}); ; ) {
        found.push(...page.data.map(map));
        if (!page.has_more) return found;
        // More items, and no last one to continue after: a list cut short is no evidence of what is not there.
        const last = page.data.at(-1);
        if (!last) throw new AmbiguousOutcome('a list page said has_more with no items');
        await beforeNextPage?.();
        page = await list({ starting_after: last.id });
      }
    } catch (err) {
      throw classify(err);
    }
  }
}

/** The PaymentIntent's charge, expanded: where an authorization says when it expires (capture_before). */
const EXPAND = ['latest_charge'];

/** The request options of a request on `account` (Connect's Stripe-Account header), under `idempotencyKey`. */
const onAccount = (account: StripeAccount, idempotencyKey?: string): Stripe.RequestOptions => ({
  ...(idempotencyKey !== undefined ? { idempotencyKey } : {}),
  ...(account !== null ? { stripeAccount: account } : {}),
});

/** `lastResponse` is set on a PaymentIntent the SDK returned itself, not on one inside a list. */
function toCharge(pi: Stripe.PaymentIntent & { lastResponse?: { requestId?: string; headers?: Record<string, string> } }, account: StripeAccount): Charge {
  const latest = typeof pi.latest_charge === 'object' ? pi.latest_charge : null;
  const captureBefore = latest?.payment_method_details?.card?.capture_before;
  return {
    id: pi.id,
    status: pi.status,
    amount: pi.amount,
    currency: pi.currency,
    operationId: pi.metadata?.operation_id,
    customer: typeof pi.customer === 'string' ? pi.customer : (pi.customer?.id ?? null),
    requestId: pi.lastResponse?.requestId,
    captureMethod: pi.capture_method === 'manual' ? 'manual' : 'automatic',
    amountCapturable: pi.amount_capturable ?? 0,
    amountReceived: pi.amount_received ?? 0,
    captureBefore: typeof captureBefore === 'number' ? new Date(captureBefore * 1000) : null,
    cancellationReason: pi.cancellation_reason ?? null,
    account,
    applicationFeeAmount: pi.application_fee_amount ?? null,
    replayed: pi.lastResponse?.headers?.['idempotent-replayed'] === 'true',
  };
}

function toRefund(r: Stripe.Refund & { lastResponse?: { requestId?: string } }, account: StripeAccount): Refund {
  const paymentIntent = typeof r.payment_intent === 'string' ? r.payment_intent : (r.payment_intent?.id ?? null);
  return { id: r.id, status: r.status ?? 'pending', amount: r.amount, currency: r.currency, paymentIntent, operationId: r.metadata?.operation_id, requestId: r.lastResponse?.requestId, account };
}

/** docs/architecture.md §2.4, by HTTP status (what stripe@23 itself decides the class by) and raw type. */
function classify(err: unknown): GatewayError {
  // Already classified: a page that got no budget token (RetryLater: not sent), a page cut short.
  if (err instanceof GatewayError) return err;
  if (!(err instanceof Stripe.errors.StripeError)) return new AmbiguousOutcome(String(err), undefined, undefined, { cause: err });
  const status = err.statusCode;
  const pi = (err.payment_intent as { id?: string } | undefined)?.id;
  const message = err.message;
  const opts = { cause: err, requestId: err.requestId };
  // No status: connection error, timeout, a body cut off after the headers, unreadable JSON. Only a
  // connection that never opened proves that this send reached nothing.
  if (status === undefined) {
    if (neverSent(err)) return new NotExecuted(`${err.type}: ${message}`, undefined, undefined, opts);
    return new AmbiguousOutcome(`${err.type}: ${message}`, undefined, pi, opts);
  }
  if (status === 402) return new Declined(`${err.code ?? 'card_error'}: ${message}`, status, pi, opts);
  if (status === 429 || (status === 400 && err.code === 'rate_limit')) return new RetryLater(message, status, pi, { ...opts, code: err.code });
  if (status === 400 && err.rawType === 'idempotency_error') return new IdempotencyKeyMisuse(message, status, pi, opts);
  // 424: a dependency outside Stripe failed (a payment method's provider), maybe after the request acted.
  if (status === 409 || status === 424 || status >= 500) return new AmbiguousOutcome(`${err.code ?? err.type}: ${message}`, status, pi, opts);
  if (status === 403 && err.code === 'account_invalid') return new AccessRevoked(`${err.code}: ${message}`, status, pi, opts);
  // Bad key or missing permission: nothing executed; an operator must fix the configuration.
  if (status === 401 || status === 403) return new NotExecuted(`${err.type}: ${message}`, status, pi, opts);
  return new Rejected(`${err.code ?? err.type}: ${message}`, status, pi, { ...opts, code: err.code });
}

/** Errors of a connection that was never established: the request cannot have reached Stripe. */
const NEVER_CONNECTED = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN']);

/** A StripeConnectionError for a connection that never opened (the SDK keeps the socket error as
 * `detail`). Whether an earlier send of the same request may have executed is the caller's to judge. */
function neverSent(err: InstanceType<typeof Stripe.errors.StripeError>): boolean {
  if (!(err instanceof Stripe.errors.StripeConnectionError)) return false;
  const code = (err.detail as { code?: string } | undefined)?.code;
  return code !== undefined && NEVER_CONNECTED.has(code);
}
