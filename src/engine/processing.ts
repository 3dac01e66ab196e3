// A payment that takes days (SEPA Debit, ACH: a PaymentIntent `processing`; a Refund `pending`) is
// waiting, not stuck (docs/architecture.md §2.4): the provider has it, and it settles by a webhook or by
// a retrieve on a slowing schedule. It is held for a person only once it has waited the review age.
import type { Operation, Outcome } from '../types/operation.ts';

/** How long a payment may stay `processing`, from the first time the provider said so, before a person
 * looks at it (PROCESSING_REVIEW_DAYS). SEPA Debit settles within about 5 business days, ACH within 4. */
export const PROCESSING_REVIEW_DAYS = 14;

/** The next check waits the longest of these steps that the payment has already waited: 1 min until it
 * has waited 5 min, then every 5 min until 30 min, every 30 min until 2 h, every 2 h until 6 h, every 6 h
 * until a day, then once a day (about 31 retrieves over 14 days). */
export const PROCESSING_CHECK_STEPS_SECONDS = [60, 300, 1_800, 7_200, 21_600, 86_400] as const;

/** Seconds until the next check of a payment that has waited `waitedSeconds`: never past the review age,
 * so that the check that holds it for a person comes on time. */
export function processingCheckDelaySeconds(waitedSeconds: number, reviewSeconds: number): number {
  const step = PROCESSING_CHECK_STEPS_SECONDS.findLast((s) => s <= waitedSeconds) ?? PROCESSING_CHECK_STEPS_SECONDS[0];
  return Math.max(1, Math.ceil(Math.min(step, reviewSeconds - waitedSeconds)));
}

/** A `processing` outcome as the executor records it: still waiting, with the delay of its next check,
 * or past the review age, held for a person (with the external id, so it is only ever retrieved). */
export function judgeProcessing(
  op: Pick<Operation, 'processing_since'>,
  outcome: Outcome & { kind: 'processing' },
  reviewDays: number,
  now = Date.now(),
): { outcome: Outcome; recheckSeconds: number | undefined } {
  const since = op.processing_since ?? new Date(now);
  const waitedSeconds = Math.max(0, (now - since.getTime()) / 1000);
  const reviewSeconds = reviewDays * 86_400;
  if (waitedSeconds < reviewSeconds) return { outcome, recheckSeconds: processingCheckDelaySeconds(waitedSeconds, reviewSeconds) };
  const reason =
    `${outcome.reason} since ${since.toISOString()}, over ${reviewDays} days (PROCESSING_REVIEW_DAYS): ` +
    `ask Stripe (or the customer's bank) about ${outcome.externalId}; a webhook still settles it, or resolve it with the evidence`;
  return { outcome: { kind: 'needs_review', externalId: outcome.externalId, reason, retry: false, requestId: outcome.requestId }, recheckSeconds: undefined };
}
