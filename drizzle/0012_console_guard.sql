CREATE TABLE "outboxd"."console_sign_in_failures" (
	"subject" text PRIMARY KEY NOT NULL,
	"failures" integer NOT NULL,
	"first_failed_at" timestamp with time zone DEFAULT now() NOT NULL,
	"blocked_until" timestamp with time zone
);
--> statement-breakpoint
CREATE INDEX "operation_events_at_idx" ON "outboxd"."operation_events" USING brin ("at");