// A person settles an operation held for review, after checking Stripe. A resolution must never
// contradict Stripe, so it runs like a claim:
//   1. take the operation's lease (no worker can start a call meanwhile), refused while another claim's
//      lease is live, a row waits in the outbox, or a job for the operation is queued or active;
//   2. check the evidence against Stripe with the lease held (renewed while the checks run);
//   3. write the settlement fenced by that lease, with the audit entry, in one transaction.
// --succeeded must name a PaymentIntent (a Refund, for a refund) that carries this operation's id, amount
// and currency and has succeeded. --failed is refused while any charge (refund) Stripe shows for the
// operation is not definitively failed, and while the known one is anything but failed; for a charge
// also while the last create that may have executed is younger than the search-freshness horizon
// (Search is not read-after-write; a PaymentIntent's list of refunds is). An effect of the application's
// own kind has no provider outboxd could ask: the person's word (any reference of theirs as the external
// id) is recorded as the evidence, after the same lease and refusals.
import type { PgBoss } from 'pg-boss';
import { bossDb, inTransaction, type Pool } from '../db/pool.ts';
import { isStorableText, ValidationError } from '../orders/validate.ts';
import { liveJobFor, queueFor } from '../outbox.ts';
import { FAILED_CHARGE_STATUSES, FAILED_REFUND_STATUSES, type PaymentGateway } from '../payments/gateway.ts';
import { refundMismatch, type RefundPayload } from '../payments/refund.ts';
import { claimOperation, isSettled, releaseLease, renewLease, settleUnderLease, type Operation } from '../payments/operation.ts';
import { traceOperation, withSpan } from '../tracing.ts';
import { recordAudit } from './audit.ts';
import { showOperation } from './operations.ts';

export type Resolution = { outcome: 'succeeded'; externalId: string } | { outcome: 'failed'; reason: string };

export interface ResolveOptions {
  leaseTtlMs: number;
  /** How long after the last create that may have executed a failed resolution waits for Search. */
  searchFreshnessSeconds: number;
}

/** Refused: the message says why, and when trying again can help. */
export class ResolutionRefused extends Error {
  override name = 'ResolutionRefused';
}

export function resolveOperation(
  pool: Pool,
  gateway: PaymentGateway,
  boss: PgBoss,
  id: string,
  resolution: Resolution,
  actor: string,
  opts: ResolveOptions,
): Promise<Operation> {
  const attributes = { 'outboxd.resolution': resolution.outcome, 'outboxd.actor': actor };
  return withSpan('outboxd.resolve', attributes, () => resolve(pool, gateway, boss, id, resolution, actor, opts));
}

async function resolve(
  pool: Pool,
  gateway: PaymentGateway,
  boss: PgBoss,
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
  if (resolution.outcome === 'succeeded') {
    const expected = EXTERNAL_ID[found.kind];
    if (expected && !expected.pattern.test(resolution.externalId)) throw new ValidationError('externalId', `must be ${expected.what}`);
  }
  if (isSettled(found.status)) throw new ResolutionRefused(`operation ${found.id} is already ${found.status}; a settled operation is never overwritten`);

  // 1. The resolution's own claim.
  const lease = await claimOperation(pool, found.id, `resolve:${actor}`, opts.leaseTtlMs, 0);
  if (!lease) throw await notClaimable(pool, found.id);
  const { fence, operation: op } = lease;
  traceOperation(op, fence);
  const renewal = setInterval(() => void renewLease(pool, op.id, fence, opts.leaseTtlMs).catch(() => {}), Math.max(250, Math.floor(opts.leaseTtlMs / 3)));
  try {
    await refuseWhileDriven(pool, boss, op);

    // 2. The evidence, with no transaction open.
    const evidence = resolution.outcome === 'succeeded'
      ? await evidenceOfSuccess(gateway, op, resolution.externalId)
      : await evidenceOfFailure(pool, gateway, op, resolution.reason, opts.searchFreshnessSeconds);

    // 3. Settle under the lease, audited in the same transaction.
    return await inTransaction(pool, async (tx) => {
      const externalId = resolution.outcome === 'succeeded' ? resolution.externalId : null;
      const reason = resolution.outcome === 'failed' ? `resolved by ${actor}: ${resolution.reason}` : null;
      const settled = await settleUnderLease(tx, op.id, fence, resolution.outcome, externalId, 'resolved_by_admin', reason);
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
async function refuseWhileDriven(pool: Pool, boss: PgBoss, op: Operation): Promise<void> {
  const { id } = op;
  const { rows } = await pool.query(pool.sql.outboxRowFor(id));
  if (rows[0]) throw new ResolutionRefused(`operation ${id} waits in the outbox to be sent; resolve it only once the workers have given up on it`);
  const job = await liveJobFor(boss, bossDb(pool), id, queueFor(op.kind));
  if (job) {
    throw new ResolutionRefused(
      `job ${job.id} for operation ${id} is ${job.state}: the workers still drive it (same key); try again once it settles or is dead-lettered into review`,
    );
  }
}

/** What names the effect at Stripe, per kind; an application's kind names any reference of its own. */
export const EXTERNAL_ID: Record<string, { pattern: RegExp; what: string }> = {
  charge: { pattern: /^pi_\w+$/, what: 'a PaymentIntent id (pi_…)' },
  refund: { pattern: /^re_\w+$/, what: 'a Refund id (re_…)' },
};

async function evidenceOfSuccess(gateway: PaymentGateway, op: Operation, externalId: string): Promise<Record<string, unknown>> {
  if (op.external_id && op.external_id !== externalId) {
    throw new ResolutionRefused(`operation ${op.id} is known to Stripe as ${op.external_id}, not ${externalId}; resolve it with its own ${op.kind}`);
  }
  if (op.kind === 'refund') {
    const refund = await gateway.retrieveRefund(externalId);
    const mismatch = refundMismatch(op, refund);
    if (mismatch) throw new ResolutionRefused(`${mismatch}; it cannot settle this operation`);
    if (refund.status !== 'succeeded') throw new ResolutionRefused(`${refund.id} is ${refund.status}, not succeeded; try again when it has settled in Stripe`);
    return { refund };
  }
  if (op.kind === 'charge') return evidenceOfCharge(gateway, op, externalId);
  return { reference: externalId, checked: `nothing: outboxd cannot check an effect of kind ${op.kind}` };
}

async function evidenceOfCharge(gateway: PaymentGateway, op: Operation, externalId: string): Promise<Record<string, unknown>> {
  const charge = await gateway.retrieveCharge(externalId);
  if (charge.operationId !== op.id) throw new ResolutionRefused(`${charge.id} belongs to operation ${charge.operationId ?? '(none)'}, not ${op.id}`);
  if (charge.amount !== op.amount || charge.currency !== op.currency) {
    throw new ResolutionRefused(`${charge.id} is ${charge.amount} ${charge.currency}; the operation is ${op.amount} ${op.currency}`);
  }
  if (charge.status !== 'succeeded') throw new ResolutionRefused(`${charge.id} is ${charge.status}, not succeeded; try again when it has settled in Stripe`);
  return { charge };
}

async function evidenceOfFailure(
  pool: Pool,
  gateway: PaymentGateway,
  op: Operation,
  reason: string,
  horizonSeconds: number,
): Promise<Record<string, unknown>> {
  if (op.kind === 'refund') return evidenceOfNoRefund(gateway, op, reason);
  if (op.kind !== 'charge') return { reason, checked: `nothing: outboxd cannot check an effect of kind ${op.kind}` };
  const { rows } = await pool.query(pool.sql.lastAttemptAge(op.id));
  const age: number | null = rows[0]?.age_seconds ?? null;
  if (age !== null && age < horizonSeconds) {
    const wait = Math.ceil(horizonSeconds - age);
    throw new ResolutionRefused(
      `the last attempt to charge was ${Math.floor(age)} s ago: Stripe's search may not show its charge yet (freshness horizon ${horizonSeconds} s); try again in ${wait} s`,
    );
  }
  let known;
  if (op.external_id) {
    known = await gateway.retrieveCharge(op.external_id);
    if (!FAILED_CHARGE_STATUSES.has(known.status)) {
      throw new ResolutionRefused(`${known.id} is ${known.status}, not failed: ${known.status === 'succeeded' ? 'the customer was charged' : 'it may still charge; try again when it is final in Stripe'}`);
    }
  }
  const charges = await gateway.findCharges(op.id);
  const live = charges.filter((c) => !FAILED_CHARGE_STATUSES.has(c.status));
  if (live.length > 0) {
    throw new ResolutionRefused(`Stripe shows charges for this operation that have not failed: ${live.map((c) => `${c.id} (${c.status})`).join(', ')}`);
  }
  return { reason, knownCharge: known ?? null, searchedCharges: charges.map((c) => ({ id: c.id, status: c.status })), lastAttemptAgeSeconds: age };
}

/** No refund of the operation's that has not failed: the known one, and every one the PaymentIntent's
 * list shows for the operation (a list is read-after-write: no freshness horizon to wait out). */
async function evidenceOfNoRefund(gateway: PaymentGateway, op: Operation, reason: string): Promise<Record<string, unknown>> {
  let known;
  if (op.external_id) {
    known = await gateway.retrieveRefund(op.external_id);
    if (!FAILED_REFUND_STATUSES.has(known.status)) {
      throw new ResolutionRefused(`${known.id} is ${known.status}, not failed: ${known.status === 'succeeded' ? 'the money went back' : 'it may still succeed; try again when it is final in Stripe'}`);
    }
  }
  const refunds = (await gateway.findRefunds((op.payload as RefundPayload).payment_intent)).filter((r) => r.operationId === op.id);
  const live = refunds.filter((r) => !FAILED_REFUND_STATUSES.has(r.status));
  if (live.length > 0) {
    throw new ResolutionRefused(`Stripe shows refunds for this operation that have not failed: ${live.map((r) => `${r.id} (${r.status})`).join(', ')}`);
  }
  return { reason, knownRefund: known ?? null, listedRefunds: refunds.map((r) => ({ id: r.id, status: r.status })) };
}
