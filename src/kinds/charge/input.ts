// A charge's input, validated (the example's order confirmation takes the same) (invariant 11): everything
// is checked before anything is written, and a refusal names the field.
import { z } from 'zod';
import { isStorableText, MAX_AMOUNT, MAX_ID_LENGTH, UNSTORABLE, parseWith } from '../../types/input.ts';
import { STRIPE_CURRENCIES } from './currencies.ts';

const id = (what: string) =>
  z
    .string({ error: `${what} must be a string` })
    .min(1, `${what} must not be empty`)
    // Not trimmed: an order id is the application's key, and ' A-1' is not 'A-1'.
    .refine((s) => s.trim() === s, `${what} must not begin or end with whitespace`)
    .max(MAX_ID_LENGTH, `${what} must be at most ${MAX_ID_LENGTH} characters`)
    // eslint-disable-next-line no-control-regex
    .refine((s) => !/[\u0000-\u001f\u007f]/.test(s), `${what} must not contain control characters`)
    .refine(isStorableText, `${what} ${UNSTORABLE}`);

/** A connected account's id, as Stripe names them. */
const connectedAccount = (what: string) =>
  z.string({ error: `${what} must be a string` }).regex(/^acct_[A-Za-z0-9]{1,64}$/, `${what} must be a connected account id (acct_…)`);

/** Stripe's metadata limits: 50 keys, one of them operation_id, outboxd's own (reconciliation searches by it). */
export const METADATA_LIMITS = { keys: 49, keyLength: 40, valueLength: 500 } as const;

const metadata = z
  .record(
    z
      .string()
      .min(1, 'metadata keys must not be empty')
      .max(METADATA_LIMITS.keyLength, `metadata keys must be at most ${METADATA_LIMITS.keyLength} characters`)
      .refine((k) => !/[[\]]/.test(k), 'metadata keys must not contain square brackets')
      .refine((k) => k !== 'operation_id', 'metadata key operation_id is reserved for outboxd')
      .refine(isStorableText, `metadata keys ${UNSTORABLE}`),
    z
      .string({ error: 'metadata values must be strings' })
      .min(1, 'metadata values must not be empty')
      .max(METADATA_LIMITS.valueLength, `metadata values must be at most ${METADATA_LIMITS.valueLength} characters`)
      .refine(isStorableText, `metadata values ${UNSTORABLE}`),
  )
  .refine(
    (m) => Object.keys(m).length <= METADATA_LIMITS.keys,
    `metadata takes at most ${METADATA_LIMITS.keys} keys (Stripe's 50, less outboxd's operation_id)`,
  );

export const orderInputSchema = z.strictObject({
  orderId: id('order id'),
  amount: z
    .number({ error: 'amount must be a number of minor units' })
    .int('amount must be an integer number of minor units')
    .positive('amount must be positive')
    .max(MAX_AMOUNT, `amount must be at most ${MAX_AMOUNT} minor units`),
  currency: z
    .string({ error: 'currency must be a string' })
    .trim()
    .toLowerCase()
    .refine((c) => STRIPE_CURRENCIES.has(c), 'currency must be an ISO 4217 code Stripe accepts'),
  customer: id('customer'),
  paymentMethod: id('payment method'),
  /** Sent to Stripe with the charge, beside operation_id. */
  metadata: metadata.optional(),
  /** After every earlier charge of the order failed: a new one even with the same payment method. */
  retry: z.boolean({ error: 'retry must be true or false' }).optional(),
  /** manual: an authorization that holds the funds, captured (requestCapture) or cancelled later. */
  captureMethod: z.enum(['automatic', 'manual'], { error: 'captureMethod must be automatic or manual' }).optional(),
  /** A connected account (Connect): the charge, its captures, cancels and refunds are made on it. */
  stripeAccount: connectedAccount('stripeAccount').optional(),
  /** A destination charge: made on the platform, the funds transferred to this connected account. */
  transferData: z.strictObject({ destination: connectedAccount('transferData.destination') }, { error: 'transferData must be { destination }' }).optional(),
  /** The platform's fee, in minor units: on a connected account's charge or a destination charge. */
  applicationFeeAmount: z
    .number({ error: 'applicationFeeAmount must be a number of minor units' })
    .int('applicationFeeAmount must be an integer number of minor units')
    .nonnegative('applicationFeeAmount must not be negative')
    .max(MAX_AMOUNT, `applicationFeeAmount must be at most ${MAX_AMOUNT} minor units`)
    .optional(),
}).superRefine((o, ctx) => {
  if (o.stripeAccount !== undefined && o.transferData !== undefined) {
    ctx.addIssue({ code: 'custom', path: ['transferData'], message: 'transferData is for a charge on the platform: not with stripeAccount' });
  }
  if (o.applicationFeeAmount !== undefined && o.stripeAccount === undefined && o.transferData === undefined) {
    ctx.addIssue({ code: 'custom', path: ['applicationFeeAmount'], message: 'applicationFeeAmount needs stripeAccount or transferData (a fee is taken from a connected account)' });
  }
  if (o.applicationFeeAmount !== undefined && o.applicationFeeAmount > o.amount) {
    ctx.addIssue({ code: 'custom', path: ['applicationFeeAmount'], message: 'applicationFeeAmount must not exceed amount' });
  }
});

export type OrderInput = z.infer<typeof orderInputSchema>;

/** Parses untrusted input into an OrderInput or throws a ValidationError naming the first bad field. */
export const parseOrderInput = (input: unknown): OrderInput => parseWith(orderInputSchema, input);

/** What a charge keeps in its payload beyond the columns; absent (null) for an automatic charge on the
 * platform, every charge before manual capture and Connect. Its refunds, captures and cancels copy the
 * account. */
export interface ChargePayload {
  capture_method?: 'manual';
  stripe_account?: string;
  transfer_destination?: string;
  application_fee_amount?: number;
}

export function chargePayloadFor(req: OrderInput): ChargePayload | null {
  const payload: ChargePayload = {
    ...(req.captureMethod === 'manual' ? { capture_method: 'manual' as const } : {}),
    ...(req.stripeAccount !== undefined ? { stripe_account: req.stripeAccount } : {}),
    ...(req.transferData !== undefined ? { transfer_destination: req.transferData.destination } : {}),
    ...(req.applicationFeeAmount !== undefined ? { application_fee_amount: req.applicationFeeAmount } : {}),
  };
  return Object.keys(payload).length ? payload : null;
}

