CREATE TABLE "outboxd"."console_sessions" (
	"id" text PRIMARY KEY NOT NULL,
	"operator" text NOT NULL,
	"csrf_token" text NOT NULL,
	"token_fingerprint" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"expires_at" timestamp with time zone NOT NULL
);
--> statement-breakpoint
CREATE TABLE "outboxd"."operation_events" (
	"id" bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY (sequence name "outboxd"."operation_events_id_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1),
	"operation_id" uuid NOT NULL,
	"at" timestamp with time zone DEFAULT now() NOT NULL,
	"type" text NOT NULL,
	"fence" bigint,
	"actor" text,
	"details" jsonb DEFAULT '{}'::jsonb NOT NULL
);
--> statement-breakpoint
CREATE INDEX "operation_events_operation_idx" ON "outboxd"."operation_events" USING btree ("operation_id","id");--> statement-breakpoint
CREATE INDEX "payment_operations_list_idx" ON "outboxd"."payment_operations" USING btree ("kind","status","created_at","id");--> statement-breakpoint
CREATE INDEX "payment_operations_external_idx" ON "outboxd"."payment_operations" USING btree ("external_id") WHERE "outboxd"."payment_operations"."external_id" is not null;--> statement-breakpoint
CREATE INDEX "payment_operations_settled_idx" ON "outboxd"."payment_operations" USING btree ("settled_at") WHERE "outboxd"."payment_operations"."settled_at" is not null;--> statement-breakpoint
CREATE INDEX "webhook_events_operation_idx" ON "outboxd"."webhook_events" USING btree ("operation_id");