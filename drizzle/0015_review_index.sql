-- The review index by created_at, not updated_at (which every claim changes, so no claim could be a HOT
-- update), built concurrently outside a transaction (src/db/migrate.ts) so that no write waits for it: the
-- new one first (a failed build leaves an invalid one, dropped when this runs again), then the old one.
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."payment_operations_review_created_idx";--> statement-breakpoint
CREATE INDEX CONCURRENTLY "payment_operations_review_created_idx" ON "outboxd"."payment_operations" USING btree ("created_at","id") WHERE "outboxd"."payment_operations"."review_reason" is not null;--> statement-breakpoint
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."payment_operations_review_idx";
