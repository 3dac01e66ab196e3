-- The example's orders (`order follow`) may be authorized (funds held) and released (a hold cancelled).
-- NOT VALID: the new check only allows more, and validating would read every order under the ACCESS
-- EXCLUSIVE lock the constraint takes; every row written from now on is checked.
ALTER TABLE "outboxd"."orders" DROP CONSTRAINT "orders_status_check";--> statement-breakpoint
ALTER TABLE "outboxd"."orders" ADD CONSTRAINT "orders_status_check" CHECK ("outboxd"."orders"."status" in ('confirmed', 'paid', 'payment_failed', 'authorized', 'released')) NOT VALID;
