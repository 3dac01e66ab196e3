CREATE TABLE "outboxd"."settlement_sleepers" (
	"delivery_id" text PRIMARY KEY NOT NULL,
	"expires_at" timestamp with time zone NOT NULL
);
--> statement-breakpoint
-- A settlement event an application's unnamed onSettled handlers may take (a row inserted, or, while named
-- subscribers exist, copied to them) wakes the applications whose handlers wait for one (each LISTENs on
-- outboxd_settlements_<schema>, src/outbox/settlements.ts) at once, instead of after their poll. As for
-- the relays (0022_outbox_wake), only while one is registered: a NOTIFY serializes the commits of the
-- transactions that send one. The workers' and an application's roles read settlement_sleepers through
-- the trigger, hence the grant.
CREATE FUNCTION "outboxd"."settlement_wake"() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM "outboxd"."settlement_sleepers" WHERE expires_at > now()) THEN
    PERFORM pg_notify('outboxd_settlements_' || TG_TABLE_SCHEMA, '');
  END IF;
  RETURN NULL;
END $$;
--> statement-breakpoint
GRANT SELECT ON "outboxd"."settlement_sleepers" TO PUBLIC;
--> statement-breakpoint
CREATE TRIGGER "settlement_outbox_settled_wake" AFTER INSERT ON "outboxd"."settlement_outbox"
  FOR EACH ROW EXECUTE FUNCTION "outboxd"."settlement_wake"();
--> statement-breakpoint
CREATE TRIGGER "settlement_outbox_copied_wake" AFTER UPDATE OF "fanned_out" ON "outboxd"."settlement_outbox"
  FOR EACH ROW WHEN (NEW."fanned_out" AND NOT OLD."fanned_out") EXECUTE FUNCTION "outboxd"."settlement_wake"();
