-- The outboxes' rows are written by the statement that writes (or settles) their operation: the foreign
-- keys' checks only locked the operation's row again (a WAL record per row). Taken under migrate's short
-- lock_timeout; replicas of the release before do not rely on them.
ALTER TABLE "outboxd"."charge_outbox" DROP CONSTRAINT IF EXISTS "charge_outbox_operation_id_payment_operations_id_fk";
--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" DROP CONSTRAINT IF EXISTS "settlement_outbox_operation_id_payment_operations_id_fk";
