-- Held authorizations by their expiry, for the reconcile sweep (src/sql/hold.ts overdueAuthorizations).
-- Built concurrently outside a transaction (src/db/migrate.ts), so that no write waits for it; a failed
-- build leaves an invalid index, dropped when this runs again.
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."payment_operations_hold_expiry_idx";--> statement-breakpoint
CREATE INDEX CONCURRENTLY "payment_operations_hold_expiry_idx" ON "outboxd"."payment_operations" USING btree (("result"->>'capture_before')) WHERE "outboxd"."payment_operations"."kind" = 'charge' and "outboxd"."payment_operations"."status" = 'succeeded' and "outboxd"."payment_operations"."payload"->>'capture_method' = 'manual';
