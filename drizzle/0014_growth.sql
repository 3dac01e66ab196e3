ALTER TABLE "outboxd"."operation_events" ADD COLUMN "repeats" integer DEFAULT 1 NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."operation_events" ADD COLUMN "last_at" timestamp with time zone;--> statement-breakpoint
-- Room on each page for the new version of a row a claim updates: an update that changes no indexed
-- column and finds room on its page is a HOT update, which writes no index.
ALTER TABLE "outboxd"."payment_operations" SET (fillfactor = 80);
