// A person acknowledges why a settled operation is held for review: money Stripe shows that the operation
// does not account for (a second PaymentIntent carrying its id, a charge that succeeded after it failed),
// dealt with in Stripe itself (refunded, say). Settling the operation does not answer such a reason, so it
// stays until acknowledged; nothing the operation settled to changes, and nothing is sent to Stripe.
import { inTransaction, type Pool } from '../db/pool.ts';
import { acknowledgeReview, isSettled, type Operation } from '../engine/operation.ts';
import { ValidationError } from '../types/errors.ts';
import { isStorableText } from '../types/input.ts';
import { recordAudit } from './audit.ts';
import { showOperation } from './operations.ts';
import { ResolutionRefused } from './resolve.ts';

export async function acknowledgeOperation(pool: Pool, id: string, note: string, actor: string): Promise<Operation> {
  if (!actor.trim()) throw new ValidationError('actor', 'who acknowledges must be named');
  if (!note.trim() || note.length > 1000) throw new ValidationError('note', 'say what was done about it (1 to 1000 characters)');
  for (const [field, text] of Object.entries({ actor, note })) {
    if (!isStorableText(text)) throw new ValidationError(field, 'must not contain U+0000 or half a surrogate pair');
  }
  const found = await showOperation(pool, id);
  return inTransaction(pool, async (tx) => {
    const acked = await acknowledgeReview(tx, found.id, actor, note);
    if (!acked) {
      const { status } = await showOperation(tx, found.id);
      throw new ResolutionRefused(
        !isSettled(status)
          ? `${found.id} is ${status}: an unsettled operation is resolved, with the evidence (ops resolve)`
          : `${found.id} is not held for review: nothing to acknowledge`,
      );
    }
    const { acknowledged_reason: reviewReason, ...op } = acked;
    await recordAudit(tx, { actor, action: 'acknowledge', operationId: op.id, details: { note, reviewReason, status: op.status } });
    return op;
  });
}
