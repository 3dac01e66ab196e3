ALTER TABLE "outboxd"."payment_operations" ADD COLUMN "last_attempted_at" timestamp with time zone;--> statement-breakpoint
-- Operations unsettled at upgrade time: their last create is at least as recent as their last update
-- (an over-estimate keeps a failed resolution waiting, never lets it through early).
UPDATE "outboxd"."payment_operations" SET "last_attempted_at" = "updated_at" WHERE "first_attempted_at" IS NOT NULL AND "status" IN ('pending', 'unknown');
