import Stripe from 'stripe';
import { receiveStripeEvent, type InboxDeps } from '../webhooks/inbox.ts';
import type { Logger } from '../telemetry/log.ts';
import { readBody, sendJson, type Route } from './server.ts';

/** POST /webhooks/stripe, on when STRIPE_WEBHOOK_SECRET is set. The signature is checked on the raw body,
 * against each endpoint's secret in turn: Stripe signs a connected accounts' endpoint with a secret of its
 * own, apart from the platform's. */
export function webhookRoutes(deps: InboxDeps & { secrets: readonly string[] }): Route[] {
  const { secrets } = deps;
  if (secrets.length === 0) return [];
  return [
    [
      'POST',
      '/webhooks/stripe',
      async ({ req, res }) => {
        const raw = await readBody(req);
        const event = verified(raw, String(req.headers['stripe-signature'] ?? ''), secrets, deps.log);
        if (!event) return sendJson(res, 400, { error: 'bad_signature', message: 'Stripe-Signature does not verify' });
        const result = await receiveStripeEvent(deps, event);
        sendJson(res, 200, { received: true, result });
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
