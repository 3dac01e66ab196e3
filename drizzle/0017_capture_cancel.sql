-- Captures and cancels (kinds capture, cancel) name their charge, the money and their key. NOT VALID:
-- validating would scan payment_operations under the ACCESS EXCLUSIVE lock the constraint takes, and an
-- application's own rows of a kind it named capture or cancel before this release (the names are reserved
-- now; docs/runbook.md: rename it first) would fail it; every row written from now on is checked.
ALTER TABLE "outboxd"."payment_operations" ADD CONSTRAINT "payment_operations_change_check" CHECK ("outboxd"."payment_operations"."kind" not in ('capture', 'cancel') or ("outboxd"."payment_operations"."parent_operation_id" is not null and "outboxd"."payment_operations"."effect_key" like "outboxd"."payment_operations"."parent_operation_id"::text || '/%' and "outboxd"."payment_operations"."order_id" is not null and "outboxd"."payment_operations"."amount" is not null and "outboxd"."payment_operations"."currency" is not null)) NOT VALID;
