CREATE TABLE "outboxd"."settlement_consumption" (
	"subscriber" text NOT NULL,
	"operation_id" uuid NOT NULL,
	"consumed_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "settlement_consumption_subscriber_operation_id_pk" PRIMARY KEY("subscriber","operation_id")
);
--> statement-breakpoint
ALTER TABLE "outboxd"."orders" DROP CONSTRAINT "orders_status_check";--> statement-breakpoint
ALTER TABLE "outboxd"."orders" ADD CONSTRAINT "orders_status_check" CHECK ("outboxd"."orders"."status" in ('confirmed', 'paid', 'payment_failed'));