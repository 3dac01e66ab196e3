-- Transactional subscribers' consumptions by the time they were made, for their retention
-- (src/sql/retention.ts pruneSettlementConsumption): a batch of the oldest reads that batch, not the
-- whole table. Built concurrently outside a transaction (src/db/migrate.ts), so that no delivery waits
-- for it; a failed build leaves an invalid index, dropped when this runs again.
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."settlement_consumption_consumed_idx";--> statement-breakpoint
CREATE INDEX CONCURRENTLY "settlement_consumption_consumed_idx" ON "outboxd"."settlement_consumption" USING btree ("consumed_at");
