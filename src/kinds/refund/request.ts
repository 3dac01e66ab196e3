// Requesting a refund inside the caller's transaction: linked to its charge operation and unique per
// (charge operation, key), validated before anything is written.
import { z } from 'zod';
import type { Queryable } from '../../db/pool.ts';
import { isStorableText, MAX_AMOUNT, MAX_ID_LENGTH, parseWith } from '../../types/input.ts';
import { activeTraceparent, ATTR, withSpan } from '../../telemetry/tracing.ts';
import { REFUND_REASONS, type RefundReason } from '../../stripe/gateway.ts';
import { TransactionTypeError } from '../../db/caller.ts';
import { OperationNotFoundError } from '../../types/errors.ts';
import { isOperationId, type Operation } from '../../types/operation.ts';
import { CHARGE } from '../charge/evidence.ts';
import { REFUND } from './evidence.ts';

/** What a refund operation keeps in its payload: where the money goes back from, and why; the charge's
 * connected account; for a destination charge, whether the transfer and the platform's fee go back too. */
export interface RefundPayload {
  payment_intent: string;
  reason: RefundReason | null;
  stripe_account?: string;
  reverse_transfer?: true;
  refund_application_fee?: true;
}

/** The caller's name for a change of a charge (a refund here, a capture or a cancel: src/kinds/hold): the
 * same key of the same charge is the same change. */
export const chargeChangeKey = z
  .string({ error: 'key must be a string' })
  .min(1, 'key must not be empty')
  .max(MAX_ID_LENGTH, `key must be at most ${MAX_ID_LENGTH} characters`)
  // eslint-disable-next-line no-control-regex
  .refine((s) => !/[\u0000-\u001f\u007f]/.test(s), 'key must not contain control characters')
  .refine(isStorableText, 'key must not contain U+0000 or half a surrogate pair');

/** The charge operation a change names. */
export const chargeOperationIdInput = z
  .string({ error: 'chargeOperationId must be a string' })
  .refine(isOperationId, 'chargeOperationId must be an operation id (a UUID)')
  .transform((id) => id.toLowerCase());

export const refundInputSchema = z.strictObject({
  chargeOperationId: chargeOperationIdInput,
  amount: z
    .number({ error: 'amount must be a number of minor units' })
    .int('amount must be an integer number of minor units')
    .positive('amount must be positive')
    .max(MAX_AMOUNT, `amount must be at most ${MAX_AMOUNT} minor units`),
  key: chargeChangeKey,
  reason: z.enum(REFUND_REASONS, { error: `reason must be one of ${REFUND_REASONS.join(', ')}` }).optional(),
  /** A destination charge's refund: the transfer to the connected account is taken back as well. */
  reverseTransfer: z.boolean({ error: 'reverseTransfer must be true or false' }).optional(),
  /** …and the platform's application fee is given back. */
  refundApplicationFee: z.boolean({ error: 'refundApplicationFee must be true or false' }).optional(),
});

export type RefundInput = z.infer<typeof refundInputSchema>;

export const parseRefundInput = (input: unknown): RefundInput => parseWith(refundInputSchema, input);

/** A refund that must not be made, said before anything is written. */
export class RefundRefused extends Error {
  override name = 'RefundRefused';
  readonly chargeOperationId: string;
  /** not_a_charge, charge_not_succeeded, charge_not_captured (an authorization nothing was captured of),
   * exceeds_remaining, key_conflict (the key names a refund of another amount or reason), no_transfer
   * (reverseTransfer of a charge that is no destination charge) or no_application_fee
   * (refundApplicationFee of a charge that took none). */
  readonly code: 'not_a_charge' | 'charge_not_succeeded' | 'charge_not_captured' | 'exceeds_remaining' | 'key_conflict' | 'no_transfer' | 'no_application_fee';
  constructor(chargeOperationId: string, code: RefundRefused['code'], message: string) {
    super(message);
    this.chargeOperationId = chargeOperationId;
    this.code = code;
  }
}

export interface RefundRequested {
  operationId: string;
  /** false: this key already named a refund of the charge (nothing new was written). */
  created: boolean;
}

/** Validates `input` and requests the refund on `db`, the caller's transaction. */
export function requestRefund(db: Queryable, input: unknown): Promise<RefundRequested> {
  const req = parseRefundInput(input);
  const attributes = { [ATTR.kind]: REFUND, 'outboxd.charge_operation_id': req.chargeOperationId };
  return withSpan('outboxd.request_refund', attributes, async (span) => {
    const requested = await requestInTransaction(db, req);
    span.setAttributes({ [ATTR.operationId]: requested.operationId, 'outboxd.created': requested.created });
    return requested;
  });
}

async function requestInTransaction(db: Queryable, req: RefundInput): Promise<RefundRequested> {
  const charge = req.chargeOperationId;
  // Concurrent requests for one charge wait here for each other until the caller commits.
  const { rows: locked } = await db.query(db.sql.lockChargeForRefund(charge));
  if (!locked[0]) throw await notRefundable(db, charge);
  if (req.reverseTransfer && !locked[0].transfers) {
    throw new RefundRefused(charge, 'no_transfer', `charge ${charge} is not a destination charge: it made no transfer to reverse`);
  }
  if (req.refundApplicationFee && !locked[0].takes_fee) {
    throw new RefundRefused(charge, 'no_application_fee', `charge ${charge} took no application fee to refund`);
  }
  const reason = req.reason ?? null;
  const { rows } = await db.query(
    db.sql.insertRefundOperation(charge, req.amount, req.key, reason, activeTraceparent(), req.reverseTransfer ?? false, req.refundApplicationFee ?? false, locked[0].xact),
  );
  const d = rows[0];
  if (!d.under_lock) {
    throw new TransactionTypeError('this query function runs each statement in a transaction of its own (autocommit), so the refund could not be checked against the others of its charge: BEGIN first');
  }
  if (d.created_id) return { operationId: d.created_id, created: true };
  if (d.existing_id) {
    // Any connection's rows: a bigint may come back as a string where the caller's driver parses it so.
    const same =
      Number(d.existing_amount) === req.amount &&
      d.existing_reason === reason &&
      d.existing_reverse_transfer === (req.reverseTransfer ?? false) &&
      d.existing_refund_application_fee === (req.refundApplicationFee ?? false);
    if (same) return { operationId: d.existing_id, created: false };
    const takesBack = [d.existing_reverse_transfer && 'reverses the transfer', d.existing_refund_application_fee && 'refunds the application fee'].filter(Boolean);
    throw new RefundRefused(charge, 'key_conflict',
      `key ${JSON.stringify(req.key)} is refund operation ${d.existing_id} of charge ${charge} (${d.existing_amount}, reason ${d.existing_reason ?? 'none'}${takesBack.length ? `, ${takesBack.join(' and ')}` : ''}): another amount, reason, reverseTransfer or refundApplicationFee needs another key`);
  }
  if (d.authorization && Number(d.charge_amount) === 0) {
    throw new RefundRefused(charge, 'charge_not_captured', `charge ${charge} is an authorization with nothing captured: capture it first, or cancel it to release the funds`);
  }
  const remaining = Number(d.charge_amount) - Number(d.spent);
  throw new RefundRefused(charge, 'exceeds_remaining',
    `refund of ${req.amount} exceeds what remains unrefunded of charge ${charge}: ${remaining} of ${d.charge_amount} (refunds pending, unknown or succeeded count as spent)`);
}

async function notRefundable(db: Queryable, id: string): Promise<Error> {
  const { rows } = await db.query(db.sql.showOperation(id));
  const op: Operation | undefined = rows[0];
  if (!op) return new OperationNotFoundError(id);
  if (op.kind !== CHARGE) return new RefundRefused(id, 'not_a_charge', `operation ${id} is a ${op.kind}, not a charge`);
  return new RefundRefused(id, 'charge_not_succeeded', `charge ${id} is ${op.status}: only a succeeded charge can be refunded`);
}

