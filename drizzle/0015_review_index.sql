-- The review index by created_at, not updated_at (which every claim changes, so no claim could be a HOT
-- update): rebuilt concurrently, outside a transaction, so that writes to payment_operations never wait for
-- it (src/db/migrate.ts); each statement may run again.
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."payment_operations_review_idx";--> statement-breakpoint
CREATE INDEX CONCURRENTLY "payment_operations_review_idx" ON "outboxd"."payment_operations" USING btree ("created_at","id") WHERE "outboxd"."payment_operations"."review_reason" is not null;
