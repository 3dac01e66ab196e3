ALTER TABLE "outboxd"."payment_operations" DROP CONSTRAINT "payment_operations_kind_check";--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ALTER COLUMN "customer_id" DROP NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ALTER COLUMN "payment_method" DROP NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."charge_outbox" ADD COLUMN "kind" text DEFAULT 'charge' NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "parent_operation_id" uuid;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "effect_key" text;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "payload" jsonb;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_parent_operation_id_payment_operations_id_fk" FOREIGN KEY ("parent_operation_id") REFERENCES "outboxd"."payment_operations"("id") ON DELETE no action ON UPDATE no action;--> statement-breakpoint
CREATE UNIQUE INDEX "payment_operations_refund_key_idx" ON "outboxd"."payment_operations" USING btree ("parent_operation_id","effect_key") WHERE "outboxd"."payment_operations"."kind" = 'refund';--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_charge_check" CHECK ("outboxd"."payment_operations"."kind" <> 'charge' or ("outboxd"."payment_operations"."customer_id" is not null and "outboxd"."payment_operations"."payment_method" is not null));--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_refund_check" CHECK ("outboxd"."payment_operations"."kind" <> 'refund' or ("outboxd"."payment_operations"."parent_operation_id" is not null and "outboxd"."payment_operations"."effect_key" is not null));--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_kind_check" CHECK ("outboxd"."payment_operations"."kind" in ('charge', 'refund'));