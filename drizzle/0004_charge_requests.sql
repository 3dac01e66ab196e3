ALTER TABLE "outboxd"."payment_operations" DROP CONSTRAINT "payment_operations_order_id_kind_key";--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" DROP CONSTRAINT "payment_operations_order_id_orders_id_fk";
--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "metadata" jsonb DEFAULT '{}'::jsonb NOT NULL;--> statement-breakpoint
CREATE INDEX "payment_operations_order_idx" ON "outboxd"."payment_operations" USING btree ("order_id","kind");--> statement-breakpoint
CREATE UNIQUE INDEX "payment_operations_live_charge_idx" ON "outboxd"."payment_operations" USING btree ("order_id") WHERE "outboxd"."payment_operations"."kind" = 'charge' and "outboxd"."payment_operations"."status" <> 'failed';