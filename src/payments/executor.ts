// The idempotent charge executor: docs/architecture.md §2 as code. Each database step is its own short, fenced,
// committed statement; the external call sits between them with no transaction open (invariant 3),
// so a crash at any line leaves a recovery point the next claim continues from.
import { inTransaction, type Pool, type Tx } from '../db/pool.ts';
import type { Logger } from '../log.ts';
import { ATTR, operationAttributes, outcomeOn, withSpan } from '../tracing.ts';
import { FAILED_CHARGE_STATUSES, GatewayError, idempotencyKeyFor, type Charge, type PaymentGateway } from './gateway.ts';
import {
  isSettled,
  loadOperation,
  recordAttempt,
  recordOutcome,
  type LoadedOperation,
  type Operation,
  type OperationStatus,
  type Outcome,
} from './operation.ts';

/** Stripe keeps an idempotency key's first result for at least 24 h; we stop trusting it after 23 h. */
export const KEY_WINDOW_SECONDS = 23 * 60 * 60;

export type GatewayCall = 'create' | 'retrieve' | 'search';

export interface ExecuteOptions {
  keyWindowSeconds?: number;
  /** Bound by the caller to the operation (ids, fence, attempt). */
  log?: Logger;
  /** The operation as the caller's claim just returned it, with this fence: saves reading it again. */
  claimed?: LoadedOperation;
  /** false: only settle through retrieve or search, never create (the reconcile sweep: read-only). */
  allowCreate?: boolean;
  /** Who runs it, for the settlement event: the dispatcher (the default) or the reconcile sweep. */
  source?: 'dispatcher' | 'reconcile';
  /** Runs inside the transaction that records the outcome (the dispatcher completes its job there). */
  onRecorded?: (tx: Tx, op: Operation, outcome: Outcome) => Promise<void>;
}

export interface Execution {
  /** The status before this run, for the transition it made. */
  from: OperationStatus;
  operation: Operation;
  /** Which gateway call was made, or null when the operation was already settled. */
  call: GatewayCall | null;
  outcome: Outcome | null;
}

export async function executeCharge(
  db: Pool,
  gateway: PaymentGateway,
  operationId: string,
  fence: number,
  opts: ExecuteOptions = {},
): Promise<Execution> {
  const log = opts.log;

  // 1. Load. A settled operation is never overwritten and causes no external call (invariant 5).
  const claimed = opts.claimed?.id === operationId && opts.claimed.fence === fence ? opts.claimed : undefined;
  const op = claimed ?? (await loadOperation(db, operationId, opts.keyWindowSeconds ?? KEY_WINDOW_SECONDS));
  if (isSettled(op.status)) return { from: op.status, operation: op, call: null, outcome: null };

  // 2. Choose the call. A known charge is settled by retrieve, never by another create (invariant 6);
  //    past the key window the key may be gone, so never create: search (invariant 7). A read-only
  //    caller (the sweep) searches where the dispatcher would create.
  const readOnly = opts.allowCreate === false;
  const call: GatewayCall = op.external_id ? 'retrieve' : op.key_window_passed || readOnly ? 'search' : 'create';

  // 3. Recovery point, before the call: count the attempt; a create stamps first_attempted_at (once) and
  //    last_attempted_at now, so the key window is measured from the first send. Fenced: a stale claim
  //    stops here, having called nothing.
  const attempt = await recordAttempt(db, op.id, fence, call);
  const { attempts } = attempt;

  // 4. The external call. No transaction is open and no connection is held.
  const started = performance.now();
  const traced = { ...operationAttributes(op, fence), [ATTR.call]: call, [ATTR.attempt]: attempts };
  const outcome = await withSpan('outboxd.gateway', traced, (span) => callGateway(gateway, op, call).then(outcomeOn(span)));
  const durationMs = Math.round(performance.now() - started);
  log?.info({ orderId: op.order_id, call, attempt: attempts, outcome: outcome.kind, durationMs }, 'gateway call finished');
  if (outcome.kind === 'needs_review') log?.error({ reason: outcome.reason }, 'operation needs review');

  // 5. Record the outcome, fenced, in one short transaction with whatever the caller commits beside it.
  const operation = await withSpan('outboxd.record_outcome', { ...traced, [ATTR.outcome]: outcome.kind }, (span) => inTransaction(db, async (tx) => {
    const recorded = await recordOutcome(tx, op, fence, outcome, opts.source ?? 'dispatcher', { call, attempt, durationMs });
    await opts.onRecorded?.(tx, recorded, outcome);
    span.setAttribute(ATTR.status, recorded.status);
    return recorded;
  }));
  return { from: op.status, operation, call, outcome };
}

async function callGateway(gateway: PaymentGateway, op: LoadedOperation, call: GatewayCall): Promise<Outcome> {
  try {
    switch (call) {
      case 'create':
        return fromCharge(
          op,
          await gateway.createCharge({
            operationId: op.id,
            amount: op.amount,
            currency: op.currency,
            customer: op.customer_id,
            paymentMethod: op.payment_method,
            metadata: op.metadata,
            idempotencyKey: idempotencyKeyFor(op.id),
          }),
        );
      case 'retrieve':
        return fromCharge(op, await gateway.retrieveCharge(op.external_id!));
      case 'search': {
        // Search results may be stale: a single match settles by what retrieve says now.
        const matches = await gateway.findCharges(op.id);
        if (matches.length !== 1) return fromSearch(op, matches);
        return fromCharge(op, await gateway.retrieveCharge(matches[0]!.id));
      }
    }
  } catch (err) {
    return fromError(err, call);
  }
}

/** docs/architecture.md §2.4: a 2xx is not success by itself; the PaymentIntent's status decides. */
function fromCharge(op: Operation, charge: Charge): Outcome {
  const { requestId } = charge;
  const mismatch = mismatchOf(op, charge);
  if (mismatch) return { kind: 'needs_review', externalId: null, reason: mismatch, retry: false, requestId };
  if (charge.status === 'succeeded') return { kind: 'succeeded', externalId: charge.id, requestId };
  if (FAILED_CHARGE_STATUSES.has(charge.status)) return { kind: 'failed', externalId: charge.id, reason: `payment intent ${charge.status}`, requestId };
  return { kind: 'ambiguous', externalId: charge.id, reason: `payment intent ${charge.status}`, requestId };
}

/** A charge that does not carry this operation's id, amount and currency must not settle it. */
function mismatchOf(op: Operation, charge: Charge): string | null {
  if (charge.operationId !== undefined && charge.operationId !== op.id)
    return `charge ${charge.id} belongs to operation ${charge.operationId}`;
  if (charge.amount !== op.amount || charge.currency !== op.currency)
    return `charge ${charge.id} is ${charge.amount} ${charge.currency}, operation is ${op.amount} ${op.currency}`;
  return null;
}

/** Zero or several matches (one is retrieved and settles by its status): search is not read-after-write,
 * so zero never means "not charged" — it waits, searched again later; several is a double charge for a
 * person. */
function fromSearch(op: Operation & { key_window_passed: boolean }, matches: Charge[]): Outcome {
  if (matches.length === 0) {
    const when = op.key_window_passed ? 'key window passed and search' : 'search';
    return { kind: 'needs_review', externalId: null, retry: true, reason: `${when} found no charge for this operation (search may lag; not proof of no charge)` };
  }
  const reason = `search found ${matches.length} charges for this operation: ${matches.map((m) => m.id).join(', ')}`;
  return { kind: 'needs_review', externalId: null, reason, retry: false };
}

function fromError(err: unknown, call: GatewayCall): Outcome {
  if (!(err instanceof GatewayError)) {
    // Whatever failed, we cannot tell whether the request reached the provider: ambiguous.
    return { kind: 'ambiguous', externalId: null, reason: `unexpected ${call} error: ${String(err)}` };
  }
  const reason = `${err.name}${err.httpStatus ? ` ${err.httpStatus}` : ''}: ${err.message}`;
  return { ...fromGatewayError(err, call, reason), requestId: err.requestId };
}

function fromGatewayError(err: GatewayError, call: GatewayCall, reason: string): Outcome {
  switch (err.outcome) {
    case 'declined':
      return { kind: 'failed', externalId: err.externalId ?? null, reason };
    case 'rate_limited':
      return { kind: 'rate_limited', reason };
    case 'not_executed':
      return { kind: 'not_executed', reason };
    case 'ambiguous':
      return { kind: 'ambiguous', externalId: err.externalId ?? null, reason };
    case 'idempotency_bug':
      return { kind: 'needs_review', externalId: null, reason: `idempotency key misuse (a bug): ${reason}`, retry: false };
    case 'rejected':
      // Refused before execution: definitive for a create; for a read it proves nothing about the charge.
      return call === 'create'
        ? { kind: 'failed', externalId: null, reason }
        : { kind: 'needs_review', externalId: null, reason: `${call} refused: ${reason}`, retry: false };
  }
}
