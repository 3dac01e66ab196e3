-- At most one capture or cancel of a charge that has not failed, whatever the requests' transactions: the
-- backstop of src/kinds/hold/request.ts's decision. Built concurrently outside a transaction (a failed
-- build leaves an invalid index, dropped when this runs again); an application's own rows of a kind named
-- capture or cancel from before this release can fail it: rename that kind first (docs/runbook.md).
DROP INDEX CONCURRENTLY IF EXISTS "outboxd"."payment_operations_live_change_idx";--> statement-breakpoint
CREATE UNIQUE INDEX CONCURRENTLY "payment_operations_live_change_idx" ON "outboxd"."payment_operations" USING btree ("parent_operation_id") WHERE "outboxd"."payment_operations"."kind" in ('capture', 'cancel') and "outboxd"."payment_operations"."status" <> 'failed';
