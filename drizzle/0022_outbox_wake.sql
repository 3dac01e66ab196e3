CREATE TABLE "outboxd"."relay_sleepers" (
	"worker_id" text PRIMARY KEY NOT NULL,
	"expires_at" timestamp with time zone NOT NULL
);
--> statement-breakpoint
-- Rows arriving in an outbox wake the relays that sleep on an empty one (each LISTENs on
-- outboxd_relay_<schema>, src/dispatcher/dispatcher.ts) at once, instead of after their poll. A NOTIFY
-- serializes the commits of the transactions that send one (PostgreSQL holds its queue lock through the
-- commit), so the caller's transaction sends none while no relay sleeps: under load the relays keep
-- polling rows and leave relay_sleepers empty, and a confirm pays one read of an empty table. A row
-- trigger, so that an insert that adds nothing (a duplicate order's ON CONFLICT DO NOTHING) sends nothing;
-- the caller's role reads relay_sleepers through it, hence the grant.
CREATE FUNCTION "outboxd"."outbox_wake"() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM "outboxd"."relay_sleepers" WHERE expires_at > now()) THEN
    PERFORM pg_notify('outboxd_relay_' || TG_TABLE_SCHEMA, '');
  END IF;
  RETURN NULL;
END $$;
--> statement-breakpoint
GRANT SELECT ON "outboxd"."relay_sleepers" TO PUBLIC;
--> statement-breakpoint
CREATE TRIGGER "charge_outbox_wake" AFTER INSERT ON "outboxd"."charge_outbox"
  FOR EACH ROW EXECUTE FUNCTION "outboxd"."outbox_wake"();
--> statement-breakpoint
CREATE TRIGGER "settlement_outbox_wake" AFTER INSERT ON "outboxd"."settlement_outbox"
  FOR EACH ROW EXECUTE FUNCTION "outboxd"."outbox_wake"();
