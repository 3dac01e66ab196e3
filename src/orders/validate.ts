// Input validation for a charge request and the example's order confirmation (invariant 11): everything
// is checked before anything is written, and a refusal names the field.
import { z } from 'zod';
import { STRIPE_CURRENCIES } from './currencies.ts';

/** Stripe's largest amount for a single charge, in minor units (8 digits). */
export const MAX_AMOUNT = 99_999_999;
export const MAX_ID_LENGTH = 255;

export class ValidationError extends Error {
  override name = 'ValidationError';
  readonly field: string;
  /** The message without the field's name, for callers that name the field their own way (the CLI's flags). */
  readonly detail: string;
  constructor(field: string, message: string) {
    super(`${field}: ${message}`);
    this.field = field;
    this.detail = message;
  }
}

/**
 * PostgreSQL's text and jsonb cannot hold U+0000, and half a surrogate pair is no text at all (the driver
 * would store U+FFFD in its place, another id than the caller's). Either is refused here, before any
 * statement: one failing inside the caller's transaction would abort it.
 */
export const isStorableText = (s: string): boolean => !s.includes('\0') && s.isWellFormed();
const UNSTORABLE = 'must not contain U+0000 or half a surrogate pair';

/** Where in a JSON value (keys and strings, nested) the first unstorable text is: 'a.b[2]', or undefined. */
export function unstorableAt(value: unknown, path: string): string | undefined {
  if (typeof value === 'string') return isStorableText(value) ? undefined : path;
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) {
      const at = unstorableAt(value[i], `${path}[${i}]`);
      if (at) return at;
    }
    return undefined;
  }
  if (value === null || typeof value !== 'object') return undefined;
  for (const [k, v] of Object.entries(value)) {
    // The key itself goes unnamed when it cannot be stored: it is the bad part.
    if (!isStorableText(k)) return `${path} (a key)`;
    const at = unstorableAt(v, `${path}.${k}`);
    if (at) return at;
  }
  return undefined;
}

const id = (what: string) =>
  z
    .string({ error: `${what} must be a string` })
    .trim()
    .min(1, `${what} must not be empty`)
    .max(MAX_ID_LENGTH, `${what} must be at most ${MAX_ID_LENGTH} characters`)
    // eslint-disable-next-line no-control-regex
    .refine((s) => !/[\u0000-\u001f\u007f]/.test(s), `${what} must not contain control characters`)
    .refine(isStorableText, `${what} ${UNSTORABLE}`);

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
});

export type OrderInput = z.infer<typeof orderInputSchema>;

/** Parses untrusted input into an OrderInput or throws a ValidationError naming the first bad field. */
export function parseOrderInput(input: unknown): OrderInput {
  const result = orderInputSchema.safeParse(input);
  if (result.success) return result.data;
  throw validationErrorOf(result.error.issues[0]!);
}

/** The first issue zod found, as a ValidationError naming its field. A record's bad key is named with
 * the key's own issue, and by the record alone when the key itself cannot be stored (nor shown). */
export function validationErrorOf(issue: z.core.$ZodIssue): ValidationError {
  if (issue.code === 'unrecognized_keys') return new ValidationError(issue.keys.join(', '), 'unknown field');
  const path = issue.path.map(String);
  if (issue.code === 'invalid_key') {
    const named = isStorableText(path.at(-1) ?? '') ? path : path.slice(0, -1);
    return new ValidationError(named.join('.') || 'input', issue.issues[0]?.message ?? issue.message);
  }
  return new ValidationError(path.join('.') || 'input', issue.message);
}
