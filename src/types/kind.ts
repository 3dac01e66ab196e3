// A kind of effect, as River's Worker[T]: everything about it travels with it, and the engine, the
// webhooks, resolve, drift and the console ask it rather than branch on its name. Built-in kinds
// (src/kinds/charge, refund, capture, cancel) and an application's own (src/kinds/application) are all one of these.
import type { LoadedOperation, Operation, Outcome } from './operation.ts';
import type { Policy } from './status.ts';

/**
 * The calls the executor makes for an operation:
 * - create: the one that may carry the effect out (a charge's create);
 * - retrieve: reads the provider's object already known for it (external_id);
 * - search: finds what the provider holds for it, past the key window or read-only (the sweep): Search
 *   for a charge, the PaymentIntent's list of refunds for a refund;
 * - check: establishes whether an earlier create that may have acted did (reconcile-before-retry).
 */
export type EffectCall = 'create' | 'retrieve' | 'search' | 'check';

/** What a call may use besides the operation. */
export interface CallContext {
  /** This call's number among the operation's calls (1 for the first). */
  attempt: number;
  /** Aborted when the claim is lost, the worker shuts down past its grace period, or the kind's
   * callTimeoutMs has passed. */
  signal: AbortSignal;
  /** Throws (the signal's reason) once the call may send nothing more: the signal, and the lease's own
   * deadline read from the clock. A call that waits before it sends (for a rate budget) calls it last. */
  beforeSend(): void;
}

/** How one kind is carried out and checked: each call reports what it learned as an Outcome, or throws
 * (the executor classifies the error). */
export interface EffectCalls {
  create(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
  retrieve?(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
  search?(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
  check?(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
}

/** The provider's object that carries an operation out, as evidence reads it. */
export interface ProviderObject {
  id: string;
  status: string;
  amount: number;
  currency: string;
  /** metadata.operation_id, when it carries one */
  operationId: string | undefined;
  /** The connected account it was read from (null: the platform's): an object of another account than
   * the operation's never settles it, whatever its metadata says (a connected account writes its own). */
  account: string | null;
}

/** How a kind is named to people (the console, resolve's refusals), without a gateway. */
export interface KindNaming {
  /** What names its provider object: a resolution's external id must match it. */
  externalId: { pattern: RegExp; what: string };
  /** The console's label for the object that carried it out. */
  settledBy: string;
  /** What its provider object is called in a sentence ("payment intent", "refund"). */
  object: string;
  /** The idempotency key its creates are sent under. */
  idempotencyKey(operationId: string): string;
}

/** A person's resolution refused by the evidence: the message says why, and when trying again helps. */
export type Refuse = (message: string) => Error;

/** One line of the drift report: money that moved without an operation to show for it, or the reverse. */
export interface Drift {
  kind: string;
  operationId: string | null;
  chargeIds: string[];
  detail: string;
}

/** The drift line of an operation whose object its connected account no longer lets the platform read. */
export const unreadableDrift = (operationId: string, objectId: string, refusal: Error): Drift => ({
  kind: 'unreadable_account',
  operationId,
  chargeIds: [objectId],
  detail: `not checked: ${refusal.message}`,
});

/** How many operations the drift report reads at once: a month of a busy account's would not fit in a
 * replica's memory together. */
export const DRIFT_PAGE = 1000;

/** What the drift report hands each kind: the operations it may need, read a page at a time. */
export interface DriftContext {
  since: Date;
  /** The listed objects by the operation each names, with that operation when there is one (none for an
   * id that names no operation), DRIFT_PAGE operations at a time. */
  named<T extends { operationId?: string | undefined }>(objects: readonly T[]): AsyncIterable<[operationId: string, objects: T[], operation: Operation | undefined][]>;
  /** The operations of `kind` that these provider objects carried out. */
  byExternalIds(kind: string, externalIds: string[]): Promise<Operation[]>;
  /** Its succeeded operations since `since`, DRIFT_PAGE at a time. */
  succeeded(): AsyncIterable<Operation[]>;
}

/** How the provider's objects match and settle a kind's operations: ONE rule, used by its calls, the
 * webhooks, a person's resolution and the drift report. `Tx`: the transaction a follow-up writes in
 * (src/db/pool.ts's Queryable, which this leaf does not import). */
export interface KindEvidence<Tx = unknown> {
  naming: KindNaming;
  /** Its objects are found by the operation id in their metadata (a webhook, Search), which whoever can
   * edit them writes (a dashboard user, a connected account): one another operation records as its own,
   * or one naming an operation never sent, settles nothing (src/engine/operation.ts foreignObject). */
  foundByMetadata?: boolean;
  /** Where a webhook event's stored record (`event`) and its log line (`log`) name the object. */
  record: { event: string; log: string };
  /** Whether a webhook event of this type names an object of this kind with this id. */
  names(eventType: string, objectId: string): boolean;
  /** The object, read from `account` (a connected account's id; null: the platform's). */
  retrieve(id: string, account: string | null): Promise<ProviderObject>;
  /** Why `object` cannot settle `op` (another operation's, another amount, another object than the one
   * known), or null when it can. `byPerson`: a person's resolution names it, and what only a person can
   * judge is left to them. */
  mismatch(op: Operation, object: ProviderObject, byPerson?: boolean): string | null;
  /** The status `object` settles `op` with, or undefined while it is not final for it. */
  settles(op: Operation, object: ProviderObject): 'succeeded' | 'failed' | undefined;
  /** What the operation keeps of the object that settled it from outside (JSON: an authorization's hold),
   * as its own calls keep it; absent or null: nothing. */
  resultOf?(op: Operation, object: ProviderObject): string | null;
  /** Resolve --failed: what Stripe shows that no object of `op` succeeded or can still, or a refusal
   * (resolve itself first waits out a recent create, whatever the kind). */
  noneSucceeded(op: Operation, reason: string, refuse: Refuse): Promise<Record<string, unknown>>;
  /** What Stripe did since to the object of `op`, a settled operation of this kind, that outboxd must
   * record, in `tx` (from `source`: what told): an authorization released in Stripe, expired or
   * cancelled, or captured there, as an operation of its own with its settlement event; a refund failed
   * after it succeeded, on the operation, for a person. False when there is nothing to record. */
  followUp?(tx: Tx, op: Operation, object: ProviderObject, source: 'webhook' | 'reconcile'): Promise<boolean>;
  /** Whether an event showing the object of `op`, a settled operation, in `status` may bring something
   * for followUp (an authorization kept as held, shown captured, that no change of outboxd's accounts
   * for): such an event is retrieved and acted on, not taken as confirming the settlement. */
  changed?(db: Tx, op: Operation, status: string): Promise<boolean>;
  /** Settled operations of this kind whose object Stripe changed by now, as far as outboxd can tell (an
   * authorization past its capture_before, or one whose capture or cancel failed), at most `limit`: the
   * reconcile sweep retrieves each and hands it to followUp, for a deployment whose webhooks never told,
   * or told while a change stood in the way. */
  toFollowUp?(db: Tx, limit: number): Promise<Operation[]>;
  /** The drift report's part for this kind: what it listed since, and what does not add up. */
  drift(ctx: DriftContext): Promise<{ listed: number; label: string; drift: Drift[] }>;
}

export interface Kind {
  readonly kind: string;
  readonly policy: Policy;
  readonly calls: EffectCalls;
  /** The longest one call may take: past it the call's signal aborts (with CallTimedOut) and the engine
   * gives the call up, whether or not it stops (src/engine/executor.ts). Absent: the call's own bounds
   * only (the built-in kinds: the Stripe client's timeout). */
  readonly callTimeoutMs?: number;
  /** A provider's evidence; absent for an application's kind (resolve records the person's word). */
  readonly evidence?: KindEvidence;
}

/** The kinds one process carries out, by name: what the engine receives (River's Workers). */
export interface KindRegistry {
  get(kind: string): Kind | undefined;
  readonly names: readonly string[];
}
