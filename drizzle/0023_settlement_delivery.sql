-- The unnamed onSettled handlers take settlement events from settlement_outbox itself
-- (src/outbox/settlements.ts) instead of a pg-boss job the relay made of each: a lease and a delete per
-- event instead of a job's insert, fetch and completion. The relay then only copies events to named
-- subscribers' queues, marking them fanned_out. It switches once settlement_delivery has its row (the first
-- application of this release to start its unnamed handlers writes it; `outboxd migrate` on a new
-- database): until then it relays every event to the queue `settled`, where earlier applications look.
-- The columns' defaults need no rewrite (none is volatile); the indexes are built plainly, under the
-- migration's lock_timeout, as the release before this one keeps the table near empty (its relay deletes
-- each row as it relays it).
CREATE TABLE "outboxd"."settlement_delivery" (
	"id" integer PRIMARY KEY DEFAULT 1 NOT NULL,
	"since" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "settlement_delivery_one_row" CHECK ("outboxd"."settlement_delivery"."id" = 1)
);
--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" ADD COLUMN "fanned_out" boolean DEFAULT false NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" ADD COLUMN "attempts" integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" ADD COLUMN "not_before" timestamp with time zone DEFAULT now() NOT NULL;--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" ADD COLUMN "leased_until" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "outboxd"."settlement_outbox" ADD COLUMN "last_error" text;--> statement-breakpoint
CREATE INDEX "settlement_outbox_ready_idx" ON "outboxd"."settlement_outbox" USING btree ("not_before","id");--> statement-breakpoint
CREATE INDEX "settlement_outbox_fan_out_idx" ON "outboxd"."settlement_outbox" USING btree ("id") WHERE not "outboxd"."settlement_outbox"."fanned_out";