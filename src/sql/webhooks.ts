// The statements of the Stripe webhook inbox (src/webhooks/inbox.ts): events recorded by id, for deduplication and evidence.
import type { SqlContext } from './context.ts';

export const webhooksStatements = ({ s, statement }: SqlContext) => ({
  insertWebhookEvent: statement<[id: string, type: string, operationId: string | null, result: string, payload: string]>(
    'outboxd_insert_webhook_event',
    `insert into ${s}.webhook_events (id, type, operation_id, result, payload) values ($1, $2, $3, $4, $5::jsonb)
     on conflict (id) do nothing
     returning id`,
  ),

  webhookEventSeen: statement<[id: string]>(
    'outboxd_webhook_event_seen',
    `select 1 as seen from ${s}.webhook_events where id = $1`,
  ),
});
