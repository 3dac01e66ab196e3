-- Operation ids become time-ordered (UUIDv7, RFC 9562): 48 bits of Unix milliseconds, the version, then
-- gen_random_uuid()'s random bits (74 of them, as unguessable as a console URL needs). Each new id sorts
-- after those of earlier milliseconds, so an insert writes the rightmost pages of the primary key and of
-- the indexes that lead with an operation id (the timeline's, the audit trail's) instead of any page of
-- them: with millions of operations in the ledger, random ids made most confirms read an index page from
-- disk and write a full image of it to the WAL (the first change to a page after each checkpoint).
-- Existing ids stay as they are; the idempotency key is still `payment-op:<id>`. PostgreSQL 18's own
-- uuidv7() does the same; this one serves 15 to 17 alike. The milliseconds are truncated, as RFC 9562 has
-- them. search_path is pinned: the function runs in the inserting role's transaction, where an object named
-- like a built-in in another schema must not stand in for it. Every role that inserts an operation calls it
-- (a column's default runs with the inserting role's rights), the previous release's included: EXECUTE is
-- granted to PUBLIC explicitly, for databases whose default privileges revoke it. Only the default
-- changes: no rewrite, no lock held for long.
CREATE OR REPLACE FUNCTION "outboxd"."uuidv7"() RETURNS uuid LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
        placing substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;
--> statement-breakpoint
GRANT EXECUTE ON FUNCTION "outboxd"."uuidv7"() TO PUBLIC;
--> statement-breakpoint
ALTER TABLE "outboxd"."payment_operations" ALTER COLUMN "id" SET DEFAULT "outboxd"."uuidv7"();
