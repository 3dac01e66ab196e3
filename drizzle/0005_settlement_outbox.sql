CREATE TABLE "outboxd"."settlement_outbox" (
	"id" bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY (sequence name "outboxd"."settlement_outbox_id_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1),
	"operation_id" uuid NOT NULL,
	"source" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" ADD CONSTRAINT "settlement_outbox_operation_id_payment_operations_id_fk" FOREIGN KEY ("operation_id") REFERENCES "outboxd"."payment_operations"("id") ON DELETE no action ON UPDATE no action;