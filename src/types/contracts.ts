// Contracts between the code and its SQL, as constants both sides read rather than comments that ask
// them to agree.

/** A kind's queue is named after the kind, so a worker takes only the kinds it carries out; its dead
 * letter is the kind's name with this suffix (src/outbox/outbox.ts: queueFor, deadQueueFor; the sweep's
 * undrivenCandidates in src/sql/reconcile.ts looks for live jobs under both names). */
export const DEAD_LETTER_SUFFIX = '_dead';

/** A review reason that begins so reports money Stripe shows that the operation does not account for (an
 * object carrying its id that is not its own, or one contradicting how it settled): a possible double
 * charge. It stays when the operation settles, which does not answer it, until a person resolves the
 * operation (unsettled) or acknowledges the reason (settled). */
export const DISCREPANCY_PREFIX = 'discrepancy with Stripe: ';
/** Past this many characters a discrepancy is not added to any more, but says so once (DISCREPANCY_MORE):
 * each is in the timeline. */
export const DISCREPANCY_MAX = 4000;
export const DISCREPANCY_MORE = ' | and more: see the timeline';
/** Between the discrepancies of one reason, and the reason the operation was held for before: a text no
 * reason's own holds (theirs have '; '). */
export const DISCREPANCY_SEPARATOR = ' | ';

/** Job states in which pg-boss will still hand the job to a worker (or has). */
export const LIVE_JOB_STATES: readonly string[] = ['created', 'retry', 'active'];

/**
 * A policy as a table of calls (src/engine/executor.ts: callTable), which a claim (src/sql/operations.ts:
 * claimAttempts) indexes by what the row holds at that instant: 1 + the sum of the weights of the facts
 * that hold (SQL arrays count from 1).
 */
export const CALL_FACT_WEIGHT = { externalIdKnown: 4, keyWindowPassed: 2, attemptedBefore: 1 } as const;

/** The table's index (from 0) for these facts. */
export const callTableIndex = (f: { externalIdKnown: boolean; keyWindowPassed: boolean; attemptedBefore: boolean }): number =>
  (f.externalIdKnown ? CALL_FACT_WEIGHT.externalIdKnown : 0) +
  (f.keyWindowPassed ? CALL_FACT_WEIGHT.keyWindowPassed : 0) +
  (f.attemptedBefore ? CALL_FACT_WEIGHT.attemptedBefore : 0);
