import Stripe from 'stripe';
import { receiveStripeEvent, type InboxDeps } from '../webhooks/inbox.ts';
import type { Logger } from '../telemetry/log.ts';
import { HttpError, readBody, sendJson, type Route } from './server.ts';

/** Bytes of webhook bodies one replica holds while reading them, before their signatures are checked:
 * anyone can send them, each up to 1 MiB, and a few hundred held at once would take a replica past its
 * memory limit. A request that would go past it is answered 503, and Stripe delivers the event again
 * later. What a body holds is its buffer (readBody: at most twice its bytes, however it is chunked), so
 * holding it full takes a sender at least this much every BODY_DEADLINE_MS. */
const MAX_UNVERIFIED_BYTES = 32 << 20;
/** Stripe sends an event's body at once: one still arriving after this is a trickle holding bytes. */
const BODY_DEADLINE_MS = 5_000;
/** Signed events one replica handles at once: each takes the pool's connections, which the dispatcher
 * needs, and may retrieve from Stripe. Beyond: 503, and Stripe delivers it again later. */
const MAX_HANDLING = 16;
/** A replica says it refused webhooks at most this often, with how many since: anyone can send requests
 * to be refused, and a line for each made the replica write more than it was sent (a forged signature's
 * line, ~600 B), buffered in memory while its log does not drain. */
const REFUSED_LOG_EVERY_MS = 60_000;

/** POST /webhooks/stripe, on when STRIPE_WEBHOOK_SECRET is set. The signature is checked on the raw body,
 * against each endpoint's secret in turn: Stripe signs a connected accounts' endpoint with a secret of its
 * own, apart from the platform's. */
export function webhookRoutes(
  deps: InboxDeps & {
    secrets: readonly string[];
    maxUnverifiedBytes?: number;
    maxHandling?: number;
    bodyDeadlineMs?: number;
    /** Counts a request refused before its event was read: its signature, or the replica busy. */
    onRefused?: (reason: 'bad_signature' | 'busy') => void;
  },
): Route[] {
  const { secrets, maxUnverifiedBytes = MAX_UNVERIFIED_BYTES, maxHandling = MAX_HANDLING, bodyDeadlineMs = BODY_DEADLINE_MS } = deps;
  if (secrets.length === 0) return [];
  let unverifiedBytes = 0;
  let handling = 0;
  const sayBusy = refusalLog(deps.log);
  const sayForged = refusalLog(deps.log);
  const busy = (what: string) => {
    deps.onRefused?.('busy');
    sayBusy({ maxUnverifiedBytes, maxHandling }, `stripe webhook refused (503): ${what}; Stripe sends it again`);
    return new HttpError(503, 'busy', `${what} here: send it again`, { retryAfterSeconds: 1 });
  };
  return [
    [
      'POST',
      '/webhooks/stripe',
      async ({ req, res }) => {
        let held = 0;
        let raw: Buffer;
        try {
          raw = await readBody(req, undefined, {
            deadlineMs: bodyDeadlineMs,
            hold: (bytes) => {
              if (unverifiedBytes + bytes > maxUnverifiedBytes) return busy('too many webhook bodies being read');
              unverifiedBytes += bytes;
              held += bytes;
              return undefined;
            },
          });
        } finally {
          unverifiedBytes -= held;
        }
        const event = verified(raw, String(req.headers['stripe-signature'] ?? ''), secrets);
        if (event instanceof Error) {
          deps.onRefused?.('bad_signature');
          sayForged({ err: event.message }, 'stripe webhook refused: bad signature (a wrong STRIPE_WEBHOOK_SECRET, or not from Stripe)');
          return sendJson(res, 400, { error: 'bad_signature', message: 'Stripe-Signature does not verify' });
        }
        if (handling >= maxHandling) throw busy(`${maxHandling} webhook events in progress`);
        handling++;
        try {
          const result = await receiveStripeEvent(deps, event);
          sendJson(res, 200, { received: true, result });
        } finally {
          handling--;
        }
      },
    ],
  ];
}

/** The event, if its signature verifies with one of the secrets; otherwise why not. */
function verified(raw: Buffer, signature: string, secrets: readonly string[]): Stripe.Event | Error {
  let refusal: unknown;
  for (const secret of secrets) {
    try {
      return Stripe.webhooks.constructEvent(raw, signature, secret);
    } catch (err) {
      refusal = err;
    }
  }
  return refusal as Error;
}

/** A warning of refusals, written at most every REFUSED_LOG_EVERY_MS, with how many there were since
 * the last one written. */
function refusalLog(log: Logger): (fields: Record<string, unknown>, message: string) => void {
  let saidAt = -Infinity;
  let unsaid = 0;
  return (fields, message) => {
    unsaid++;
    if (performance.now() - saidAt < REFUSED_LOG_EVERY_MS) return;
    saidAt = performance.now();
    log.warn({ ...fields, refused: unsaid }, message);
    unsaid = 0;
  };
}
