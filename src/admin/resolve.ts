// A person settles an operation held for review, after checking Stripe. A resolution must never
// contradict Stripe, so it runs like a claim:
//   1. take the operation's lease (no worker can start a call meanwhile), refused while another claim's
//      lease is live, a row waits in the outbox, or a job for the operation is queued or active;
//   2. check the evidence against Stripe with the lease held (renewed while the checks run);
//   3. write the settlement fenced by that lease, with the audit entry, in one transaction.
// What counts as evidence is the kind's (src/kinds/<kind>/evidence.ts): --succeeded must name the kind's
// provider object (a PaymentIntent for a charge, a Refund for a refund) that matches the operation by the
// kind's one rule and has succeeded; --failed is refused while any object the provider shows for the
// operation is not definitively failed (for a charge also while Search may not show its last create yet).
// An effect of the application's own kind has no provider outboxd could ask: the person's word (any
// reference of theirs as the external id) is recorded as the evidence, after the same lease and refusals.
import { inTransaction, type Pool } from '../db/pool.ts';
import { DISCREPANCY_PREFIX } from '../types/contracts.ts';
import { ValidationError } from '../types/errors.ts';
import { isStorableText } from '../types/input.ts';
import { liveJobFor, queueFor } from '../outbox/outbox.ts';
import { AccessRevoked, accountOf, GatewayError, Rejected, type PaymentGateway } from '../stripe/gateway.ts';
import { kindsFor, namingOf } from '../kinds/index.ts';
import type { KindEvidence } from '../types/kind.ts';
import { claimOperation, isSettled, ownedElsewhere, releaseLease, renewLease, settleUnderLease, type Operation } from '../engine/operation.ts';
import { traceOperation, withSpan } from '../telemetry/tracing.ts';
import { recordAudit } from './audit.ts';
import { showOperation } from './operations.ts';

export type Resolution = { outcome: 'succeeded'; externalId: string } | { outcome: 'failed'; reason: string };

export interface ResolveOptions {
  leaseTtlMs: number;
  /** How long after the last create that may have executed a failed resolution waits for Search. */
  searchFreshnessSeconds: number;
  /** The review reason as the person read it (a console page, the API's reviewReason), if it was: a
   * resolution of an operation whose reason changed since (a discrepancy added) is refused, so that none is
   * answered unseen. Without it (the CLI), a discrepancy the operation holds stays after it settles. */
  reviewReasonSeen?: string | null;
}

/** Whether a review reason is the one a person read: line breaks compared as LF, as a browser's form sends
 * each of a hidden field's as CRLF (a lone CR too). */
export function sameReason(current: string | null, read: string | null): boolean {
  const lines = (text: string | null) => text?.replace(/\r\n?/g, '\n') ?? null;
  return lines(current) === lines(read);
}

/** Refused: the message says why, and when trying again can help. */
export class ResolutionRefused extends Error {
  override name = 'ResolutionRefused';
}

export function resolveOperation(
  pool: Pool,
  gateway: PaymentGateway,
  id: string,
  resolution: Resolution,
  actor: string,
  opts: ResolveOptions,
): Promise<Operation> {
  const attributes = { 'outboxd.resolution': resolution.outcome, 'outboxd.actor': actor };
  return withSpan('outboxd.resolve', attributes, () => resolve(pool, gateway, id, resolution, actor, opts));
}

async function resolve(
  pool: Pool,
  gateway: PaymentGateway,
  id: string,
  resolution: Resolution,
  actor: string,
  opts: ResolveOptions,
): Promise<Operation> {
  if (!actor.trim()) throw new ValidationError('actor', 'who resolves must be named');
  const given = { actor, ...(resolution.outcome === 'succeeded' ? { externalId: resolution.externalId } : { reason: resolution.reason }) };
  for (const [field, text] of Object.entries(given)) {
    if (!isStorableText(text)) throw new ValidationError(field, 'must not contain U+0000 or half a surrogate pair');
  }
  if (resolution.outcome === 'failed' && !resolution.reason.trim()) throw new ValidationError('reason', 'a failed resolution needs the reason');
  const found = await showOperation(pool, id);
  try {
    if (resolution.outcome === 'succeeded') {
      const expected = namingOf(found.kind)?.externalId;
      if (expected && !expected.pattern.test(resolution.externalId)) throw new ValidationError('externalId', `must be ${expected.what}`);
    }
    return await resolveFound(pool, gateway, found, resolution, actor, opts);
  } catch (err) {
    // Anything that stopped it once the operation was found is audited too: who tried to settle what, how,
    // and what Stripe, the workers or the check said.
    const tried = resolution.outcome === 'succeeded' ? { externalId: resolution.externalId } : { givenReason: resolution.reason };
    await recordAudit(pool, { actor, action: 'resolve_refused', operationId: found.id, details: { outcome: resolution.outcome, ...tried, refused: (err as Error).message } }).catch(() => {});
    throw err;
  }
}

async function resolveFound(
  pool: Pool,
  gateway: PaymentGateway,
  found: Operation,
  resolution: Resolution,
  actor: string,
  opts: ResolveOptions,
): Promise<Operation> {
  if (isSettled(found.status)) throw new ResolutionRefused(`operation ${found.id} is already ${found.status}; a settled operation is never overwritten`);

  // 1. The resolution's own claim.
  const lease = await claimOperation(pool, found.id, `resolve:${actor}`, opts.leaseTtlMs, 0);
  if (!lease) throw await notClaimable(pool, found.id);
  const { fence, operation: op } = lease;
  traceOperation(op, fence);
  const renewal = setInterval(() => void renewLease(pool, op.id, fence, opts.leaseTtlMs).catch(() => {}), Math.max(250, Math.floor(opts.leaseTtlMs / 3)));
  try {
    if (opts.reviewReasonSeen !== undefined && !sameReason(op.review_reason, opts.reviewReasonSeen)) {
      throw new ResolutionRefused(`the review reason changed since it was read: read it again: ${op.review_reason ?? 'none'}`);
    }
    await refuseWhileDriven(pool, op);

    // 2. The evidence, with no transaction open.
    const rules = kindsFor(gateway).get(op.kind)?.evidence;
    const { evidence, kept } = await (resolution.outcome === 'succeeded'
      ? evidenceOfSuccess(pool, rules, op, resolution.externalId)
      : evidenceOfFailure(pool, rules, op, resolution.reason, opts.searchFreshnessSeconds).then((evidence) => ({ evidence, kept: null }))
    ).catch(unlessStripeSaid);

    // 3. Settle under the lease, audited in the same transaction.
    return await inTransaction(pool, async (tx) => {
      const externalId = resolution.outcome === 'succeeded' ? resolution.externalId : null;
      const reason = resolution.outcome === 'failed' ? `resolved by ${actor}: ${resolution.reason}` : null;
      // A discrepancy is money the operation does not account for (a second charge): settling it answers
      // one only when the person read it (the console, the API's reviewReason); unread, it stays held for
      // review, to be acknowledged once dealt with in Stripe.
      const unread = opts.reviewReasonSeen === undefined && op.review_reason?.startsWith(DISCREPANCY_PREFIX);
      const settled = await settleUnderLease(tx, op.id, fence, resolution.outcome, externalId, 'resolved_by_admin', reason, kept, unread ? null : op.review_reason);
      if (!settled) throw new ResolutionRefused(`operation ${op.id} settled or was taken over while it was being resolved; look at it again`);
      await recordAudit(tx, {
        actor,
        action: 'resolve',
        operationId: op.id,
        details: { outcome: resolution.outcome, previousStatus: op.status, reviewReason: op.review_reason, evidence },
      });
      return settled;
    });
  } finally {
    clearInterval(renewal);
    await releaseLease(pool, op.id, fence).catch(() => {});
  }
}

async function notClaimable(pool: Pool, id: string): Promise<Error> {
  const now = await showOperation(pool, id);
  if (isSettled(now.status)) return new ResolutionRefused(`operation ${id} is already ${now.status}; a settled operation is never overwritten`);
  const until = now.lease_expires_at ? ` until ${now.lease_expires_at.toISOString()}` : '';
  return new ResolutionRefused(
    `operation ${id} is leased by ${now.lease_owner ?? 'another claim'}${until}: a call to Stripe may be in flight; try again after the lease ends`,
  );
}

/** A queued or active job (or a row still in the outbox) means the machine is still driving it. */
async function refuseWhileDriven(pool: Pool, op: Operation): Promise<void> {
  const { id } = op;
  const { rows } = await pool.query(pool.sql.outboxRowFor(id));
  if (rows[0]) throw new ResolutionRefused(`operation ${id} waits in the outbox to be sent; resolve it only once the workers have given up on it`);
  const job = await liveJobFor(pool, id, [queueFor(op.kind)]);
  if (job) {
    throw new ResolutionRefused(
      `job ${job.id} for operation ${id} is ${job.state}: the workers still drive it (same key); try again once it settles or is dead-lettered into review`,
    );
  }
}

const refuse = (message: string) => new ResolutionRefused(message);

/** Stripe's answer to the check, when it was no evidence (no such object, or no answer): a refusal that says
 * so, settling nothing, not a fault of outboxd's. */
function unlessStripeSaid(err: unknown): never {
  if (err instanceof Rejected) throw refuse(`Stripe refused to show it (${err.message}): check the id and the account`);
  if (err instanceof AccessRevoked) {
    throw refuse(`the connected account no longer lets the platform read it (${err.message}); nothing was settled: once it connects the platform again, requeue the operation (same key), or resolve it then`);
  }
  if (err instanceof GatewayError) throw refuse(`Stripe could not be asked (${err.name}: ${err.message}); nothing was settled: try again`);
  throw err;
}

/** The object must match the operation by its kind's one rule (src/kinds/<kind>/evidence.ts) and have
 * succeeded. An application's kind has no provider to ask: the person's word is the evidence. `kept`:
 * what the operation keeps of the object, as a settlement by its own calls would (an authorization's hold). */
async function evidenceOfSuccess(pool: Pool, rules: KindEvidence | undefined, op: Operation, externalId: string): Promise<{ evidence: Record<string, unknown>; kept: string | null }> {
  if (op.external_id && op.external_id !== externalId) {
    throw new ResolutionRefused(`operation ${op.id} is known to Stripe as ${op.external_id}, not ${externalId}; resolve it with its own ${op.kind}`);
  }
  if (!rules) return { evidence: { reference: externalId, checked: `nothing: outboxd cannot check an effect of kind ${op.kind}` }, kept: null };
  const object = await rules.retrieve(externalId, accountOf(op));
  // One object settles one operation, whatever its metadata was edited to name since.
  const mismatch = rules.mismatch(op, object, true) ?? (rules.foundByMetadata ? await ownedElsewhere(pool, op, object.id, rules.naming.object) : null);
  if (mismatch) throw new ResolutionRefused(`${mismatch}; it cannot settle this operation`);
  if (rules.settles(op, object) !== 'succeeded') throw new ResolutionRefused(`${object.id} is ${object.status}, not succeeded; try again when it has settled in Stripe`);
  return { evidence: { [op.kind]: object }, kept: rules.resultOf?.(op, object) ?? null };
}

async function evidenceOfFailure(
  pool: Pool,
  rules: KindEvidence | undefined,
  op: Operation,
  reason: string,
  horizonSeconds: number,
): Promise<Record<string, unknown>> {
  if (!rules) return { reason, checked: `nothing: outboxd cannot check an effect of kind ${op.kind}` };
  // What Stripe shows is not the last word while the last create that may have executed is recent, of
  // every kind: a request Stripe has not finished shows in no retrieve, list or search until it does (our
  // client giving up ends nothing there), and Search lags besides. Called failed meanwhile, a refund that
  // lands later would be paid again under the application's next request. Read before Stripe is asked:
  // what counts is how old the attempt was when Stripe showed what it showed.
  const age: number | null = (await pool.query(pool.sql.lastAttemptAge(op.id))).rows[0]?.age_seconds ?? null;
  if (age !== null && age < horizonSeconds) {
    throw refuse(
      `the last attempt to ${op.kind} was ${Math.floor(age)} s ago: Stripe may not show it yet (a request still running there, or Search's lag; horizon ${horizonSeconds} s, SEARCH_FRESHNESS_SECONDS); try again in ${Math.ceil(horizonSeconds - age)} s`,
    );
  }
  return { ...(await rules.noneSucceeded(op, reason, refuse)), lastAttemptAgeSeconds: age };
}
