// The statements of requesting a refund (src/kinds/refund/request.ts): of a succeeded charge, within what remains of it.
import type { SqlContext } from './context.ts';

export const refundStatements = ({ s, statement }: SqlContext) => ({
  /**
   * The first step of a refund request, in the caller's transaction: a succeeded charge operation,
   * locked by an update (of nothing) until the caller commits, so that concurrent refund requests of
   * one charge are decided one after the other. An update, not only a lock: under REPEATABLE READ a
   * request that waited on a mere lock would go on reading the refunds committed before it began;
   * an updated row makes it fail instead. No row: no such charge, or it has not succeeded. `xact`: the
   * transaction that holds the lock, which the insert must run in (see there).
   */
  lockChargeForRefund: statement<[chargeOperationId: string]>(
    'outboxd_lock_charge_for_refund',
    `update ${s}.payment_operations set updated_at = updated_at
     where id = $1 and kind = 'charge' and status = 'succeeded'
     returning id, payload->>'transfer_destination' is not null as transfers, payload->>'application_fee_amount' is not null as takes_fee,
       pg_current_xact_id()::text as xact`,
  ),

  /**
   * The refund operation and its outbox row, in ONE statement (after lockChargeForRefund, so it reads
   * every refund of the charge committed before): created only when no refund of the charge has this
   * key and the amount fits in what remains unrefunded, counting every refund that has not failed
   * (pending and unknown ones may still succeed; a succeeded one Stripe failed since returned nothing);
   * of an authorization, what remains of what its capture took. The payload carries the charge's account
   * and, for a destination charge, what the refund takes back. Always one row: what it decided from (of a
   * refund the key names already, what it was asked).
   * Nothing is inserted outside the lock's transaction ($8): a caller in autocommit (a bare query function
   * outboxd cannot ask) held the lock for its statement only, and two such requests could both fit.
   */
  insertRefundOperation: statement<
    [chargeOperationId: string, amount: number, key: string, reason: string | null, traceparent: string | null, reverseTransfer: boolean, refundApplicationFee: boolean, lockXact: string]
  >(
    'outboxd_insert_refund_operation',
    `with charge as (
       select p.id, p.order_id, p.currency, p.external_id, p.payload,
              -- An authorization's refundable money is what its capture took (through the order's index),
              -- or, first seen captured already (the dashboard), what Stripe took then; an automatic
              -- charge's, all of it.
              case when p.payload->>'capture_method' = 'manual' and p.result->>'status' = 'succeeded'
                then coalesce((p.result->>'amount_received')::bigint, p.amount)
                when p.payload->>'capture_method' = 'manual'
                then (select coalesce(sum(c.amount), 0)::bigint from ${s}.payment_operations c
                      where c.order_id = p.order_id and c.kind = 'capture' and c.parent_operation_id = $1 and c.status = 'succeeded')
                else p.amount end as amount
       from ${s}.payment_operations p
       where p.id = $1 and p.kind = 'charge' and p.status = 'succeeded'
     ), existing as (
       select id, amount, payload->>'reason' as reason,
              coalesce((payload->>'reverse_transfer')::boolean, false) as reverse_transfer,
              coalesce((payload->>'refund_application_fee')::boolean, false) as refund_application_fee
       from ${s}.payment_operations
       where kind = 'refund' and parent_operation_id = $1 and effect_key = $3
     ), spent as (
       select coalesce(sum(amount), 0)::bigint as spent from ${s}.payment_operations
       where kind = 'refund' and parent_operation_id = $1 and status <> 'failed' and not coalesce(result ? 'failed_in_stripe', false)
     ), op as (
       insert into ${s}.payment_operations (order_id, kind, amount, currency, parent_operation_id, effect_key, payload, traceparent)
       select charge.order_id, 'refund', $2::bigint, charge.currency, charge.id, $3::text,
              jsonb_strip_nulls(jsonb_build_object('payment_intent', charge.external_id, 'reason', $4::text,
                'stripe_account', charge.payload->>'stripe_account',
                'reverse_transfer', nullif($6::boolean, false), 'refund_application_fee', nullif($7::boolean, false)))
              || jsonb_build_object('reason', $4::text),
              $5::text
       from charge, spent
       where not exists (select 1 from existing) and spent.spent + $2::bigint <= charge.amount and pg_current_xact_id()::text = $8::text
       on conflict (parent_operation_id, effect_key) where kind = 'refund' do nothing
       returning id, traceparent
     ), outbox as (
       insert into ${s}.charge_outbox (operation_id, kind, traceparent) select id, 'refund', traceparent from op
     )
     select (select id from op) as created_id, existing.id as existing_id, existing.amount as existing_amount,
            existing.reason as existing_reason, existing.reverse_transfer as existing_reverse_transfer,
            existing.refund_application_fee as existing_refund_application_fee, spent.spent, charge.amount as charge_amount,
            charge.payload->>'capture_method' = 'manual' as authorization, pg_current_xact_id()::text = $8::text as under_lock
     from spent left join charge on true left join existing on true`,
  ),

  /** A succeeded refund operation whose Refund Stripe failed since (src/kinds/refund/evidence.ts): kept
   * succeeded, recorded in its result once ($2: the Refund's status, $3: what told). No row: not a
   * succeeded refund, or recorded already. */
  recordRefundFailedInStripe: statement<[id: string, status: string, source: 'webhook' | 'reconcile']>(
    'outboxd_record_refund_failed_in_stripe',
    `update ${s}.payment_operations
     set result = coalesce(result, '{}'::jsonb) || jsonb_build_object('failed_in_stripe', jsonb_build_object('status', $2::text, 'source', $3::text, 'at', now())),
         updated_at = now()
     where id = $1 and kind = 'refund' and status = 'succeeded' and not coalesce(result ? 'failed_in_stripe', false)
     returning id`,
  ),
});
