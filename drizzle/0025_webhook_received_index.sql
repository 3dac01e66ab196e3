-- Stored webhook events by the time they arrived, for their retention (src/sql/retention.ts
-- pruneWebhookEvents): a batch of the oldest reads that batch, not the whole table. Built concurrently
-- outside a transaction (src/db/migrate.ts), so that no webhook waits for it; a failed build leaves an
-- invalid index, dropped when this runs again.
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."webhook_events_received_idx";--> statement-breakpoint
CREATE INDEX CONCURRENTLY "webhook_events_received_idx" ON "outboxd"."webhook_events" USING btree ("received_at");
