// An operation as its row holds it, and what one call learned about it: the shapes every layer reads.
import type { OperationStatus, Policy } from './status.ts';

export interface Operation {
  id: string;
  /** A charge's and a refund's (null for an application's own kind). */
  order_id: string | null;
  /** charge, refund, or a kind the application defines (src/engine/kinds.ts). */
  kind: string;
  /** The kind's policy when it was requested. */
  policy: Policy;
  /** A charge's and a refund's (null for an application's own kind: payment_operations_money_check). */
  amount: number | null;
  currency: string | null;
  /** A charge's (null for every other kind). */
  customer_id: string | null;
  payment_method: string | null;
  /** The application's metadata, sent to Stripe beside operation_id. */
  metadata: Record<string, string>;
  /** A refund's charge operation. */
  parent_operation_id: string | null;
  /** The caller's key: of a refund (unique per charge operation), of an application's effect (per kind). */
  effect_key: string | null;
  /** What the kind needs beyond the columns (a refund's: RefundPayload; an application effect's own). */
  payload: unknown;
  /** What an application's effect returned (or its check found). */
  result: unknown;
  /** Executions of an at-least-once effect after one that may have acted. */
  possible_duplicates: number;
  /** When the provider first said the effect is still under way (a PaymentIntent `processing`, a
   * Refund `pending`): it waits from then, not stuck (src/engine/processing.ts). */
  processing_since: Date | null;
  /** While it waits: when its job checks it next. */
  next_check_at: Date | null;
  status: OperationStatus;
  external_id: string | null;
  attempts: number;
  first_attempted_at: Date | null;
  last_attempted_at: Date | null;
  last_error: string | null;
  last_outcome: string | null;
  review_reason: string | null;
  needs_review: boolean;
  settled_at: Date | null;
  fence: number;
  lease_owner: string | null;
  lease_expires_at: Date | null;
  /** W3C traceparent of the request that created it (src/telemetry/tracing.ts); null when it was not traced. */
  traceparent: string | null;
  created_at: Date;
  updated_at: Date;
}

/** An operation as the console's lists read it (src/sql/context.ts: listedColumns): without its JSON. */
export type ListedOperation = Omit<Operation, 'metadata' | 'payload' | 'result'>;

export type LoadedOperation = Operation & { key_window_passed: boolean };

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
export const isOperationId = (s: string): boolean => UUID.test(s);

/**
 * How people name an operation where a table has no room for its id: the first three groups, 16 hex
 * digits. Ids are time-ordered (drizzle/0024_operation_ids_v7.sql): the first 12 digits are the
 * millisecond it was created in, shared by every operation of that millisecond, and the next 4 the
 * version and 12 random bits. 8 digits named one operation while ids were random; they now name ~65 s.
 * `ops show` and the console's search take it back as a prefix of the primary key.
 */
export const shortOperationId = (id: string): string => id.slice(0, 18);

export const isSettled = (status: OperationStatus): boolean => status === 'succeeded' || status === 'failed';

/** The key its caller gave: a capture's or a cancel's effect_key is qualified by its charge
 * (`<charge operation id>/<key>`: a key is a charge's own), the caller's kept in its payload; as the
 * settlement event says it (src/sql/outbox.ts). */
export function callerKeyOf(op: Pick<Operation, 'effect_key' | 'parent_operation_id' | 'payload'>): string | null {
  const key = (op.payload as { key?: unknown } | null)?.key;
  return typeof key === 'string' && op.parent_operation_id !== null && op.effect_key === `${op.parent_operation_id}/${key}` ? key : op.effect_key;
}

/** What one step of the executor learned, and Stripe's id of the response it learned it from (when
 * one arrived), which the operation's timeline keeps. */
export type Outcome = (
  /** result: what an application's effect returned, to store (JSON). */
  | { kind: 'succeeded'; externalId: string | null; result?: string }
  | { kind: 'failed'; externalId: string | null; reason: string }
  | { kind: 'ambiguous'; externalId: string | null; reason: string }
  /** The provider has the effect and is still carrying it out (SEPA Debit, ACH: days): waiting, not
   * unknown. Retrieved again on a slowing schedule, never created again. */
  | { kind: 'processing'; externalId: string; reason: string }
  /** `account`: only that connected account's own limit turned it away; other accounts' calls may go on.
   * `objectBusy`: another request held the object (a lock_timeout), nobody's limit. `retryAfterSeconds`:
   * when it is due again, where the refusal said. */
  | { kind: 'rate_limited'; reason: string; account?: string; objectBusy?: true; retryAfterSeconds?: number }
  | { kind: 'not_executed'; reason: string }
  /** A kind's check found that an earlier execution did not happen: it may be executed again. */
  | { kind: 'not_done'; reason: string }
  /** retry: whether driving it again can help (search may catch up); false holds it for a person now. */
  | { kind: 'needs_review'; externalId: string | null; reason: string; retry: boolean }
) & { requestId?: string | undefined };

/** What settled an operation, as its settlement event says: the dispatcher's or the reconcile sweep's
 * executor, a Stripe webhook, or a person's resolution. */
export type SettlementSource = 'dispatcher' | 'reconcile' | 'webhook' | 'admin';
