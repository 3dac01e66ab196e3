// The statements of requesting a capture or a cancel of an authorization (src/kinds/hold/request.ts).
import type { SqlContext } from './context.ts';

/** What a capture or a cancel is decided from, of its charge. */
const CHARGE_COLUMNS = 'id, kind, status, order_id, amount, currency, external_id, payload, result, now() as now';

export const holdStatements = ({ event, operationColumns, s, settlementEvent, statement }: SqlContext) => ({
  /**
   * The first step, in the caller's transaction: a succeeded charge operation, locked by an update (of
   * nothing) until the caller commits, so that concurrent captures and cancels of one authorization are
   * decided one after the other (an update, not only a lock: see lockChargeForRefund). Only a succeeded
   * one, which no worker writes: an unsettled charge's outcome must not wait on the caller's transaction,
   * which is refused anyway. No row: chargeForChange says why.
   */
  lockChargeForChange: statement<[chargeOperationId: string]>(
    'outboxd_lock_charge_for_change',
    `update ${s}.payment_operations set updated_at = updated_at where id = $1 and kind = 'charge' and status = 'succeeded'
     returning ${CHARGE_COLUMNS}`,
  ),

  /** The operation a capture or a cancel names, unlocked, when it is no succeeded charge; no row: none. */
  chargeForChange: statement<[chargeOperationId: string]>(
    'outboxd_charge_for_change',
    `select ${CHARGE_COLUMNS} from ${s}.payment_operations where id = $1`,
  ),

  /** The captures and cancels of a charge (read after the lock above), through the order's index. */
  changesOfCharge: statement<[chargeOperationId: string, orderId: string]>(
    'outboxd_changes_of_charge',
    `select id, kind, status, amount, effect_key, payload from ${s}.payment_operations
     where order_id = $2 and kind in ('capture', 'cancel') and parent_operation_id = $1`,
  ),

  /**
   * The capture or cancel and its outbox row, in ONE statement; its effect_key `<charge id>/<key>` is
   * unique per kind through the application-effect index, and a charge has at most one change that has
   * not failed (payment_operations_live_change_idx), whatever its callers' transactions. No row: either
   * refused it (the caller reads why).
   */
  insertChangeOperation: statement<
    [kind: string, orderId: string, amount: number, currency: string, chargeOperationId: string, effectKey: string, payload: string, traceparent: string | null]
  >(
    'outboxd_insert_change_operation',
    `with op as (
       insert into ${s}.payment_operations (kind, order_id, amount, currency, parent_operation_id, effect_key, payload, traceparent)
       values ($1, $2, $3::bigint, $4, $5::uuid, $6, $7::jsonb, $8)
       on conflict do nothing
       returning id, kind, traceparent
     ), outbox as (
       insert into ${s}.charge_outbox (operation_id, kind, traceparent) select id, kind, traceparent from op
     )
     select id from op`,
  ),

  /**
   * What Stripe did to an authorization outside outboxd: released it by itself (expired:
   * cancellation_reason expired) or cancelled it (the dashboard), recorded as a cancel of the charge;
   * or captured it (the dashboard), recorded as a capture of what Stripe took ($7; null: the charge's
   * amount), so that its money can be refunded. Recorded under the key $3, settled succeeded from what
   * Stripe showed ($4: the reason, $5: what it showed; $6: what told, its webhook or the reconcile sweep),
   * with its settlement event, so that the application hears of it. Nothing when a change of that kind
   * that has not failed exists already (its own outcome tells), when one of the other kind is live (the
   * change index: it settles by itself from what Stripe shows), or when the key was recorded before.
   */
  recordChangeInStripe: statement<
    [chargeOperationId: string, kind: 'capture' | 'cancel', key: string, reason: string | null, result: string, source: 'webhook' | 'reconcile', amount: number | null]
  >(
    'outboxd_record_change_in_stripe',
    `with op as (
       insert into ${s}.payment_operations (kind, order_id, amount, currency, parent_operation_id, effect_key, payload,
         status, external_id, last_outcome, last_error, result, settled_at, traceparent)
       select $2::text, c.order_id, coalesce($7::bigint, c.amount), c.currency, c.id, c.id::text || '/' || $3,
              jsonb_strip_nulls(jsonb_build_object('payment_intent', c.external_id, 'stripe_account', c.payload->>'stripe_account', 'key', $3::text, 'reason', $4::text)),
              'succeeded', c.external_id, 'succeeded', null, $5::jsonb, now(), c.traceparent
       from ${s}.payment_operations c
       where c.id = $1 and c.kind = 'charge' and c.status = 'succeeded'
         and not exists (select 1 from ${s}.payment_operations x
                         where x.order_id = c.order_id and x.kind = $2::text and x.parent_operation_id = c.id and x.status <> 'failed')
       on conflict do nothing
       returning id, status, fence, external_id, last_outcome, last_error
     ), ${settlementEvent('$6')},
     ${event('op', `id, 'settled', fence, $6::text, jsonb_strip_nulls(jsonb_build_object('status', status, 'external_id', external_id, 'reason', $4::text))`)}
     select id from op`,
  ),

  /**
   * Held authorizations that no capture or cancel has changed or is changing, whose PaymentIntent Stripe
   * has changed by now, as far as outboxd can tell: past their capture_before ($1, an ISO-8601 UTC time,
   * as the result keeps it: such strings sort as the times do; Stripe released them) and after $2 (older
   * ones were swept for long enough), through the expiry index; or whose capture or cancel failed since
   * $2 (found among the failed ones through the kind and status index; settled then, however long it sat
   * in review), as one does on a PaymentIntent changed in the dashboard while it was live: then no webhook
   * of that change recorded it (the live change stood in its way). One Stripe gave no capture_before (a
   * wallet's: only a card's says) from the shortest card window ($4) after it settled. Not one first seen
   * captured: it held nothing, and its own settlement told what Stripe took.
   */
  authorizationsToFollowUp: statement<[now: string, since: string, limit: number, windowSeconds: number]>(
    'outboxd_authorizations_to_follow_up',
    `with candidates as (
       select c.id from ${s}.payment_operations c
       where c.kind = 'charge' and c.status = 'succeeded' and c.payload->>'capture_method' = 'manual'
         and c.result->>'capture_before' < $1 and c.result->>'capture_before' > $2
       union
       select c.id from ${s}.payment_operations c
       where c.kind = 'charge' and c.status = 'succeeded' and c.payload->>'capture_method' = 'manual'
         and c.result->>'capture_before' is null
         and c.settled_at < $1::timestamptz - make_interval(secs => $4) and c.settled_at > $2::timestamptz - make_interval(secs => $4)
       union
       select x.parent_operation_id from ${s}.payment_operations x
       where x.kind in ('capture', 'cancel') and x.status = 'failed' and x.settled_at > $2::timestamptz
     )
     select ${operationColumns('c')} from ${s}.payment_operations c
     where c.id in (select id from candidates)
       and c.kind = 'charge' and c.status = 'succeeded' and c.payload->>'capture_method' = 'manual'
       and c.result->>'status' is distinct from 'succeeded'
       and not exists (select 1 from ${s}.payment_operations x
                       where x.order_id = c.order_id and x.kind in ('capture', 'cancel') and x.parent_operation_id = c.id and x.status <> 'failed')
     -- In an order each sweep draws anew: more may wait than a sweep reads (undated holds may stay held
     -- for weeks, and a dated one Stripe is late to release is read until it does), and none is left out
     -- for good.
     order by hashtext(c.id::text || $1)
     limit $3`,
  ),
});
