// A stateful Stripe emulator for PaymentIntents and their refunds, driven by the real `stripe` SDK over
// HTTP. It keeps what makes payments hard to get right: an idempotency layer that stores the first result
// of a key (500s included) and replays it byte for byte, 409 while a key executes, key expiry on a
// controllable clock, a search index that lags, and faults injected before or after the charge commits.
//
// StripeEmulator keeps its state in memory and is the synchronous handle tests, chaos and the demo
// drive; the runtime serves an EmulatorServer over a PgState, one ledger per data directory shared by
// every outboxd process on it (docs/emulator.md). It imports nothing of outboxd: it is the ledger that
// outboxd is checked against.
import { resetProcess, type RequestLogEntry, type ServerOptions, type WebhookDelivery } from './core.ts';
import { EVENT_FOR_STATUS, newEvent, scheduleDelivery } from './webhooks.ts';
import { EmulatorServer } from './server.ts';
import { captureBeforeMs, expire, processed, type SettleStatus } from './resources.ts';
import { MemoryState, REFUND_STATUSES, type EmulatedEvent, type FaultRule, type LedgerEntry, type PaymentIntent, type Refund, type RefundEntry, type RefundStatus, type WebhookTarget } from './state.ts';

export interface EmulatorOptions extends Omit<ServerOptions, 'requestLogLimit'> {
  /** How long after a write it becomes searchable. */
  searchLagMs?: number;
  /** Where to POST signed payment_intent.* and refund.* events (at least once: retried on failure). */
  webhooks?: WebhookTarget;
  /** The account's rate limit: requests/s across all requests, beyond which it answers 429 rate_limit. */
  rateLimit?: number;
}

/**
 * The emulator in memory, with a synchronous handle for tests, chaos and the demo: faults, the clock,
 * keys, settlement and the ledger are changed and read directly, between two requests.
 */
export class StripeEmulator extends EmulatorServer<MemoryState> {
  private readonly options: EmulatorOptions;

  constructor(options: EmulatorOptions = {}) {
    super(
      new MemoryState({
        ...(options.searchLagMs !== undefined ? { searchLagMs: options.searchLagMs } : {}),
        ...(options.webhooks ? { webhooks: options.webhooks } : {}),
        ...(options.rateLimit !== undefined ? { rateLimit: options.rateLimit } : {}),
      }),
      options,
    );
    this.options = options;
  }

  now(): number {
    return Date.now() + this.state.clockOffsetMs();
  }

  /** Moves the emulator's clock (key expiry, search lag, processing delay) forward. */
  advanceClock(ms: number): void {
    this.state.advanceClock(ms);
  }

  addFault(rule: FaultRule): string {
    return this.state.addFault(rule);
  }

  clearFaults(): void {
    this.state.clearFaults();
  }

  /** Forgets stored idempotency results at least `olderThanMs` old (all of them by default). */
  pruneKeys(olderThanMs = 0): number {
    return this.state.pruneKeys(olderThanMs, this.now());
  }

  settle(paymentIntentId: string, status: SettleStatus): PaymentIntent {
    const pi = this.state.setStatus(paymentIntentId, status);
    if (!pi) throw new Error(`no payment intent ${paymentIntentId}`);
    const type = EVENT_FOR_STATUS[pi.status];
    if (type) this.emit(type, pi, this.state.intent(paymentIntentId)!.account);
    return pi;
  }

  /** Expires an authorization (requires_capture) now, as Stripe does at its capture_before. */
  expire(paymentIntentId: string): PaymentIntent {
    const result = this.state.changeIntent(paymentIntentId, (pi) => expire(pi, this.now()), null);
    if (!result) throw new Error(`no payment intent ${paymentIntentId}`);
    if ('refused' in result) throw new Error(`${paymentIntentId} is not an authorization (requires_capture)`);
    this.emit('payment_intent.canceled', result.paymentIntent, this.state.intent(paymentIntentId)!.account);
    return result.paymentIntent;
  }

  configureWebhooks(target: WebhookTarget | undefined): void {
    this.state.configureWebhooks(target);
  }

  /** The platform account's rate limit in requests/s across all requests (null: none), and each
   * connected account's (default: the same); a request on a connected account counts against both. */
  setRateLimit(requestsPerSecond: number | null, accountRequestsPerSecond: number | null = null): void {
    this.state.configureRateLimit(requestsPerSecond, accountRequestsPerSecond);
  }

  /** A connected account disconnects the platform (`revoked`), or connects it again: while revoked, every
   * request on it is answered 403 account_invalid. */
  revokeAccess(account: string, revoked = true): void {
    this.state.revokeAccess(account, revoked);
  }

  /** Every event emitted, oldest first. */
  emittedEvents(): EmulatedEvent[] {
    return this.state.events();
  }

  webhookDeliveries(): WebhookDelivery[] {
    return [...this.core.deliveries];
  }

  configureSearch(opts: { lagMs?: number; frozen?: boolean }): void {
    this.state.configureSearch({
      ...(opts.lagMs !== undefined ? { lagMs: opts.lagMs } : {}),
      ...(opts.frozen !== undefined ? { frozenAtMs: opts.frozen ? this.now() : null } : {}),
    });
  }

  /** Back to a new emulator's state and options (the listener stays). */
  reset(): void {
    this.state.reset();
    resetProcess(this.core);
  }

  /** Moves a refund to a status (a pending one finishes, or fails), with its event if webhooks are on. */
  settleRefund(refundId: string, status: RefundStatus): Refund {
    if (!REFUND_STATUSES.includes(status)) throw new Error(`status must be one of ${REFUND_STATUSES.join(', ')}`);
    const refund = this.state.setRefundStatus(refundId, status);
    if (!refund) throw new Error(`no refund ${refundId}`);
    this.emit(status === 'failed' ? 'refund.failed' : 'refund.updated', refund, this.state.refund(refundId)!.account);
    return refund;
  }

  /** Every refund ever created, oldest first, with the key it was created under. */
  refundLedger(): RefundEntry[] {
    const settleMs = this.options.processingSettleMs;
    return this.state.refunds().map((e) => {
      const due = e.refund.status === 'pending' && settleMs !== undefined && this.now() - e.createdAtMs >= settleMs;
      return { ...e, refund: due ? this.settleRefund(e.refund.id, 'succeeded') : e.refund };
    });
  }

  /** Every PaymentIntent ever created, oldest first, with the key it was created under (and as of now:
   * processing ones settled after processingSettleMs, authorizations expired after capture_before). */
  ledger(): LedgerEntry[] {
    const settleMs = this.options.processingSettleMs;
    return this.state.intents().map((e) => {
      const pi = e.paymentIntent;
      const due = pi.status === 'processing' && settleMs !== undefined && this.now() - e.createdAtMs >= settleMs;
      const expired = pi.status === 'requires_capture' && this.now() >= captureBeforeMs(pi);
      return { ...e, paymentIntent: due ? this.settle(pi.id, processed(pi)) : expired ? this.expire(pi.id) : pi };
    });
  }

  requests(): RequestLogEntry[] {
    return [...this.core.log];
  }

  /** The synchronous twin of webhooks.ts's emit: the event is kept before this returns. */
  private emit(type: string, object: PaymentIntent | Refund, account: string | null): void {
    const target = this.state.webhooks();
    if (!target) return;
    const event = newEvent(type, object, this.now(), account);
    this.state.addEvent(event);
    scheduleDelivery(this.core, event, target);
  }
}
