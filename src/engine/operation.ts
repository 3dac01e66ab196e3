// The payment operation's state machine. This module is the only one that changes an operation's
// status, and every write it makes is conditioned on the caller's fencing token (docs/architecture.md §3).
//
//            create/retrieve/search outcome
//   pending ───────────────────────────────▶ succeeded   (2xx with status succeeded)
//      │  ╲                                  failed      (402 decline; canceled or requires_payment_method;
//      │   ╲                                              any other 4xx refused before execution)
//      │    ╲──────────▶ unknown ──────────▶ succeeded | failed   (retry with the same key, retrieve,
//      │  ambiguous      │    ▲                                    or search once the key window passed)
//      │  (timeout, 5xx, └────┘ still ambiguous / review needed
//      │   409, requires_action…)
//      │        processing ──▶ unknown, waiting: retrieved again on a slowing schedule (processing_since,
//      │                       next_check_at); held for a person past PROCESSING_REVIEW_DAYS
//      └─▶ pending  (429, 401/403, connection refused: nothing executed, status unchanged, and the key
//                    window this attempt opened is closed again)
//   unknown ──▶ pending  (a reconcile-before-retry kind's check found the earlier execution did not
//                         happen: the attempt stamps are cleared, so the next claim executes again)
//
// succeeded and failed are terminal: no write touches them again and they cause no external call
// (invariant 5). "Needs review" is not a status: it is a reason recorded on an unsettled operation.
import { coalesced } from '../db/coalesce.ts';
import type { Queryable } from '../db/pool.ts';
import type { OperationStatus, Policy } from '../types/status.ts';
import { OperationNotFoundError, StaleFenceError } from '../types/errors.ts';
import { DISCREPANCY_PREFIX } from '../types/contracts.ts';
import { storableJson, storableReason } from '../types/input.ts';
import { isSettled, type ListedOperation, type LoadedOperation, type Operation, type Outcome, type SettlementSource } from '../types/operation.ts';
import { ATTR, withSpan } from '../telemetry/tracing.ts';

export type { ListedOperation, LoadedOperation, Operation, OperationStatus, Outcome, SettlementSource };
export { isOperationId, isSettled, shortOperationId } from '../types/operation.ts';
export { OperationNotFoundError, StaleFenceError };

/** Outcomes that prove nothing was executed: not an attempt that may have acted. */
export const executedNothing = (outcome: Outcome): boolean =>
  outcome.kind === 'rate_limited' || outcome.kind === 'not_executed' || outcome.kind === 'not_done';

/** Outcomes after which the job is replaced by a later one rather than retried by pg-boss: nothing was
 * executed (no attempt spent), or the payment is still processing (waiting days is not a failure). */
export const reschedules = (outcome: Outcome): boolean => executedNothing(outcome) || outcome.kind === 'processing';

/** The transition table: the status an outcome moves an unsettled operation to. */
export function nextStatus(current: OperationStatus, outcome: Outcome): OperationStatus {
  if (isSettled(current)) throw new Error(`operation is settled (${current}); outcomes cannot change it`);
  switch (outcome.kind) {
    case 'succeeded':
      return 'succeeded';
    case 'failed':
      return 'failed';
    case 'ambiguous':
    case 'processing':
    case 'needs_review':
      return 'unknown';
    case 'rate_limited':
    case 'not_executed':
      return current;
    case 'not_done':
      return 'pending';
  }
}

async function staleFence(db: Queryable, id: string, fence: number): Promise<StaleFenceError> {
  const now = await peekOperation(db, id);
  return new StaleFenceError(id, fence, now?.fence, now?.status);
}

export async function loadOperation(db: Queryable, id: string, keyWindowSeconds: number): Promise<LoadedOperation> {
  const { rows } = await db.query(db.sql.loadOperation(id, keyWindowSeconds));
  if (!rows[0]) throw new OperationNotFoundError(id);
  return rows[0];
}

export interface Attempt {
  attempts: number;
  first_attempted_at: Date | null;
  /** The stamps before this attempt: put back when its outcome proves nothing executed. */
  prev_first_attempted_at: Date | null;
  prev_last_attempted_at: Date | null;
}

/** Fenced: counts the call about to be made (and, for a create, stamps first_attempted_at and
 * last_attempted_at now, before the send, so a crash mid-call leaves the window measured). With
 * `atLeastOnce`, a create after one that may have acted is counted as a possible duplicate. */
export async function recordAttempt(
  db: Queryable,
  id: string,
  fence: number,
  call: 'create' | 'retrieve' | 'search' | 'check',
  atLeastOnce = false,
): Promise<Attempt> {
  const { rows } = await db.query(db.sql.recordAttempt(id, fence, call, atLeastOnce));
  if (!rows[0]) throw await staleFence(db, id, fence);
  return rows[0];
}

/** The gateway call an outcome answers, as recordAttempt counted it. */
export interface CallMade {
  call: 'create' | 'retrieve' | 'search' | 'check';
  attempt: Attempt;
  durationMs: number;
  /** A processing payment whose job is replaced by one this much later: its next_check_at. */
  recheckSeconds?: number | undefined;
}

/** Fenced: applies an outcome through the transition table, ends the claim's lease, and returns the
 * updated operation. When a create's outcome proves nothing executed, the attempt's stamps are undone:
 * a 429 (or 401/403, or a connection never opened) does not start the key window; a check that found no
 * earlier execution clears them, so the next claim executes. A settling outcome writes its settlement
 * event, and every outcome its timeline entry, in the same statement. Outcomes recorded together on one
 * pool share that statement (src/db/coalesce.ts), each fenced by its own claim. */
export async function recordOutcome(
  db: Queryable,
  op: Operation,
  fence: number,
  outcome: Outcome,
  source: SettlementSource & ('dispatcher' | 'reconcile'),
  made: CallMade,
): Promise<Operation> {
  const status = nextStatus(op.status, outcome);
  const externalId = 'externalId' in outcome ? outcome.externalId : null;
  const error = 'reason' in outcome ? storableReason(outcome.reason) : null;
  // A reason that only says "try again later" (search not caught up) does not replace one a person needs
  // (a key misuse, a mismatched charge): their runbook actions differ.
  const review = outcome.kind === 'needs_review' && !(outcome.retry && op.review_reason) ? error : null;
  const createAttempt = made.call === 'create' ? made.attempt : undefined;
  const undo = outcome.kind === 'not_done' || (createAttempt !== undefined && executedNothing(outcome));
  const result = outcome.kind === 'succeeded' ? (outcome.result ?? null) : null;
  const event = {
    call: made.call,
    attempt: made.attempt.attempts,
    outcome: outcome.kind,
    from: op.status,
    to: status,
    duration_ms: made.durationMs,
    request_id: outcome.requestId ?? null,
    external_id: externalId,
    error,
  };
  const write: OutcomeRow = {
    id: op.id,
    fence,
    status,
    external_id: externalId,
    last_outcome: outcome.kind,
    last_error: error,
    review_reason: review,
    undo,
    first_attempted_at: createAttempt?.prev_first_attempted_at ?? null,
    // A check that found nothing done restarts the key window, but keeps the last send on record: Stripe
    // may still be running it, and a person's --failed waits out the search-freshness horizon from it.
    last_attempted_at: createAttempt ? createAttempt.prev_last_attempted_at : (op.last_attempted_at ?? op.first_attempted_at),
    source,
    event,
    result,
    recheck_seconds: made.recheckSeconds ?? null,
    owner: op.lease_owner,
  };
  // An outcome whose row another transaction holds (an application's lock) is written alone, waiting for
  // it (up to lock_timeout), while the outcomes recorded with it, and after it, go on.
  const recorded =
    (await coalesced(db, 'recordOutcomes', (writes: OutcomeRow[]) => recordOutcomes(db, writes, 'skipHeld'))(write)) ??
    (await recordOutcomes(db, [write], 'waitForHeld'))[0];
  if (!recorded || recorded instanceof StaleFenceError) throw recorded ?? new StaleFenceError(write.id, write.fence);
  return recorded;
}

/** One outcome as recordOutcomes writes it (src/sql/statements.ts). */
interface OutcomeRow {
  id: string;
  fence: number;
  status: OperationStatus;
  external_id: string | null;
  last_outcome: Outcome['kind'];
  last_error: string | null;
  review_reason: string | null;
  undo: boolean;
  first_attempted_at: Date | null;
  last_attempted_at: Date | null;
  source: SettlementSource;
  event: Record<string, unknown>;
  /** An application effect's result, JSON. */
  result: string | null;
  /** Set for a processing payment whose job is replaced: next_check_at is that far from now. */
  recheck_seconds: number | null;
  /** The claim's owner, who made the call: the timeline's row of the call names it. */
  owner: string | null;
}

/** Each write's operation, or StaleFenceError (written nothing: the fence moved, or it settled); with
 * `skipHeld`, undefined for one whose row another transaction held, left unwritten. */
async function recordOutcomes(db: Queryable, writes: OutcomeRow[], held: 'skipHeld' | 'waitForHeld'): Promise<(Operation | StaleFenceError | undefined)[]> {
  const rowsOf = writes.map((w, ord) => ({ ord, ...w, result: w.result === null ? null : storableJson(w.result) }));
  const statement = held === 'skipHeld' ? db.sql.recordOutcomes : db.sql.recordOutcomesWaiting;
  const { rows } = await db.query(statement(storableJson(JSON.stringify(rowsOf))));
  return rows.map((row, i) => {
    const { ord: _ord, source: _source, event: _event, current_fence, current_status, held: rowHeld, ...operation } = row;
    const w = writes[i]!;
    if (rowHeld) return undefined;
    return operation.id === null ? new StaleFenceError(w.id, w.fence, current_fence ?? undefined, current_status ?? undefined) : (operation as Operation);
  });
}

export interface Lease {
  fence: number;
  /** The holder whose expired lease this claim took over, if any. */
  previousOwner: string | null;
  /** The operation as the claim left it (what loadOperation would read). */
  operation: LoadedOperation;
}

/** A new claim with a larger fencing token, or undefined when the operation is settled or leased by someone live. */
export async function claimOperation(
  db: Queryable,
  id: string,
  owner: string,
  ttlMs: number,
  keyWindowSeconds: number,
): Promise<Lease | undefined> {
  return withSpan('outboxd.claim', { [ATTR.operationId]: id, 'outboxd.lease.owner': owner }, async (span) => {
    const { rows } = await db.query(db.sql.acquireLease(id, owner, ttlMs, keyWindowSeconds));
    span.setAttribute('outboxd.claimed', rows.length > 0);
    if (!rows[0]) return undefined;
    const { previous_owner, ...operation } = rows[0];
    span.setAttributes({ [ATTR.fence]: operation.fence, 'outboxd.lease.taken_over': previous_owner !== null });
    return { fence: operation.fence, previousOwner: previous_owner, operation };
  });
}

/** The call a claim chose and counted in its own statement (claimAttempt). */
export interface BegunAttempt {
  call: CallMade['call'];
  attempt: Attempt;
}

/** What an operation holds, read without a claim. */
export interface OperationState {
  fence: number;
  status: OperationStatus;
  lease_owner: string | null;
}

export type ClaimedAttempt =
  | { lease: Lease & { begun: BegunAttempt | undefined }; current?: undefined }
  /** current: undefined when there is no such operation; locked: another transaction holds its row. */
  | { lease?: undefined; current: (Pick<OperationState, 'status' | 'lease_owner'> & { locked: boolean }) | undefined };

/**
 * A new claim, and the attempt of the call it leads to, in one statement (the dispatcher's): `calls` is
 * `policy` as a table (src/engine/executor.ts: callTable), so the call is chosen by what the row holds
 * at the instant of the claim. begun is undefined when the row is of another kind than `kind` or was
 * requested under another policy (the executor then chooses and counts, or holds it for a person, as for
 * any claim). Not claimed: what the operation holds instead. Claims made together on one pool with the
 * same owner and table share that statement (src/db/coalesce.ts).
 */
export async function claimAttempt(
  db: Queryable,
  id: string,
  owner: string,
  ttlMs: number,
  keyWindowSeconds: number,
  kind: string,
  policy: Policy,
  calls: readonly BegunAttempt['call'][],
): Promise<ClaimedAttempt> {
  return withSpan('outboxd.claim', { [ATTR.operationId]: id, 'outboxd.lease.owner': owner }, async (span) => {
    const key = JSON.stringify(['claimAttempts', owner, ttlMs, keyWindowSeconds, kind, policy, calls]);
    const claim = await coalesced(db, key, (ids: string[]) => claimAttempts(db, ids, owner, ttlMs, keyWindowSeconds, kind, policy, calls))(id);
    span.setAttribute('outboxd.claimed', claim.lease !== undefined);
    if (claim.lease) {
      const { fence, previousOwner, begun } = claim.lease;
      span.setAttributes({ [ATTR.fence]: fence, 'outboxd.lease.taken_over': previousOwner !== null, ...(begun ? { [ATTR.call]: begun.call } : {}) });
    }
    return claim;
  });
}

async function claimAttempts(
  db: Queryable,
  ids: string[],
  owner: string,
  ttlMs: number,
  keyWindowSeconds: number,
  kind: string,
  policy: Policy,
  calls: readonly BegunAttempt['call'][],
): Promise<ClaimedAttempt[]> {
  const { rows } = await db.query(db.sql.claimAttempts(ids, owner, ttlMs, keyWindowSeconds, kind, policy, calls));
  return rows.map((row): ClaimedAttempt => {
    const { current_status, current_owner, locked, previous_owner, call, prev_first_attempted_at, prev_last_attempted_at, ...operation } = row;
    if (operation.id === null) return { current: current_status === null ? undefined : { status: current_status, lease_owner: current_owner, locked } };
    const attempt: Attempt = { attempts: operation.attempts, first_attempted_at: operation.first_attempted_at, prev_first_attempted_at, prev_last_attempted_at };
    return { lease: { fence: operation.fence, previousOwner: previous_owner, operation, begun: call ? { call, attempt } : undefined } };
  });
}

/** The fencing token of a new claim, or undefined when the operation is settled or leased by someone live. */
export async function acquireLease(db: Queryable, id: string, owner: string, ttlMs: number): Promise<number | undefined> {
  return (await claimOperation(db, id, owner, ttlMs, 0))?.fence;
}

/** Fenced: holds an unsettled operation for a person (its status does not change) and ends the claim. */
export async function flagForReview(db: Queryable, id: string, fence: number, reason: string): Promise<Operation> {
  const { rows } = await db.query(db.sql.flagForReview(id, fence, reason));
  if (!rows[0]) throw await staleFence(db, id, fence);
  return rows[0];
}

/** Holds an operation, settled or not, for a person without a claim (nothing it settled to is touched):
 * Stripe shows money it does not account for. The reason stays until a person resolves or acknowledges it. */
export async function flagDiscrepancy(db: Queryable, id: string, reason: string): Promise<void> {
  await db.query(db.sql.flagDiscrepancy(id, `${DISCREPANCY_PREFIX}${reason}`));
}

/** Clears a settled operation's review reason as a person read it (`reasonSeen`), acknowledging it;
 * undefined when the operation is unsettled (resolve it) or its reason is not that one (none, or changed). */
export async function acknowledgeReview(
  db: Queryable,
  id: string,
  actor: string,
  note: string,
  reasonSeen: string,
): Promise<(Operation & { acknowledged_reason: string }) | undefined> {
  return (await db.query(db.sql.acknowledgeReview(id, actor, note, reasonSeen))).rows[0];
}

/** The operation's current fence and status, without a claim. */
export async function peekOperation(db: Queryable, id: string): Promise<OperationState | undefined> {
  const { rows } = await db.query(db.sql.fenceOf(id));
  return rows[0];
}

/** Extends the lease while a call is in flight; false when the fence moved (the lease was taken over). */
export async function renewLease(db: Queryable, id: string, fence: number, ttlMs: number): Promise<boolean> {
  const { rowCount } = await db.query(db.sql.renewLease(id, fence, ttlMs));
  return rowCount === 1;
}

export async function releaseLease(db: Queryable, id: string, fence: number): Promise<void> {
  await db.query(db.sql.releaseLease(id, fence));
}

/** The review reason of a reconcile-before-retry operation whose create was given up while it may still
 * act (its check cannot rule out a create that acts after it). */
export const CREATE_MAY_STILL_ACT = 'a create given up (past its timeoutMs, or at a worker\'s stop) may still act: until it returns, no check can tell whether it will';

/** The review reason of one whose claim found that mark (the create never said it returned: its process
 * died or stopped) and whose check found nothing done. Not the mark's words: once a person requeues it,
 * its next check is trusted. */
export const CHECK_AFTER_CREATE_GIVEN_UP = 'its create, given up while it could still act, never said it returned, and its check found nothing done: find out in the other system whether it acted';

/** Fenced, the lease kept: holds the operation for a person while its given-up create may still act. */
export async function markCreateMayStillAct(db: Queryable, id: string, fence: number): Promise<void> {
  await db.query(db.sql.markCreateMayStillAct(id, fence, CREATE_MAY_STILL_ACT));
}

/** Fenced: the given-up create returned: its mark goes (its lease is the caller's to release). */
export async function clearCreateMayStillAct(db: Queryable, id: string, fence: number): Promise<void> {
  await db.query(db.sql.clearCreateMayStillAct(id, fence, CREATE_MAY_STILL_ACT));
}

/** Fenced: ends a claim that sent nothing, and uncounts the attempt it began (`begun`, as claimAttempt
 * returned it; a create's stamps go back to what they were, and so does a possible duplicate it counted
 * under the at-least-once policy). */
export async function releaseUnsentClaim(db: Queryable, id: string, fence: number, begun: BegunAttempt | undefined, policy: Policy): Promise<void> {
  const { prev_first_attempted_at: prevFirst = null, prev_last_attempted_at: prevLast = null } = begun?.attempt ?? {};
  const duplicate = begun?.call === 'create' && policy === 'at-least-once' && prevFirst !== null ? 1 : 0;
  await db.query(db.sql.releaseUnsentClaim(id, fence, begun?.call ?? null, prevFirst, prevLast, duplicate));
}

/** Fenced: settles an operation under the caller's own claim (a person's resolution). Undefined when
 * the fence moved or the operation settled meanwhile. */
export async function settleUnderLease(
  db: Queryable,
  id: string,
  fence: number,
  status: 'succeeded' | 'failed',
  externalId: string | null,
  source: string,
  reason: string | null,
  /** What the kind keeps of the object that settled it (JSON; an authorization's hold), or null. */
  result: string | null,
  /** The review reason the resolution claimed the operation with: the one it answers. */
  reasonAtClaim: string | null,
): Promise<Operation | undefined> {
  const { rows } = await db.query(db.sql.settleUnderLease(id, fence, status, externalId, source, reason, result, reasonAtClaim));
  return rows[0];
}

/**
 * Why an object found by the operation id in its metadata (a Stripe webhook, Search) cannot be the
 * operation's, for what only the database knows: nothing of the operation was ever sent (its stamps are
 * taken before the first send, and undone only when it is proven nothing executed), or another operation
 * of its kind records the object as its own. Metadata is written by whoever can edit the object: a
 * dashboard user, a connected account. Null when neither.
 */
export async function foreignObject(db: Queryable, op: Operation, objectId: string, object: string): Promise<string | null> {
  if (isSettled(op.status) || op.external_id === objectId) return null;
  if (op.first_attempted_at === null && op.last_attempted_at === null) return `${objectId} names operation ${op.id}, which outboxd has not sent to Stripe`;
  return ownedElsewhere(db, op, objectId, object);
}

/** Why the object cannot be the operation's when another operation of its kind records it as its own
 * (a person's resolution asks this too); null when none does. */
export async function ownedElsewhere(db: Queryable, op: Operation, objectId: string, object: string): Promise<string | null> {
  const { rows } = await db.query(db.sql.externalIdOwner(objectId, op.kind, op.id));
  return rows[0] ? `${objectId} is operation ${rows[0].id}'s ${object}, not ${op.id}'s` : null;
}

/**
 * Settles from outside the executor (a person's resolution, a Stripe webhook): only an unsettled
 * operation, and with a fence bump so a worker still holding a claim writes nothing after it; its
 * settlement event in the same statement. Undefined when the operation was already settled (a
 * settled operation is never overwritten).
 */
export async function settleFromOutside(
  db: Queryable,
  id: string,
  status: 'succeeded' | 'failed',
  externalId: string | null,
  source: 'resolved_by_admin' | `webhook:${string}`,
  reason: string | null,
  /** What the kind keeps of the object that settled it (JSON; an authorization's hold), or null. */
  result: string | null = null,
): Promise<Operation | undefined> {
  const event: SettlementSource = source === 'resolved_by_admin' ? 'admin' : 'webhook';
  const { rows } = await db.query(db.sql.settleFromOutside(id, status, externalId, source, reason, event, result));
  return rows[0];
}

