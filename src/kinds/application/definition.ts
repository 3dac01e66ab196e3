// Effects the application defines (outboxd.defineEffect): a receipt, a reservation in another system,
// anything that cannot be made exactly once. The application says which failure it tolerates when an
// execution ends with nobody knowing whether it acted (its policy), and how to tell afterwards:
//   at-least-once            execute again; the possible duplicate is counted (possible_duplicates,
//                            outboxd_effect_possible_duplicates_total)
//   reconcile-before-retry   check first: done (settle with what it found), not done (execute again),
//                            unknown (a person decides)
// execute returns a result to record, or throws EffectFailed when the effect definitively did not and
// will not happen; anything else (a timeout, a crash, any other error) is ambiguous.
import { DEAD_LETTER_SUFFIX } from '../../types/contracts.ts';
import { textOf } from '../../types/input.ts';
import type { CallContext, EffectCalls, Kind } from '../../types/kind.ts';
import type { Operation, Outcome } from '../../types/operation.ts';

/** Thrown by an effect's execute (or check): it definitively did not happen and must not be retried. */
export class EffectFailed extends Error {
  override name = 'EffectFailed';
}


/** What execute and check receive. */
export interface EffectContext {
  operationId: string;
  /** The key it was requested under (unique per kind). */
  key: string;
  /** The payload it was requested with (JSON). */
  payload: unknown;
  /** This call's number among the operation's calls (1 for the first). */
  attempt: number;
  /** Aborted when this worker loses the operation's lease, shuts down past its grace period, or the
   * definition's timeoutMs has passed: stop, what it returns from then on is not recorded. */
  signal: AbortSignal;
}

/** What a check found about an earlier execution that may have acted. */
export type CheckResult =
  /** It happened: the operation succeeds with this result. */
  | { status: 'done'; result?: unknown }
  /** It did not happen: it is executed again. */
  | { status: 'not_done' }
  /** Nobody can tell: a person decides (the operation is held for review). */
  | { status: 'unknown'; reason?: string };

export type ApplicationPolicy = 'at-least-once' | 'reconcile-before-retry';

export interface EffectDefinition {
  policy: ApplicationPolicy;
  execute(ctx: EffectContext): unknown;
  /** Required for reconcile-before-retry, and only used by it. */
  check?(ctx: EffectContext): CheckResult | Promise<CheckResult>;
  /** The longest one execute or check may take (default 60 s, at most 10 min). Past it the call's signal
   * aborts and the call is given up, returned or not, so that it never holds its worker's slot: an
   * execute is then ambiguous (at-least-once: executed again; reconcile-before-retry: its lease is kept
   * until it returns, as it may still act, and then checked), a check is asked again. */
  timeoutMs?: number;
}

/** An effect's timeoutMs unless it says otherwise: River's default job timeout. */
const DEFAULT_EFFECT_TIMEOUT_MS = 60_000;
/** Below pg-boss's expiry of a job in hand (15 min, src/outbox/outbox.ts): a handler that outlives it
 * stops its fetch loop until it returns. An effect that takes longer is two: one that starts it, one that
 * checks it has finished. */
const MAX_EFFECT_TIMEOUT_MS = 600_000;

/** The application's kinds this process defines (outboxd.defineEffect, `outboxd worker --effects`). */
export type EffectDefinitions = ReadonlyMap<string, EffectDefinition>;

/** An application's kind, registered as the built-in ones are; no provider outboxd could ask, so no
 * evidence: a person's resolution records their word. */
export function applicationKind(kind: string, def: EffectDefinition): Kind {
  return { kind, policy: def.policy, calls: applicationCalls(def), callTimeoutMs: def.timeoutMs ?? DEFAULT_EFFECT_TIMEOUT_MS };
}
const KIND_NAME = /^[a-z][a-z0-9_]{0,39}$/;

/** Checks a definition before it is kept: refused with a TypeError that says what is wrong. */
export function validDefinition(kind: unknown, def: unknown, reserved: ReadonlySet<string>): EffectDefinition {
  if (typeof kind !== 'string' || !KIND_NAME.test(kind)) {
    throw new TypeError(`an effect kind is a lower-case identifier of at most 40 characters (a-z, 0-9, _): ${JSON.stringify(kind)}`);
  }
  if (reserved.has(kind) || kind.endsWith(DEAD_LETTER_SUFFIX)) throw new TypeError(`the effect kind ${kind} is reserved by outboxd`);
  const d = def as Partial<EffectDefinition> | null;
  if (d === null || typeof d !== 'object') throw new TypeError(`effect ${kind}: a definition is { policy, execute, check? }`);
  if (d.policy !== 'at-least-once' && d.policy !== 'reconcile-before-retry') {
    throw new TypeError(`effect ${kind}: policy must be at-least-once or reconcile-before-retry (idempotent-key is Stripe's, for the built-in kinds)`);
  }
  if (typeof d.execute !== 'function') throw new TypeError(`effect ${kind}: execute must be a function`);
  if (d.policy === 'reconcile-before-retry' && typeof d.check !== 'function') {
    throw new TypeError(`effect ${kind}: reconcile-before-retry needs check, which establishes whether an earlier execution happened`);
  }
  if (d.policy === 'at-least-once' && d.check !== undefined) {
    throw new TypeError(`effect ${kind}: at-least-once never checks; give check only with reconcile-before-retry`);
  }
  if (d.timeoutMs !== undefined && !(Number.isSafeInteger(d.timeoutMs) && d.timeoutMs >= 1 && d.timeoutMs <= MAX_EFFECT_TIMEOUT_MS)) {
    throw new TypeError(`effect ${kind}: timeoutMs must be an integer of milliseconds from 1 to ${MAX_EFFECT_TIMEOUT_MS}: ${JSON.stringify(d.timeoutMs)}`);
  }
  return d as EffectDefinition;
}

/** The calls of an application's kind: create executes it, check asks whether an earlier one acted. */
export function applicationCalls(def: EffectDefinition): EffectCalls {
  return {
    create: async (op, ctx) => ({ kind: 'succeeded', externalId: null, result: asJson(await def.execute(contextOf(op, ctx))) }),
    check: async (op, ctx) => fromCheck(op, await def.check!(contextOf(op, ctx))),
  };
}

function contextOf(op: Operation, ctx: CallContext): EffectContext {
  return { operationId: op.id, key: op.effect_key!, payload: op.payload, attempt: ctx.attempt, signal: ctx.signal };
}

function fromCheck(op: Operation, found: CheckResult): Outcome {
  switch (found?.status) {
    case 'done':
      return { kind: 'succeeded', externalId: null, result: asJson(found.result) };
    case 'not_done':
      return { kind: 'not_done', reason: 'check: the earlier execution did not happen' };
    case 'unknown':
      return { kind: 'needs_review', externalId: null, retry: false, reason: `check could not tell whether ${op.kind} ${op.id} happened${found.reason ? `: ${found.reason}` : ''}` };
    default:
      // Not an answer: as good as a check that failed; it is asked again.
      return { kind: 'ambiguous', externalId: null, reason: `check returned ${asJson(found)}, not { status: 'done' | 'not_done' | 'unknown' }` };
  }
}

/** A result is kept in the operation row and sent in its settlement event, as a payload is: a record of
 * what happened (an id, a status), not a document. */
const MAX_RESULT_BYTES = 64 * 1024;

/** The result as stored: JSON, null when it has none, or, when JSON cannot hold it (a cycle, a BigInt) or
 * it is larger than MAX_RESULT_BYTES, what stood in its way, so that it is not taken for none. The effect
 * happened all the same: refusing its result would run it again. */
function asJson(value: unknown): string {
  let json: string;
  try {
    json = JSON.stringify(value ?? null) ?? 'null';
  } catch (err) {
    return JSON.stringify({ unserializable: textOf(err) });
  }
  const bytes = Buffer.byteLength(json);
  return bytes > MAX_RESULT_BYTES ? JSON.stringify({ unstored: `a result of ${bytes} bytes of JSON, more than the ${MAX_RESULT_BYTES} kept` }) : json;
}
