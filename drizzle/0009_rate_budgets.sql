CREATE TABLE "outboxd"."rate_budgets" (
	"name" text PRIMARY KEY NOT NULL,
	"tokens" double precision NOT NULL,
	"refilled_at" timestamp with time zone DEFAULT now() NOT NULL,
	"short_at" timestamp with time zone
);
