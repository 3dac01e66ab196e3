// The Stripe webhook inbox. An event is a hint, never evidence: the object it names is retrieved from
// Stripe (no transaction open) by the kind whose objects it names (a PaymentIntent for payment_intent.*,
// a Refund for refund.*: each kind's evidence, src/kinds/<kind>/evidence.ts), checked against the operation its
// metadata names by that kind's one rule, and the operation is settled from the RETRIEVED status only,
// through the same guarded write as any outside settlement:
// never over a settled status, and with a fence bump so a worker mid-call writes nothing after it. An
// event that only confirms a settled operation (its own object, which settles it as it is) changes
// nothing, so it is acknowledged without a retrieve: a webhook per settlement would otherwise spend a
// Stripe token each, as many as the creates. Each event is recorded by its id in the transaction that acts on it, so a redelivery (Stripe
// delivers at least once) is acknowledged, not reprocessed. Only ids, type, times and the
// PaymentIntent's (Refund's) id and status are stored (no payment-method or billing details), and only
// for the retention period.
import type Stripe from 'stripe';
import { inTransaction, type Pool, type Tx } from '../db/pool.ts';
import type { Logger } from '../telemetry/log.ts';
import { accountOf, unlessRejected, type PaymentGateway } from '../stripe/gateway.ts';
import { evidenceOf } from '../kinds/index.ts';
import type { KindEvidence, ProviderObject } from '../types/kind.ts';
import { flagDiscrepancy, foreignObject, isOperationId, isSettled, settleFromOutside, type Operation } from '../engine/operation.ts';
import { traceOperation, withSpan } from '../telemetry/tracing.ts';

export type InboxResult =
  | 'settled'
  | 'already_settled'
  | 'not_final'
  | 'ignored'
  | 'no_operation'
  /** The PaymentIntent (Refund) does not match the unsettled operation it names: flagged for review. */
  | 'mismatch'
  /** Stripe contradicts a settled operation (charged or refunded although failed, another object): for a person. */
  | 'contradiction'
  /** What Stripe did since to a settled operation's object is recorded: an authorization released (as an
   * operation of its own), a refund failed after it succeeded (on the operation, held for a person). */
  | 'recorded'
  | 'duplicate';

export interface InboxDeps {
  pool: Pool;
  gateway: PaymentGateway;
  log: Logger;
  /** Counts events whose PaymentIntent (Refund) does not match, or contradicts, the operation it names. */
  onMismatch?: (result: 'mismatch' | 'contradiction') => void;
}

class Duplicate extends Error {}

/** In a span of its own, linked to the trace of the operation it names. */
export function receiveStripeEvent(deps: InboxDeps, event: Stripe.Event): Promise<InboxResult> {
  const attributes = { 'stripe.event.id': event.id, 'stripe.event.type': event.type };
  return withSpan('outboxd.webhook', attributes, async (span) => {
    const result = await receive(deps, event);
    span.setAttribute('outboxd.webhook.result', result);
    return result;
  });
}

/** What Stripe says of the object an event names, retrieved, with the kind whose evidence it is. */
interface Evidence {
  kind: string;
  rules: KindEvidence<Tx>;
  object: ProviderObject;
}

/** `account`: the connected account the event came from (its `account`), null for the platform's. */
type Hint = { kind: string; rules: KindEvidence<Tx>; id: string; account: string | null };

/** The object an event is about, by the kind whose objects it names (payment_intent.* a PaymentIntent,
 * refund.* and charge.refund.updated a Refund); anything else is ignored. */
function hintOf(gateway: PaymentGateway, event: Stripe.Event): Hint | undefined {
  const id = (event.data.object as { id?: unknown }).id;
  if (typeof id !== 'string') return undefined;
  const found = evidenceOf(gateway).find(({ evidence }) => evidence.names(event.type, id));
  return found && { kind: found.kind, rules: found.evidence, id, account: event.account ?? null };
}

async function retrieve(hint: Hint): Promise<Evidence | undefined> {
  const object = await hint.rules.retrieve(hint.id, hint.account).catch(unlessRejected);
  return object && { kind: hint.kind, rules: hint.rules, object };
}

async function receive(deps: InboxDeps, event: Stripe.Event): Promise<InboxResult> {
  const { pool, log } = deps;
  const hint = hintOf(deps.gateway, event);
  if ((await pool.query(pool.sql.webhookEventSeen(event.id))).rows[0]) return 'duplicate';

  const signed = hint ? await signedOperation(pool, event) : undefined;
  // An event that only confirms a settled operation (most: the dispatcher settled it first) is acted on
  // without a retrieve, which would spend one of the fleet's Stripe tokens per settlement for nothing.
  const confirmed = hint && signed ? await confirmsSettled(pool, hint, event, signed) : undefined;
  // The evidence, fetched before any transaction opens (invariant 3). An object Stripe refuses to show
  // (another account's, say) is no evidence of anything; any other failure answers 5xx and Stripe
  // delivers the event again later. One whose signed metadata names no operation of ours is not
  // retrieved: every object outboxd makes names its operation from its creation, whose row committed
  // before; the application's other payments and a connected account's own would each spend a token
  // the dispatcher's charges wait on, for nothing.
  const evidence = confirmed ?? (hint && signed !== null ? await retrieve(hint) : undefined);
  const named = evidence?.object.operationId;
  const opId = named && isOperationId(named) ? named : null;
  const status = evidence?.object.status;
  try {
    return await inTransaction(pool, async (tx) => {
      const result = confirmed ? 'already_settled' : evidence ? await act(tx, evidence, opId, event.type) : hint ? 'no_operation' : 'ignored';
      const { rows } = await tx.query(tx.sql.insertWebhookEvent(event.id, event.type, opId, result, JSON.stringify(trimmed(event, evidence))));
      if (!rows[0]) throw new Duplicate(); // recorded by a concurrent delivery: undo whatever this one did
      log.info({ eventId: event.id, type: event.type, operationId: opId, [hint?.rules.record.log ?? 'object']: hint?.id, status, result }, 'stripe event received');
      if (result === 'mismatch' || result === 'contradiction') {
        deps.onMismatch?.(result);
        log.error({ eventId: event.id, operationId: opId, object: hint?.id, status, result },
          result === 'mismatch'
            ? `stripe event names a ${hint?.rules.naming.object} that does not match its operation: flagged for review`
            : 'stripe contradicts a settled operation: held for review');
      }
      return result;
    });
  } catch (err) {
    if (err instanceof Duplicate) return 'duplicate';
    throw err;
  }
}

/**
 * The operation the object names as Stripe signed it into the event (its metadata's operation_id); null
 * when the object shows its metadata and it names none of ours; undefined when it shows none (an event
 * that carries the object's id alone), and only a retrieve can tell.
 */
async function signedOperation(pool: Pool, event: Stripe.Event): Promise<Operation | null | undefined> {
  const { metadata } = event.data.object as { metadata?: { operation_id?: unknown } | null };
  if (metadata === undefined) return undefined;
  const named = metadata?.operation_id;
  if (typeof named !== 'string' || !isOperationId(named)) return null;
  return (await pool.query(pool.sql.showOperation(named.toLowerCase()))).rows[0] ?? null;
}

/**
 * The object as Stripe signed it into the event, when it names a settled operation whose own object it is
 * (same id, same account) and whose status it settles to: nothing to do, and nothing a retrieve could
 * change, since what Stripe does to the object later comes with events of its own (a refund failed after
 * it succeeded, an authorization released), whose status disagrees, and which are retrieved.
 */
async function confirmsSettled(pool: Pool, hint: Hint, event: Stripe.Event, op: Operation): Promise<Evidence | undefined> {
  const signed = event.data.object as { status?: unknown };
  if (typeof signed.status !== 'string') return undefined;
  if (!isSettled(op.status) || op.kind !== hint.kind || op.external_id !== hint.id || accountOf(op) !== hint.account) return undefined;
  if (await hint.rules.changed?.(pool, op, signed.status)) return undefined;
  const object = { id: hint.id, status: signed.status, operationId: op.id } as ProviderObject;
  return hint.rules.settles(op, object) === op.status ? { kind: hint.kind, rules: hint.rules, object } : undefined;
}

async function act(tx: Tx, evidence: Evidence, opId: string | null, type: string): Promise<InboxResult> {
  if (!opId) return 'no_operation';
  const { rows } = await tx.query(tx.sql.showOperation(opId));
  const op: Operation | undefined = rows[0];
  if (!op) return 'no_operation';
  traceOperation(op);
  const { object } = evidence;
  const mismatch = mismatchOf(op, evidence) ?? (evidence.rules.foundByMetadata ? await foreignObject(tx, op, object.id, evidence.rules.naming.object) : null);
  if (isSettled(op.status)) {
    // Never overwritten; but money the operation does not account for must reach a person: held for
    // review as it settled, until someone acknowledges it.
    const contradiction = mismatch ?? (op.status === 'failed' && evidence.rules.settles(op, object) === 'succeeded'
      ? `${object.id} is ${object.status}, the operation failed`
      : null);
    if (contradiction) {
      await flagDiscrepancy(tx, op.id, `webhook ${type}: ${contradiction}`);
      return 'contradiction';
    }
    return (await evidence.rules.followUp?.(tx, op, object, 'webhook')) ? 'recorded' : 'already_settled';
  }
  if (mismatch) {
    await flagDiscrepancy(tx, op.id, `webhook ${type}: ${mismatch}`);
    return 'mismatch';
  }
  const status = evidence.rules.settles(op, object);
  if (!status) return 'not_final';
  const reason = status === 'failed' ? `${type}: ${evidence.rules.naming.object} ${object.status}` : null;
  const kept = status === 'succeeded' ? (evidence.rules.resultOf?.(op, object) ?? null) : null;
  const settled = await settleFromOutside(tx, op.id, status, object.id, `webhook:${type}`, reason, kept);
  return settled ? 'settled' : 'already_settled';
}

/** The kind's own rule, after the one every kind shares: the object is of the operation's kind. */
function mismatchOf(op: Operation, evidence: Evidence): string | null {
  const { object } = evidence;
  if (op.kind !== evidence.kind) return `${object.id} names operation ${op.id}, which is a ${op.kind}, not a ${evidence.kind}`;
  return evidence.rules.mismatch(op, object);
}

/** What is kept of an event: ids, type, times, and the PaymentIntent's (Refund's) id and retrieved status. */
function trimmed(event: Stripe.Event, evidence: Evidence | undefined) {
  const object = evidence && { id: evidence.object.id, status: evidence.object.status };
  return {
    id: event.id,
    type: event.type,
    created: event.created,
    livemode: event.livemode,
    payment_intent: null,
    ...(evidence ? { [evidence.rules.record.event]: object } : {}),
  };
}
