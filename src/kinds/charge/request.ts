// Requesting a charge inside the caller's transaction (invariant 1): the operation and its outbox row
// are written on the caller's connection, and nothing here begins, commits or rolls back. The input is
// validated before anything is written (invariant 11).
//
// An order has at most one live (not failed) charge operation, enforced by a partial unique index.
// Asking again with the same details returns it. Once every earlier one failed, the order may be
// charged again under a new operation (a new id, so a new idempotency key): with another payment
// method, or the same one and `retry: true`. The same details as a failed one, without `retry`,
// return that failed operation, so re-running an import charges nobody anew.
import type { Queryable } from '../../db/pool.ts';
import { jsonObjectOf } from '../../db/caller.ts';
import { chargePayloadFor, parseOrderInput, type ChargePayload, type OrderInput } from './input.ts';
import { activeTraceparent, ATTR, withSpan } from '../../telemetry/tracing.ts';
import type { Operation } from '../../engine/operation.ts';

export class OrderConflictError extends Error {
  override name = 'OrderConflictError';
  readonly orderId: string;
  /** The operation the request contradicts. */
  readonly operationId: string;
  /** The request's field that differs from it: amount, currency, customer, paymentMethod or one of the
   * charge's options (captureMethod, stripeAccount, transferData, applicationFeeAmount). */
  readonly field: string;
  constructor(orderId: string, op: Pick<Operation, 'id' | 'status'>, field: string) {
    const why =
      op.status === 'failed'
        ? 'a new charge of an order whose charges failed may change only the payment method'
        : `another charge is accepted only once it has failed`;
    super(`order ${orderId} has charge operation ${op.id} (${op.status}) with another ${field}: ${why}`);
    this.orderId = orderId;
    this.operationId = op.id;
    this.field = field;
  }
}

export interface ChargeRequested {
  operationId: string;
  /** false: an earlier request of this order already made this operation (nothing new was written). */
  created: boolean;
}

type Decision = { kind: 'existing'; op: Operation } | { kind: 'conflict'; op: Operation; field: string } | { kind: 'new_attempt' };

/** Given the order's charge operations (newest first), what a request that created nothing means. */
export function decideCharge(prior: Operation[], req: OrderInput): Decision {
  const live = prior.find((op) => op.status !== 'failed');
  if (live) {
    const field = differingField(live, req) ?? (live.payment_method !== req.paymentMethod ? 'paymentMethod' : undefined);
    return field ? { kind: 'conflict', op: live, field } : { kind: 'existing', op: live };
  }
  const latest = prior[0];
  if (!latest) return { kind: 'new_attempt' };
  const field = differingField(latest, req);
  if (field) return { kind: 'conflict', op: latest, field };
  const same = req.retry ? undefined : prior.find((op) => op.payment_method === req.paymentMethod);
  return same ? { kind: 'existing', op: same } : { kind: 'new_attempt' };
}

/** What belongs to the order itself and never changes between its charges. Any connection's rows: a
 * bigint may come back as a string, and JSON as its text (its numbers as strings or bigints), where the
 * caller's driver parses them so. */
function differingField(op: Operation, req: OrderInput): string | undefined {
  if (Number(op.amount) !== req.amount) return 'amount';
  if (op.currency !== req.currency) return 'currency';
  if (op.customer_id !== req.customer) return 'customer';
  const had = jsonObjectOf<ChargePayload>(op.payload) ?? {};
  const asks = chargePayloadFor(req) ?? {};
  const fee = (p: ChargePayload) => (p.application_fee_amount == null ? undefined : Number(p.application_fee_amount));
  if (had.capture_method !== asks.capture_method) return 'captureMethod';
  if (had.stripe_account !== asks.stripe_account) return 'stripeAccount';
  if (had.transfer_destination !== asks.transfer_destination) return 'transferData';
  if (fee(had) !== fee(asks)) return 'applicationFeeAmount';
  return undefined;
}

/** Validates `input` and requests the charge on `db`, the caller's transaction. */
export async function requestCharge(db: Queryable, input: unknown): Promise<ChargeRequested> {
  return requestValidCharge(db, parseOrderInput(input));
}

/** In a span of the caller's active trace, whose context the operation keeps (src/telemetry/tracing.ts). */
export function requestValidCharge(db: Queryable, req: OrderInput): Promise<ChargeRequested> {
  return withSpan('outboxd.request_charge', { [ATTR.orderId]: req.orderId, [ATTR.kind]: 'charge' }, async (span) => {
    const requested = await requestInTransaction(db, req);
    span.setAttributes({ [ATTR.operationId]: requested.operationId, 'outboxd.created': requested.created });
    return requested;
  });
}

async function requestInTransaction(db: Queryable, req: OrderInput): Promise<ChargeRequested> {
  const traceparent = activeTraceparent();
  const payload = chargePayloadFor(req);
  const insert = async (newAttempt: boolean): Promise<string | undefined> => {
    const values = [req.orderId, req.amount, req.currency, req.customer, req.paymentMethod] as const;
    const { rows } = await db.query(
      db.sql.insertChargeOperation(...values, JSON.stringify(req.metadata ?? {}), newAttempt, traceparent, payload && JSON.stringify(payload)),
    );
    return rows[0]?.id;
  };
  let created = await insert(false);
  // Not created: decide from what exists. A concurrent request can only have added a live operation,
  // which the next read sees (each statement reads what committed before it), so this settles in a step.
  for (let round = 0; !created && round < 3; round++) {
    const { rows } = await db.query(db.sql.chargeOperationsOfOrder(req.orderId));
    const decision = decideCharge(rows, req);
    if (decision.kind === 'existing') return { operationId: decision.op.id, created: false };
    if (decision.kind === 'conflict') throw new OrderConflictError(req.orderId, decision.op, decision.field);
    created = await insert(true);
  }
  if (!created) throw new Error(`order ${req.orderId}: its charge operations kept changing during the request; try again`);
  return { operationId: created, created: true };
}
