ALTER TABLE "outboxd"."charge_outbox" ADD COLUMN "traceparent" text;--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "traceparent" text;