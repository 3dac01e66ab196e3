import Stripe from 'stripe';
import { receiveStripeEvent, type InboxDeps } from '../webhooks/inbox.ts';
import type { Logger } from '../telemetry/log.ts';
import { HttpError, readBody, sendJson, type Route } from './server.ts';

/** Webhook requests one replica reads and handles at once. Anyone can send them, and each buffers up to
 * 1 MiB before its signature is checked (a few hundred at once would take a replica past its memory
 * limit), then takes the pool's connections, which the dispatcher needs. Past it: 503, and Stripe sends
 * the event again later. */
const MAX_IN_FLIGHT = 16;
/** Stripe sends an event's body at once: one still arriving after this is a trickle holding a place. */
const BODY_DEADLINE_MS = 10_000;
/** A replica says it refused webhooks at most this often. */
const BUSY_LOG_EVERY_MS = 60_000;

/** POST /webhooks/stripe, on when STRIPE_WEBHOOK_SECRET is set. The signature is checked on the raw body,
 * against each endpoint's secret in turn: Stripe signs a connected accounts' endpoint with a secret of its
 * own, apart from the platform's. */
export function webhookRoutes(
  deps: InboxDeps & { secrets: readonly string[]; maxInFlight?: number; bodyDeadlineMs?: number },
): Route[] {
  const { secrets, maxInFlight = MAX_IN_FLIGHT, bodyDeadlineMs = BODY_DEADLINE_MS } = deps;
  if (secrets.length === 0) return [];
  let inFlight = 0;
  let busySaidAt = -Infinity;
  return [
    [
      'POST',
      '/webhooks/stripe',
      async ({ req, res }) => {
        if (inFlight >= maxInFlight) {
          if (performance.now() - busySaidAt >= BUSY_LOG_EVERY_MS) {
            busySaidAt = performance.now();
            deps.log.warn({ maxInFlight }, 'stripe webhook refused (503): this replica handles as many already; Stripe sends it again');
          }
          throw new HttpError(503, 'busy', `${maxInFlight} webhook requests in progress here: send it again`, { retryAfterSeconds: 1 });
        }
        inFlight++;
        try {
          const raw = await readBody(req, undefined, bodyDeadlineMs);
          const event = verified(raw, String(req.headers['stripe-signature'] ?? ''), secrets, deps.log);
          if (!event) return sendJson(res, 400, { error: 'bad_signature', message: 'Stripe-Signature does not verify' });
          const result = await receiveStripeEvent(deps, event);
          sendJson(res, 200, { received: true, result });
        } finally {
          inFlight--;
        }
      },
    ],
  ];
}

/** The event, if its signature verifies with one of the secrets. */
function verified(raw: Buffer, signature: string, secrets: readonly string[], log: Logger): Stripe.Event | undefined {
  let refusal: unknown;
  for (const secret of secrets) {
    try {
      return Stripe.webhooks.constructEvent(raw, signature, secret);
    } catch (err) {
      refusal = err;
    }
  }
  log.warn({ err: (refusal as Error).message }, 'stripe webhook refused: bad signature');
  return undefined;
}
