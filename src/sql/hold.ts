// The statements of requesting a capture or a cancel of an authorization (src/kinds/hold/request.ts).
import type { SqlContext } from './context.ts';

export const holdStatements = ({ s, statement }: SqlContext) => ({
  /**
   * The first step, in the caller's transaction: the charge operation, locked by an update (of nothing)
   * until the caller commits, so that concurrent captures and cancels of one authorization are decided
   * one after the other (an update, not only a lock: see lockChargeForRefund). Whatever its status; no
   * row: no such operation.
   */
  lockChargeForChange: statement<[chargeOperationId: string]>(
    'outboxd_lock_charge_for_change',
    `update ${s}.payment_operations set updated_at = updated_at where id = $1
     returning id, kind, status, order_id, amount, currency, external_id, payload, result, now() as now`,
  ),

  /** The captures and cancels of a charge (read after the lock above), through the order's index. */
  changesOfCharge: statement<[chargeOperationId: string, orderId: string]>(
    'outboxd_changes_of_charge',
    `select id, kind, status, amount, effect_key, payload from ${s}.payment_operations
     where order_id = $2 and kind in ('capture', 'cancel') and parent_operation_id = $1`,
  ),

  /**
   * The capture or cancel and its outbox row, in ONE statement; its effect_key `<charge id>/<key>` is
   * unique per kind through the application-effect index. No row: the key names one already.
   */
  insertChangeOperation: statement<
    [kind: string, orderId: string, amount: number, currency: string, chargeOperationId: string, effectKey: string, payload: string, traceparent: string | null]
  >(
    'outboxd_insert_change_operation',
    `with op as (
       insert into ${s}.payment_operations (kind, order_id, amount, currency, parent_operation_id, effect_key, payload, traceparent)
       values ($1, $2, $3::bigint, $4, $5::uuid, $6, $7::jsonb, $8)
       on conflict (kind, effect_key) where kind not in ('charge', 'refund') do nothing
       returning id, kind, traceparent
     ), outbox as (
       insert into ${s}.charge_outbox (operation_id, kind, traceparent) select id, kind, traceparent from op
     )
     select id from op`,
  ),
});
