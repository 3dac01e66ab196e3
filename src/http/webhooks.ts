import Stripe from 'stripe';
import { receiveStripeEvent, type InboxDeps } from '../webhooks/inbox.ts';
import { readBody, sendJson, type Route } from './server.ts';

/** POST /webhooks/stripe, on when STRIPE_WEBHOOK_SECRET is set. The signature is checked on the raw body. */
export function webhookRoutes(deps: InboxDeps & { secret: string | undefined }): Route[] {
  const { secret } = deps;
  if (!secret) return [];
  return [
    [
      'POST',
      '/webhooks/stripe',
      async ({ req, res }) => {
        const raw = await readBody(req);
        let event: Stripe.Event;
        try {
          event = Stripe.webhooks.constructEvent(raw, String(req.headers['stripe-signature'] ?? ''), secret);
        } catch (err) {
          deps.log.warn({ err: (err as Error).message }, 'stripe webhook refused: bad signature');
          return sendJson(res, 400, { error: 'bad_signature', message: 'Stripe-Signature does not verify' });
        }
        const result = await receiveStripeEvent(deps, event);
        sendJson(res, 200, { received: true, result });
      },
    ],
  ];
}
