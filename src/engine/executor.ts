// The executor: docs/architecture.md §2 as code, one protocol for every kind of effect. Each database
// step is its own short, fenced, committed statement; the external call sits between them with no
// transaction open (invariant 3), so a crash at any line leaves a recovery point the next claim
// continues from. On the dispatcher's path the claim, the load, the choice of the call and its attempt
// are one statement, and the outcome another: two round trips around the call. What differs per kind
// (its policy on an ambiguous outcome, and the calls that carry it out and read what happened) comes from
// the registry the caller hands in (src/engine/kinds.ts); the engine never names a kind.
import type { EffectCall, KindRegistry, Policy } from './kinds.ts';
import { callTableIndex } from '../types/contracts.ts';
import { withinDeadline } from '../types/deadline.ts';
import { messageOf, textOf } from '../types/input.ts';
import { inTransaction, type Pool, type Tx } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';
import { ATTR, operationAttributes, outcomeOn, withSpan } from '../telemetry/tracing.ts';
import { GatewayError, type RetryLater } from '../stripe/gateway.ts';
import { judgeProcessing, PROCESSING_REVIEW_DAYS } from './processing.ts';
import {
  CHECK_AFTER_CREATE_GIVEN_UP,
  CREATE_MAY_STILL_ACT,
  flagForReview,
  foreignObject,
  isSettled,
  loadOperation,
  recordAttempt,
  recordOutcome,
  reschedules,
  type BegunAttempt,
  type LoadedOperation,
  type Operation,
  type OperationStatus,
  type Outcome,
} from './operation.ts';

/** Stripe keeps an idempotency key's first result for at least 24 h; we stop trusting it after 23 h. */
export const KEY_WINDOW_SECONDS = 23 * 60 * 60;

export interface ExecuteOptions {
  keyWindowSeconds?: number;
  /** Bound by the caller to the operation (its id, kind and fence). */
  log?: Logger;
  /** The operation as the caller's claim just returned it, with this fence: saves reading it again. */
  claimed?: LoadedOperation;
  /** The attempt that claim began, by this protocol's choice (claimAttempt with callTable): saves
   * choosing and counting it again. */
  begun?: BegunAttempt | undefined;
  /** false: never create, only read what happened (the reconcile sweep: read-only). */
  allowCreate?: boolean;
  /** Who runs it, for the settlement event: the dispatcher (the default) or the reconcile sweep. */
  source?: 'dispatcher' | 'reconcile';
  /** The call has started (every check before it passed): from here it may act, until `work`, the call
   * itself, settles, whether or not it was given up meanwhile. */
  onCallStarted?: (call: EffectCall, work: Promise<unknown>) => void;
  /** The call has returned: the dispatcher gives its slot to the next operation while this outcome is
   * recorded. */
  onCallEnded?: () => void;
  /** Runs inside the transaction that records an outcome that executed nothing, or a payment still
   * processing (the dispatcher replaces its job there, by a job `recheckSeconds` later for the latter).
   * Every other outcome is one statement, committed on its own. Without it, a processing payment is
   * recorded with no next check: the caller (the reconcile sweep) drives no job. */
  onRescheduled?: (tx: Tx, op: Operation, outcome: Outcome, recheckSeconds: number | undefined) => Promise<void>;
  /** A payment processing this long (from its first `processing`) is held for a person (PROCESSING_REVIEW_DAYS). */
  processingReviewDays?: number;
  /** Passed to an application effect's calls: aborted when the claim is lost or the worker stops (with
   * a CallAbandoned reason: a call that then fails has no outcome recorded). */
  signal?: AbortSignal;
  /** Called right before the external call: aborts `signal` (with CallAbandoned) when the claim's own
   * deadline has passed, so that a process that slept past its lease sends nothing. */
  checkLease?: () => void;
  /** A call was given up past its kind's timeout while it still runs: `running` settles when it returns. */
  onGivenUp?: (running: Promise<void>) => void;
}

export interface Execution {
  /** The status before this run, for the transition it made. */
  from: OperationStatus;
  operation: Operation;
  /** The kind's policy on an ambiguous outcome (null when the operation was already settled). */
  policy: Policy | null;
  /** Which call was made, or null when none was (settled, or held for a person before any call). */
  call: EffectCall | null;
  outcome: Outcome | null;
  /** An at-least-once kind executed again after an execution that may have acted. */
  possibleDuplicate: boolean;
}

/** A job of a kind this process does not define reached it (a worker takes only its kinds' queues). */
export class UnknownKindError extends Error {
  override name = 'UnknownKindError';
}

/** The worker gave the call up (it is shutting down past its grace period). A call that fails after
 * that has no outcome recorded and keeps its lease, left to expire: its request may still land, and a
 * claim made before it does would resend it, or check an effect not yet done and execute it again. */
export class CallAbandoned extends Error {
  override name = 'CallAbandoned';
  /** Set when the call ignored its signal and outlived its time too: it may still act, until this settles. */
  running?: Promise<void>;
}

/** A call outlived its kind's callTimeoutMs: its signal aborted with this, and it was given up.
 * `running`: settled (either way) once the call returns, if it ever does, and what is done with its
 * answer then; `late`: the call itself. */
export class CallTimedOut extends Error {
  override name = 'CallTimedOut';
  running: Promise<void> = Promise.resolve();
  late: Promise<unknown> = Promise.resolve();
}

/**
 * `call`'s promise, or a CallTimedOut once `timeoutMs` have passed (the call's signal aborts with it
 * first). A call that ignores its signal is abandoned, not waited for: it never holds its slot or its job
 * longer than its kind allows, whatever it does (an effect stuck on a socket with no timeout held them,
 * renewing its lease, forever). What it returns later is dropped (`running` tells when it returns).
 */
async function withinCallTimeout<T>(timeoutMs: number | undefined, signal: AbortSignal, call: (signal: AbortSignal) => Promise<T>): Promise<T> {
  if (timeoutMs === undefined) return call(signal);
  const timer = new AbortController();
  const work = call(AbortSignal.any([signal, timer.signal]));
  return withinDeadline(work, timeoutMs, () => {
    const err = new CallTimedOut(`the call did not return within ${timeoutMs} ms (timeoutMs): told to stop (its signal) and given up`);
    err.running = work.then(() => {}, () => {});
    err.late = work;
    timer.abort(err);
    return err;
  });
}

/**
 * A call given up while it may still run. A check or a read acted on nothing: asked again. A create may
 * have acted, or still act: ambiguous, as any lost answer, except under reconcile-before-retry, whose
 * retry trusts a check, which cannot rule out a create that acts after it: nothing is recorded, and the
 * CallTimedOut goes to the caller, which keeps the lease until the call returns (src/dispatcher).
 */
function timedOut(err: CallTimedOut, call: EffectCall, policy: Policy): Outcome {
  if (call === 'create' && policy === 'reconcile-before-retry') throw err;
  return { kind: 'ambiguous', externalId: null, reason: `${call}: ${err.message}` };
}

/**
 * What a reconcile-before-retry create given up past its timeout answered once it returned, recorded
 * under the claim that still holds its lease (the dispatcher keeps it until then): a result, or an
 * EffectFailed, is the answer the check would only guess at, and a check reading an index or a replica
 * that lags found nothing, and ran the effect again. Anything else (another error: it may have acted) is
 * left to the check. A claim taken over meanwhile (its lease lapsed) records nothing: its fence moved.
 */
async function recordLateAnswer(
  db: Pool,
  op: LoadedOperation,
  fence: number,
  late: Promise<Outcome>,
  made: { call: EffectCall; attempt: Awaited<ReturnType<typeof recordAttempt>>; source: 'dispatcher' | 'reconcile'; started: number },
  log: Logger | undefined,
): Promise<void> {
  const outcome = await late.then((answer) => answer, (err: unknown) => (isEffectFailed(err) ? fromError(err, made.call, true) : undefined));
  if (outcome?.kind !== 'succeeded' && outcome?.kind !== 'failed') return;
  const durationMs = Math.round(performance.now() - made.started);
  await recordOutcome(db, op, fence, outcome, made.source, { call: made.call, attempt: made.attempt, durationMs }).then(
    (recorded) => log?.warn({ status: recorded.status, durationMs }, 'a create given up past its timeout returned: its answer is recorded'),
    (err: unknown) => log?.warn({ err }, 'a create given up past its timeout returned, but its answer could not be recorded: the next claim checks'),
  );
}

export async function executeOperation(
  db: Pool,
  kinds: KindRegistry,
  operationId: string,
  fence: number,
  opts: ExecuteOptions = {},
): Promise<Execution> {
  const log = opts.log;

  // 1. Load. A settled operation is never overwritten and causes no external call (invariant 5).
  const claimed = opts.claimed?.id === operationId && opts.claimed.fence === fence ? opts.claimed : undefined;
  const op = claimed ?? (await loadOperation(db, operationId, opts.keyWindowSeconds ?? KEY_WINDOW_SECONDS));
  if (isSettled(op.status)) return { from: op.status, operation: op, policy: null, call: null, outcome: null, possibleDuplicate: false };
  const effect = kinds.get(op.kind);
  if (!effect) throw new UnknownKindError(`operation ${op.id}: no effect of kind ${op.kind} is defined in this process`);
  if (effect.policy !== op.policy) {
    // Never carry an operation out under a policy other than the one it was requested under.
    const reason = `requested under policy ${op.policy}, but this worker defines ${op.kind} as ${effect.policy}: deploy one definition everywhere, then requeue it`;
    log?.error({ reason }, 'operation needs review');
    const operation = await flagForReview(db, op.id, fence, reason);
    return { from: op.status, operation, policy: effect.policy, call: null, outcome: { kind: 'needs_review', externalId: null, reason, retry: false }, possibleDuplicate: false };
  }

  // 2. Choose the call by the kind's policy. A read-only caller (the sweep) never creates.
  // 3. Recovery point, before the call: count the attempt; a create stamps first_attempted_at (once) and
  //    last_attempted_at now, so the key window is measured from the first send (and an at-least-once
  //    create after one that may have acted is counted as a possible duplicate). Fenced: a stale claim
  //    stops here, having called nothing.
  //    The dispatcher's claim did both in its own statement, choosing by the same rule (callTable).
  const begun = claimed && opts.begun;
  const call = begun ? begun.call : chooseCall(op, effect.policy, opts.allowCreate === false);
  const atLeastOnce = effect.policy === 'at-least-once';
  const attempt = begun ? begun.attempt : await recordAttempt(db, op.id, fence, call, atLeastOnce);
  const { attempts } = attempt;
  const possibleDuplicate = atLeastOnce && call === 'create' && attempt.prev_first_attempted_at !== null;
  if (possibleDuplicate) log?.warn({ policy: effect.policy, attempt: attempts }, 'executing again after an execution that may have acted: a possible duplicate');

  // 4. The external call. No transaction is open and no connection is held.
  const started = performance.now();
  const traced = { ...operationAttributes(op, fence), [ATTR.call]: call, [ATTR.attempt]: attempts, [ATTR.policy]: effect.policy };
  const answered = await withSpan('outboxd.gateway', traced, (span) => {
    const made = effect.calls[call];
    if (!made) throw new Error(`kind ${op.kind} has no ${call} call`);
    const signal = opts.signal ?? new AbortController().signal;
    opts.checkLease?.();
    if (signal.reason instanceof CallAbandoned) throw signal.reason;
    const carryOut = (callSignal: AbortSignal) => {
      const beforeSend = () => {
        opts.checkLease?.();
        callSignal.throwIfAborted();
      };
      const work = made(op, { attempt: attempts, signal: callSignal, beforeSend });
      opts.onCallStarted?.(call, work);
      return work;
    };
    return withinCallTimeout(effect.callTimeoutMs, signal, carryOut)
      .catch((err: unknown) => {
        // Abandoned, and still running past its time: it may still act (`running` tells when it returns).
        if (signal.reason instanceof CallAbandoned) throw err instanceof CallTimedOut ? Object.assign(new CallAbandoned(signal.reason.message), { running: err.running }) : signal.reason;
        if (err instanceof CallTimedOut) {
          if (call === 'create' && effect.policy === 'reconcile-before-retry') {
            err.running = recordLateAnswer(db, op, fence, err.late as Promise<Outcome>, { call, attempt, source: opts.source ?? 'dispatcher', started }, log);
          }
          opts.onGivenUp?.(err.running);
          return timedOut(err, call, effect.policy);
        }
        return fromError(err, call, attempt.prev_first_attempted_at !== null);
      })
      .then(outcomeOn(span));
  });
  const durationMs = Math.round(performance.now() - started);
  opts.onCallEnded?.();
  // Still processing (days, for SEPA Debit or ACH): waiting, checked again later, or held for a person
  // past the review age.
  const judged = answered.kind === 'processing' ? judgeProcessing(op, answered, opts.processingReviewDays ?? PROCESSING_REVIEW_DAYS) : undefined;
  // A check that finds nothing done cannot rule out a create given up while it may still act: were it
  // trusted, the effect would run again and then, late, the given-up one too. A person finds out.
  const distrusted: Outcome | undefined =
    answered.kind === 'not_done' && op.review_reason?.includes(CREATE_MAY_STILL_ACT)
      ? { kind: 'needs_review', externalId: null, reason: CHECK_AFTER_CREATE_GIVEN_UP, retry: false }
      : undefined;
  // What Search found by the operation's id in metadata, which whoever can edit the object writes: another
  // operation's object settles this one never (one PaymentIntent, two orders told they were paid).
  const foreign = call === 'search' && effect.evidence?.foundByMetadata && 'externalId' in answered && answered.externalId
    ? await foreignObject(db, op, answered.externalId, effect.evidence.naming.object)
    : null;
  const taken: Outcome | undefined = foreign ? { kind: 'needs_review', externalId: null, reason: foreign, retry: false } : undefined;
  const outcome = taken ?? distrusted ?? judged?.outcome ?? answered;
  // The caller's logger names the operation and its kind; this line says what the call did.
  log?.info({ orderId: op.order_id, policy: effect.policy, call, attempt: attempts, outcome: outcome.kind, durationMs }, 'gateway call finished');
  if (outcome.kind === 'needs_review') log?.error({ reason: outcome.reason }, 'operation needs review');

  // 5. Record the outcome, fenced: one statement that also ends the lease, committed on its own. An
  //    outcome that executed nothing is recorded in one short transaction with what the caller commits
  //    beside it.
  const beside = reschedules(outcome) ? opts.onRescheduled : undefined;
  const recheckSeconds = beside ? judged?.recheckSeconds : undefined;
  const made = { call, attempt, durationMs, recheckSeconds };
  const source = opts.source ?? 'dispatcher';
  const operation = await withSpan('outboxd.record_outcome', { ...traced, [ATTR.outcome]: outcome.kind }, async (span) => {
    const recorded = beside
      ? await inTransaction(db, async (tx) => {
          const inTx = await recordOutcome(tx, op, fence, outcome, source, made);
          await beside(tx, inTx, outcome, recheckSeconds);
          return inTx;
        })
      : await recordOutcome(db, op, fence, outcome, source, made);
    span.setAttribute(ATTR.status, recorded.status);
    return recorded;
  });
  return { from: op.status, operation, policy: effect.policy, call, outcome, possibleDuplicate };
}

/** Every combination of the facts a call is chosen by, each at the index the dispatcher's claim reads it
 * from (src/types/contracts.ts: callTableIndex). */
const FACTS: readonly CallFacts[] = (() => {
  const table: CallFacts[] = [];
  for (const externalIdKnown of [false, true])
    for (const keyWindowPassed of [false, true])
      for (const attemptedBefore of [false, true])
        table[callTableIndex({ externalIdKnown, keyWindowPassed, attemptedBefore })] = {
          external_id: externalIdKnown ? 'known' : null,
          key_window_passed: keyWindowPassed,
          first_attempted_at: attemptedBefore ? new Date(0) : null,
        };
  return table;
})();

/** A kind's policy as the table a claim chooses the call from, by what the row holds when it is claimed. */
export function callTable(policy: Policy, readOnly = false): EffectCall[] {
  return FACTS.map((facts) => chooseCall(facts, policy, readOnly));
}

type CallFacts = Pick<LoadedOperation, 'external_id' | 'key_window_passed' | 'first_attempted_at'>;

/**
 * The policy decides the call:
 * - idempotent-key: a known object is settled by retrieve, never by another create (invariant 6); past
 *   the key window the key may be gone, so never create: search (invariant 7).
 * - reconcile-before-retry: once a create may have acted (its stamp is written before it runs), the
 *   kind's check establishes whether it did before anything runs again.
 * - at-least-once: create, whatever came before.
 */
function chooseCall(op: CallFacts, policy: Policy, readOnly: boolean): EffectCall {
  switch (policy) {
    case 'idempotent-key':
      return op.external_id ? 'retrieve' : op.key_window_passed || readOnly ? 'search' : 'create';
    case 'reconcile-before-retry':
      if (op.first_attempted_at) return 'check';
    // falls through: never attempted
    case 'at-least-once':
      if (readOnly) throw new Error(`a ${policy} kind is never reconciled read-only`);
      return 'create';
  }
}

/** Thrown by an application effect's execute (or check): by its name, not its class, since an effects
 * module may load another copy of outboxd than the worker's. */
const isEffectFailed = (err: unknown): err is Error => err instanceof Error && err.name === 'EffectFailed';

/** `actedBefore`: an earlier create of this operation may have executed. */
function fromError(err: unknown, call: EffectCall, actedBefore: boolean): Outcome {
  if (isEffectFailed(err)) return { kind: 'failed', externalId: null, reason: `${err.name}: ${messageOf(err)}` };
  if (!(err instanceof GatewayError)) {
    // Whatever failed, we cannot tell whether the request reached the provider: ambiguous.
    return { kind: 'ambiguous', externalId: null, reason: `unexpected ${call} error: ${textOf(err)}` };
  }
  const reason = `${err.name}${err.httpStatus ? ` ${err.httpStatus}` : ''}: ${err.message}`;
  return { ...fromGatewayError(err, call, reason, actedBefore), requestId: err.requestId };
}

function fromGatewayError(err: GatewayError, call: EffectCall, reason: string, actedBefore: boolean): Outcome {
  switch (err.outcome) {
    case 'declined':
      return { kind: 'failed', externalId: err.externalId ?? null, reason };
    case 'rate_limited': {
      const { account, code, retryAfterSeconds } = err as RetryLater;
      return {
        kind: 'rate_limited',
        reason,
        ...(account ? { account } : {}),
        ...(code === 'lock_timeout' ? { objectBusy: true as const } : {}),
        ...(retryAfterSeconds ? { retryAfterSeconds } : {}),
      };
    }
    case 'not_executed':
      return { kind: 'not_executed', reason };
    case 'access_revoked':
      // Nothing ran, and nothing will on that account: a first create failed. After a send that may have
      // acted, what it did cannot be read there any more: a person asks the account.
      return call === 'create' && !actedBefore
        ? { kind: 'failed', externalId: null, reason }
        : { kind: 'needs_review', externalId: null, reason: `${call} refused by the connected account: ${reason}; whether an earlier send executed cannot be read from the platform`, retry: false };
    case 'ambiguous':
      return { kind: 'ambiguous', externalId: err.externalId ?? null, reason };
    case 'idempotency_bug':
      return { kind: 'needs_review', externalId: null, reason: `idempotency key misuse (a bug): ${reason}`, retry: false };
    case 'rejected':
      // Refused before execution: definitive for a create; for a read it proves nothing about the effect.
      return call === 'create'
        ? { kind: 'failed', externalId: null, reason }
        : { kind: 'needs_review', externalId: null, reason: `${call} refused: ${reason}`, retry: false };
  }
}
