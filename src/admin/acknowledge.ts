// A person acknowledges why a settled operation is held for review: money Stripe shows that the operation
// does not account for (a second PaymentIntent carrying its id, a charge that succeeded after it failed),
// dealt with in Stripe itself (refunded, say). Settling the operation does not answer such a reason, so it
// stays until acknowledged; nothing the operation settled to changes, and nothing is sent to Stripe.
import { inTransaction, type Pool } from '../db/pool.ts';
import { acknowledgeReview, isSettled, type Operation } from '../engine/operation.ts';
import { ValidationError } from '../types/errors.ts';
import { isStorableText, UNSTORABLE } from '../types/input.ts';
import { recordAudit } from './audit.ts';
import { showOperation } from './operations.ts';
import { ResolutionRefused, sameReason } from './resolve.ts';

/**
 * Clears the review reason `reasonSeen`, the one the person read (a page, an API read); one added since
 * is refused, so that none is cleared unseen. Without it (the CLI, reading it just before), the reason as
 * it is now; the result's `acknowledgedReason` says which.
 */
export async function acknowledgeOperation(
  pool: Pool,
  id: string,
  note: string,
  actor: string,
  reasonSeen?: string,
): Promise<Operation & { acknowledgedReason: string }> {
  if (!actor.trim()) throw new ValidationError('actor', 'who acknowledges must be named');
  if (!note.trim() || note.length > 1000) throw new ValidationError('note', 'say what was done about it (1 to 1000 characters)');
  for (const [field, text] of Object.entries({ actor, note })) {
    if (!isStorableText(text)) throw new ValidationError(field, UNSTORABLE);
  }
  const found = await showOperation(pool, id);
  // The reason as it is now, if it is the one read: the statement clears it only while it still is.
  const current = reasonSeen === undefined || sameReason(found.review_reason, reasonSeen) ? found.review_reason : null;
  const acknowledged = inTransaction(pool, async (tx) => {
    const acked = current === null ? undefined : await acknowledgeReview(tx, found.id, actor, note, current);
    if (!acked) {
      const now = await showOperation(tx, found.id);
      throw new ResolutionRefused(
        !isSettled(now.status)
          ? `${found.id} is ${now.status}: an unsettled operation is resolved, with the evidence (ops resolve)`
          : now.review_reason === null
            ? `${found.id} is not held for review: nothing to acknowledge`
            : `the review reason changed since it was read: read it again: ${now.review_reason}`,
      );
    }
    const { acknowledged_reason: acknowledgedReason, ...op } = acked;
    await recordAudit(tx, { actor, action: 'acknowledge', operationId: op.id, details: { note, reviewReason: acknowledgedReason, status: op.status } });
    return { ...op, acknowledgedReason };
  });
  // A refusal is on the record too: who tried to clear what, and why it stood.
  return acknowledged.catch(async (err: unknown) => {
    if (err instanceof ResolutionRefused) {
      await recordAudit(pool, { actor, action: 'acknowledge_refused', operationId: found.id, details: { note, refused: err.message } }).catch(() => {});
    }
    throw err;
  });
}
