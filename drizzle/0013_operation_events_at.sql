-- operation_events may be large and is written on the hot path: built without blocking its inserts (src/db/migrate.ts
-- applies a migration with `concurrently` outside the transaction, each statement on its own, and may run it again).
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."operation_events_at_idx";--> statement-breakpoint
CREATE INDEX CONCURRENTLY "operation_events_at_idx" ON "outboxd"."operation_events" USING brin ("at");
