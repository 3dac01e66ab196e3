// An in-process PaymentGateway for the executor's unit tests that models Stripe's idempotency layer:
// the first result of a key (success, decline or stored 500) is replayed for every later request with
// that key until the keys are pruned. Faults are switches. Its ledger is the truth tests compare with.
import { randomUUID } from 'node:crypto';
import {
  AmbiguousOutcome,
  Declined,
  Rejected,
  RetryLater,
  type Charge,
  type CreateChargeParams,
  type PaymentGateway,
  type Refund,
  type CreateRefundParams,
} from '../../src/stripe/gateway.ts';

interface Stored {
  charge?: Charge;
  refund?: Refund;
  error?: Error;
}

export class FakeStripe implements PaymentGateway {
  /** Every PaymentIntent created, in order: the ledger. */
  readonly charges: Charge[] = [];
  /** Every Refund created, in order. */
  readonly refunds: Refund[] = [];
  /** Every call made, in order. */
  readonly calls: { method: 'create' | 'retrieve' | 'search' | 'create_refund' | 'retrieve_refund' | 'list_refunds'; key?: string; id?: string }[] = [];
  private readonly keys = new Map<string, Stored>();

  /** The next create executes (and is stored under its key) but its response is lost. */
  loseResponseOnce = false;
  /** The next N creates are refused with a 429 before executing. */
  rateLimitNext = 0;
  /** When set, every create waits for it before answering (to observe the database mid-call). */
  hold: Promise<void> | undefined;
  /** Charges are only found by search while this is true (Search is not read-after-write). */
  searchIndexed = true;

  async createCharge(req: CreateChargeParams): Promise<Charge> {
    this.calls.push({ method: 'create', key: req.idempotencyKey });
    if (this.hold) await this.hold;
    if (this.rateLimitNext > 0) {
      this.rateLimitNext--;
      throw new RetryLater('Too many requests', 429);
    }
    let stored = this.keys.get(req.idempotencyKey);
    if (!stored) {
      stored = this.execute(req);
      this.keys.set(req.idempotencyKey, stored);
    }
    if (this.loseResponseOnce) {
      this.loseResponseOnce = false;
      throw new AmbiguousOutcome('socket hang up (response lost)');
    }
    if (stored.error) throw stored.error;
    return { ...stored.charge! };
  }

  async retrieveCharge(id: string): Promise<Charge> {
    this.calls.push({ method: 'retrieve', id });
    const charge = this.charges.find((c) => c.id === id);
    if (!charge) throw new AmbiguousOutcome(`no such payment intent ${id}`, 404);
    return { ...charge };
  }

  async findCharges(operationId: string): Promise<Charge[]> {
    this.calls.push({ method: 'search', id: operationId });
    if (!this.searchIndexed) return [];
    return this.charges.filter((c) => c.operationId === operationId).map((c) => ({ ...c }));
  }

  async listCharges(): Promise<Charge[]> {
    return this.charges.map((c) => ({ ...c }));
  }

  /** Refunds succeed at once, unless their PaymentIntent holds less than they ask (refused, as at Stripe). */
  async createRefund(req: CreateRefundParams): Promise<Refund> {
    this.calls.push({ method: 'create_refund', key: req.idempotencyKey });
    let stored = this.keys.get(req.idempotencyKey);
    if (!stored) {
      const charge = this.charges.find((c) => c.id === req.paymentIntent);
      const refunded = this.refunds.filter((r) => r.paymentIntent === req.paymentIntent && r.status !== 'failed').reduce((sum, r) => sum + r.amount, 0);
      if (!charge || charge.status !== 'succeeded' || refunded + req.amount > charge.amount) {
        throw new Rejected(`cannot refund ${req.amount} of ${req.paymentIntent}`, 400);
      }
      const refund = { id: `re_${randomUUID().replaceAll('-', '').slice(0, 24)}`, status: 'succeeded', amount: req.amount, currency: charge.currency, paymentIntent: charge.id, operationId: req.operationId, account: null };
      this.refunds.push(refund);
      stored = { refund };
      this.keys.set(req.idempotencyKey, stored);
    }
    if (this.loseResponseOnce) {
      this.loseResponseOnce = false;
      throw new AmbiguousOutcome('socket hang up (response lost)');
    }
    return { ...stored.refund! };
  }

  async retrieveRefund(id: string): Promise<Refund> {
    this.calls.push({ method: 'retrieve_refund', id });
    const refund = this.refunds.find((r) => r.id === id);
    if (!refund) throw new Rejected(`no such refund ${id}`, 404);
    return { ...refund };
  }

  async findRefunds(paymentIntent: string): Promise<Refund[]> {
    this.calls.push({ method: 'list_refunds', id: paymentIntent });
    return this.refunds.filter((r) => r.paymentIntent === paymentIntent).map((r) => ({ ...r }));
  }

  async listRefunds(): Promise<Refund[]> {
    return this.refunds.map((r) => ({ ...r }));
  }

  /** Forget every idempotency key, as Stripe does after 24 hours. */
  pruneKeys(): void {
    this.keys.clear();
  }

  /** Move a PaymentIntent to another status, as Stripe does when `processing` finishes. */
  settle(id: string, status: string): void {
    this.charges.find((c) => c.id === id)!.status = status;
  }

  /** Adds a charge for `operationId` that did not come through the executor (a duplicate, say): an
   * automatic one, captured when it succeeded. */
  addCharge(charge: Pick<Charge, 'status' | 'amount' | 'currency' | 'operationId'>): Charge {
    const id = `pi_${randomUUID().replaceAll('-', '').slice(0, 24)}`;
    const received = charge.status === 'succeeded' ? charge.amount : 0;
    const c: Charge = { id, ...charge, captureMethod: 'automatic', amountCapturable: 0, amountReceived: received, captureBefore: null, cancellationReason: null, account: null };
    this.charges.push(c);
    return c;
  }

  // Authorizations are the emulator's (test/processes/capture.test.ts): this fake models automatic charges only.
  async capturePaymentIntent(): Promise<Charge> {
    throw new Rejected('FakeStripe models no authorization to capture', 400);
  }

  async cancelPaymentIntent(): Promise<Charge> {
    throw new Rejected('FakeStripe models no authorization to cancel', 400);
  }

  private execute(req: CreateChargeParams): Stored {
    const status =
      req.paymentMethod === 'pm_card_processing'
        ? 'processing'
        : req.paymentMethod.startsWith('pm_card_chargeDeclined')
          ? 'requires_payment_method'
          : 'succeeded';
    const charge = this.addCharge({ status, amount: req.amount, currency: req.currency, operationId: req.operationId });
    if (status === 'requires_payment_method') return { error: new Declined('Your card was declined.', 402, charge.id) };
    return { charge };
  }
}
