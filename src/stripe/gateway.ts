// The contract between the executor's built-in kinds (charge, refund, capture, cancel) and a payment provider. The real implementation drives the
// Stripe SDK (src/stripe/sdkGateway.ts); tests also use an in-process fake with the same idempotency model.
// A gateway reports what Stripe said; deciding what that means for the operation is the executor's job.
import type { Operation } from '../types/operation.ts';

/** A connected account (Connect's `Stripe-Account: acct_…`) a request acts on; null: the platform's own.
 * Its objects and its idempotency keys are that account's alone. */
export type StripeAccount = string | null;

/** The account an operation of a built-in kind acts on: its payload's (a charge's own; its refunds',
 * captures' and cancels' copied from it). */
export const accountOf = (op: Pick<Operation, 'payload'>): StripeAccount =>
  ((op.payload ?? {}) as { stripe_account?: string }).stripe_account ?? null;

/**
 * The call a write is sent for, as the engine hands it to its kind (src/types/kind.ts: CallContext):
 * `signal` aborts once the call is given up (its claim lost or past its lease's deadline, the worker
 * draining), and `beforeSend` throws then, reading that deadline from the clock, which a timer may not have
 * yet in a process that was paused. A gateway that waits before it sends (src/stripe/budgetedGateway.ts)
 * gives its wait up on the signal and calls beforeSend last, before each request it sends.
 */
export interface SendGuard {
  signal: AbortSignal;
  beforeSend(): void;
}

export interface CreateChargeParams {
  operationId: string;
  amount: number;
  currency: string;
  customer: string;
  paymentMethod: string;
  /** The application's metadata; the gateway adds operation_id. */
  metadata: Record<string, string>;
  /** Always `payment-op:<operation id>`; never generated per attempt. */
  idempotencyKey: string;
  /** manual: an authorization, captured later (requires_capture is its success). Default automatic. */
  captureMethod?: CaptureMethod;
  account?: StripeAccount;
  /** A destination charge's: the connected account the funds go to, and the platform's fee. */
  transferDestination?: string | null;
  applicationFeeAmount?: number | null;
  /** What sends it: nothing is sent once its call is given up. */
  guard?: SendGuard;
}

export type CaptureMethod = 'automatic' | 'manual';

/** The fields of a PaymentIntent the executor reads. */
export interface Charge {
  id: string;
  status: string;
  amount: number;
  currency: string;
  /** metadata.operation_id, when the charge carries it */
  operationId: string | undefined;
  /** The customer it charges (null: none); absent when the gateway does not say. */
  customer?: string | null;
  /** Stripe's id of the response it was read from (its Request-Id), for the operation's timeline. */
  requestId?: string | undefined;
  captureMethod: CaptureMethod;
  /** What an authorization still holds (requires_capture), and what was captured (succeeded). */
  amountCapturable: number;
  amountReceived: number;
  /** When an authorization expires (its charge's capture_before), when Stripe said. */
  captureBefore: Date | null;
  /** Why it was canceled: for an authorization that expired, `expired` (EXPIRED_HOLD_REASONS). */
  cancellationReason: string | null;
  /** The account it was read from (null: the platform's). */
  account: StripeAccount;
  /** The platform's fee on it (Connect's application_fee_amount), null for none; absent when the gateway
   * does not say. Only the platform can set one. */
  applicationFeeAmount?: number | null;
  /** A create's answer Stripe replayed for its key (Idempotent-Replayed): the PaymentIntent as it was when
   * the key was first used, not as it is now. */
  replayed?: boolean;
}

/** PaymentIntent statuses that are final and charged nothing (an off-session confirm that was declined
 * leaves requires_payment_method). Anything else may still charge, or has. */
export const FAILED_CHARGE_STATUSES: ReadonlySet<string> = new Set(['canceled', 'requires_payment_method']);
/** The cancellation_reason of an authorization Stripe released at its expiry: `expired` since API version
 * 2025-03-31.basil (the SDK pins a later one), `automatic` before. Read as `automatic` alone, every expiry
 * was recorded, and told to the application, as a cancel made in the dashboard. */
export const EXPIRED_HOLD_REASONS: ReadonlySet<string | null> = new Set(['expired', 'automatic']);

/** Stripe's reasons for a refund. */
export const REFUND_REASONS = ['requested_by_customer', 'duplicate', 'fraudulent'] as const;
export type RefundReason = (typeof REFUND_REASONS)[number];

export interface CreateRefundParams {
  operationId: string;
  /** The charge's PaymentIntent (pi_…). */
  paymentIntent: string;
  amount: number;
  reason: RefundReason | null;
  /** Always `refund-op:<operation id>`; never generated per attempt. */
  idempotencyKey: string;
  /** The charge's account. */
  account?: StripeAccount;
  /** A destination charge's refund: take the transfer back from the connected account, and the fee. */
  reverseTransfer?: boolean;
  refundApplicationFee?: boolean;
  /** What sends it: nothing is sent once its call is given up. */
  guard?: SendGuard;
}

/** A capture of an authorization: `amount_to_capture` of what it holds (the rest is released). */
export interface CaptureParams {
  paymentIntent: string;
  amount: number;
  /** Always `capture-op:<capture operation id>`. */
  idempotencyKey: string;
  account: StripeAccount;
  /** What sends it: nothing is sent once its call is given up. */
  guard?: SendGuard;
}

/** Stripe's reasons for cancelling a PaymentIntent. */
export const CANCELLATION_REASONS = ['duplicate', 'fraudulent', 'requested_by_customer', 'abandoned'] as const;
export type CancellationReason = (typeof CANCELLATION_REASONS)[number];

export interface CancelParams {
  paymentIntent: string;
  reason: CancellationReason | null;
  /** Always `cancel-op:<cancel operation id>`. */
  idempotencyKey: string;
  account: StripeAccount;
  /** What sends it: nothing is sent once its call is given up. */
  guard?: SendGuard;
}

/** The fields of a Refund the executor reads. */
export interface Refund {
  id: string;
  /** pending, requires_action, succeeded, failed or canceled: only succeeded is done. */
  status: string;
  amount: number;
  currency: string;
  paymentIntent: string | null;
  /** metadata.operation_id, when the refund carries it */
  operationId: string | undefined;
  /** Stripe's Request-Id of the response this came in (a list's items share it). */
  requestId?: string | undefined;
  /** The account it was read from (null: the platform's). */
  account: StripeAccount;
}

/** Refund statuses that are final and returned nothing. */
export const FAILED_REFUND_STATUSES: ReadonlySet<string> = new Set(['failed', 'canceled']);

/** Awaited before each page after the first of a read that spans pages: every page is a request to
 * Stripe, and the fleet's budget (src/stripe/budgetedGateway.ts) takes a token for it there. */
export type BeforeNextPage = () => Promise<void>;

/** Every read names the account whose objects it reads (null or absent: the platform's). */
export interface PaymentGateway {
  createCharge(req: CreateChargeParams): Promise<Charge>;
  retrieveCharge(externalId: string, account?: StripeAccount): Promise<Charge>;
  /** Every charge whose metadata carries this operation id, all pages. Not read-after-write. */
  findCharges(operationId: string, account?: StripeAccount, beforeNextPage?: BeforeNextPage): Promise<Charge[]>;
  /** Every charge created at or after `since`, all pages (the drift report reads them). */
  listCharges(since: Date, beforeNextPage?: BeforeNextPage): Promise<Charge[]>;
  /** Captures an authorization; answers the PaymentIntent as it is after. */
  capturePaymentIntent(req: CaptureParams): Promise<Charge>;
  /** Cancels a PaymentIntent (releases an authorization); answers it as it is after. */
  cancelPaymentIntent(req: CancelParams): Promise<Charge>;
  createRefund(req: CreateRefundParams): Promise<Refund>;
  retrieveRefund(externalId: string, account?: StripeAccount): Promise<Refund>;
  /** Every refund of a PaymentIntent, all pages: a list, so read-after-write (unlike Search). */
  findRefunds(paymentIntent: string, account?: StripeAccount, beforeNextPage?: BeforeNextPage): Promise<Refund[]>;
  /** Every refund created at or after `since`, all pages (the drift report reads them). */
  listRefunds(since: Date, beforeNextPage?: BeforeNextPage): Promise<Refund[]>;
}

export abstract class GatewayError extends Error {
  abstract readonly outcome: 'declined' | 'rate_limited' | 'not_executed' | 'access_revoked' | 'ambiguous' | 'idempotency_bug' | 'rejected';
  readonly httpStatus: number | undefined;
  /** The PaymentIntent (or Refund) the error names, when the provider returned one. */
  readonly externalId: string | undefined;
  /** The provider's id of the response, when one arrived (Stripe's Request-Id). */
  readonly requestId: string | undefined;
  constructor(message: string, httpStatus?: number, externalId?: string, options?: ErrorOptions & { requestId?: string | undefined }) {
    super(message, options);
    this.httpStatus = httpStatus;
    this.externalId = externalId;
    this.requestId = options?.requestId;
  }
}

/** 402: the card was declined. Definitive: the operation failed and is never retried. */
export class Declined extends GatewayError {
  override name = 'Declined';
  readonly outcome = 'declined';
}

/** 429: Stripe's rate limiter answers before its idempotency layer, so nothing executed and no key was
 * stored. Try again later with the same key. `code`: why, e.g. `rate_limit` (the account's budget) or
 * `lock_timeout` (another request holds the object). `account`: set when only that connected account's
 * own limit turned it away (its bucket of the fleet's budget, or Stripe's 429 on it), not the platform's.
 * `retryAfterSeconds`: when to try again, where the refusal knows (its place among the account's calls
 * put off; in fractions of a second). */
export class RetryLater extends GatewayError {
  override name = 'RetryLater';
  readonly outcome = 'rate_limited';
  readonly code: string | undefined;
  readonly account: string | undefined;
  readonly retryAfterSeconds: number | undefined;
  constructor(
    message: string,
    httpStatus?: number,
    externalId?: string,
    options?: ErrorOptions & { code?: string | undefined; account?: string | undefined; requestId?: string | undefined; retryAfterSeconds?: number | undefined },
  ) {
    super(message, httpStatus, externalId, options);
    this.code = options?.code;
    this.account = options?.account;
    this.retryAfterSeconds = options?.retryAfterSeconds;
  }
}

/** Provably never executed: 401/403 (bad key or missing permission, refused before anything runs) or a
 * connection refused on the first and only attempt (no byte reached Stripe). Retry later, same key. */
export class NotExecuted extends GatewayError {
  override name = 'NotExecuted';
  readonly outcome = 'not_executed';
}

/** 403 account_invalid: the connected account (Stripe-Account) no longer grants this platform access (it
 * disconnected the platform, or was deleted). Refused before anything ran, like any 403, but no change of
 * ours ends it: retried, it would be refused for ever. Not a Rejected: a read it refuses found nothing
 * out, and must not be taken for an absence. */
export class AccessRevoked extends GatewayError {
  override name = 'AccessRevoked';
  readonly outcome = 'access_revoked';
}

/** Nobody knows whether the charge happened: timeouts, resets, cut-off bodies, 5xx, 409. */
export class AmbiguousOutcome extends GatewayError {
  override name = 'AmbiguousOutcome';
  readonly outcome = 'ambiguous';
}

/**
 * `call`, its errors without the PaymentIntent they may name, for a kind whose object is another: a
 * refund's or a change's error names the charge's PaymentIntent, known already. Recorded as the
 * operation's external id (replacing a refund's re_ once known), it would make the next attempt retrieve
 * a refund by a PaymentIntent's id (a 404: held for a person), or a change that has no retrieve.
 */
export function namingNoIntent<T>(call: Promise<T>): Promise<T> {
  return call.catch((err: unknown) => {
    if (err instanceof AmbiguousOutcome && err.externalId !== undefined) {
      throw new AmbiguousOutcome(err.message, err.httpStatus, undefined, { cause: err, requestId: err.requestId });
    }
    if (err instanceof Declined && err.externalId !== undefined) {
      throw new Declined(err.message, err.httpStatus, undefined, { cause: err, requestId: err.requestId });
    }
    throw err;
  });
}

/** 400 idempotency_error: the same key was sent with other parameters. A bug in key design, never normal. */
export class IdempotencyKeyMisuse extends GatewayError {
  override name = 'IdempotencyKeyMisuse';
  readonly outcome = 'idempotency_bug';
}

/** Any other 4xx on a create: Stripe refused the request before executing it, so nothing was charged
 * (or refunded: a refund of more than remains, say). `code`: Stripe's, e.g.
 * `payment_intent_unexpected_state` for a capture of an authorization no longer held. */
export class Rejected extends GatewayError {
  override name = 'Rejected';
  readonly outcome = 'rejected';
  readonly code: string | undefined;
  constructor(message: string, httpStatus?: number, externalId?: string, options?: ErrorOptions & { requestId?: string | undefined; code?: string | undefined }) {
    super(message, httpStatus, externalId, options);
    this.code = options?.code;
  }
}

/** For a `.catch` of a read: undefined when Stripe refused it (no such object, or not this account's);
 * any other failure (no answer, a 5xx, no budget token) is no evidence of absence, and is thrown. */
export function unlessRejected(err: unknown): undefined {
  if (err instanceof Rejected) return undefined;
  throw err;
}

/** The drift report's read of one operation's object on its account: undefined when Stripe refused it (no
 * such object: missing), the AccessRevoked when the connected account no longer lets the platform read it
 * (unknown, not missing: one account must not fail the whole report), thrown otherwise (no answer). */
export function driftRead<T>(read: Promise<T>): Promise<T | undefined | AccessRevoked> {
  return read.catch((err: unknown) => (err instanceof AccessRevoked ? err : unlessRejected(err)));
}

export const idempotencyKeyFor = (operationId: string): string => `payment-op:${operationId}`;
export const refundIdempotencyKeyFor = (operationId: string): string => `refund-op:${operationId}`;
export const captureIdempotencyKeyFor = (operationId: string): string => `capture-op:${operationId}`;
export const cancelIdempotencyKeyFor = (operationId: string): string => `cancel-op:${operationId}`;
