-- outboxd's tables leave `public` for their own schema. `outboxd migrate` runs every migration with
-- search_path set to that schema (OUTBOXD_SCHEMA, default outboxd), so current_schema() names it.
-- A database created by the release that kept the tables in public: they move, with their rows,
-- indexes, constraints and identity sequences. A database created since: 0000-0002 already created
-- them in the schema, nothing moves, and an application's own public.orders is never touched.
DO $$
DECLARE
  t text;
BEGIN
  IF to_regclass(format('%I.payment_operations', current_schema())) IS NOT NULL THEN
    RETURN;
  END IF;
  FOREACH t IN ARRAY ARRAY['orders', 'payment_operations', 'admin_audit', 'webhook_events', 'charge_outbox'] LOOP
    EXECUTE format('ALTER TABLE public.%I SET SCHEMA %I', t, current_schema());
  END LOOP;
END $$;
