ALTER TABLE "outboxd"."payment_operations" DROP CONSTRAINT "payment_operations_kind_check";--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ALTER COLUMN "order_id" DROP NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ALTER COLUMN "amount" DROP NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ALTER COLUMN "currency" DROP NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "policy" text DEFAULT 'idempotent-key' NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "result" jsonb;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "possible_duplicates" integer DEFAULT 0 NOT NULL;--> statement-breakpoint
CREATE UNIQUE INDEX "payment_operations_effect_key_idx" ON "outboxd"."payment_operations" USING btree ("kind","effect_key") WHERE "outboxd"."payment_operations"."kind" not in ('charge', 'refund');--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_policy_check" CHECK ("outboxd"."payment_operations"."policy" in ('idempotent-key', 'at-least-once', 'reconcile-before-retry'));--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_money_check" CHECK ("outboxd"."payment_operations"."kind" not in ('charge', 'refund') or ("outboxd"."payment_operations"."order_id" is not null and "outboxd"."payment_operations"."amount" is not null and "outboxd"."payment_operations"."currency" is not null));--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_effect_check" CHECK ("outboxd"."payment_operations"."kind" in ('charge', 'refund') or "outboxd"."payment_operations"."effect_key" is not null);--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_kind_check" CHECK ("outboxd"."payment_operations"."kind" ~ '^[a-z][a-z0-9_]{0,39}$');