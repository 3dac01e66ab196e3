-- Rows arriving in an outbox that held none wake the relays at once (each dispatcher LISTENs on
-- outboxd_relay_<schema>, src/dispatcher/dispatcher.ts), instead of after their 50 ms poll. Only the
-- statement whose rows are the oldest waiting notifies: a NOTIFY serializes the commits of the
-- transactions that send one (PostgreSQL's queue lock is held through the commit), so under load, when
-- rows already wait and the relay is at work, the caller's transaction sends none and commits as before.
CREATE FUNCTION "outboxd"."charge_outbox_wake"() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE first bigint;
BEGIN
  SELECT min(id) INTO first FROM arrived;
  IF first IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "outboxd"."charge_outbox" WHERE id < first) THEN
    PERFORM pg_notify('outboxd_relay_' || TG_TABLE_SCHEMA, '');
  END IF;
  RETURN NULL;
END $$;
--> statement-breakpoint
CREATE FUNCTION "outboxd"."settlement_outbox_wake"() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE first bigint;
BEGIN
  SELECT min(id) INTO first FROM arrived;
  IF first IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "outboxd"."settlement_outbox" WHERE id < first) THEN
    PERFORM pg_notify('outboxd_relay_' || TG_TABLE_SCHEMA, '');
  END IF;
  RETURN NULL;
END $$;
--> statement-breakpoint
CREATE TRIGGER "charge_outbox_wake" AFTER INSERT ON "outboxd"."charge_outbox"
  REFERENCING NEW TABLE AS arrived FOR EACH STATEMENT EXECUTE FUNCTION "outboxd"."charge_outbox_wake"();
--> statement-breakpoint
CREATE TRIGGER "settlement_outbox_wake" AFTER INSERT ON "outboxd"."settlement_outbox"
  REFERENCING NEW TABLE AS arrived FOR EACH STATEMENT EXECUTE FUNCTION "outboxd"."settlement_outbox_wake"();
