CREATE TABLE "outboxd"."console_sign_in_failures" (
	"subject" text PRIMARY KEY NOT NULL,
	"failures" integer NOT NULL,
	"first_failed_at" timestamp with time zone DEFAULT now() NOT NULL,
	"blocked_until" timestamp with time zone
);
