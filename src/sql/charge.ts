// The statements of requesting a charge (src/kinds/charge/request.ts): at most one live charge operation per order.
import type { SqlContext } from './context.ts';

export const chargeStatements = ({ operationColumns, s, statement }: SqlContext) => ({
  /**
   * A charge operation and its outbox row, in ONE statement: both are written or neither, on whatever
   * connection runs it (the caller's, inside its transaction). A first request ($7 false) creates only
   * when the order has no charge operation at all; a new attempt ($7 true) only while none is live,
   * which the partial unique index enforces against concurrent requests too. No row: nothing created.
   * $8: the request's W3C traceparent (null when untraced), kept on both rows. $9: the charge's payload
   * (src/kinds/charge/input.ts ChargePayload), null for an automatic charge on the platform.
   */
  insertChargeOperation: statement<
    [orderId: string, amount: number, currency: string, customer: string, pm: string, metadata: string, newAttempt: boolean, traceparent: string | null, payload: string | null]
  >(
    'outboxd_insert_charge_operation',
    `with op as (
       insert into ${s}.payment_operations (order_id, kind, amount, currency, customer_id, payment_method, metadata, traceparent, payload)
       select $1::text, 'charge', $2::bigint, $3::text, $4::text, $5::text, $6::jsonb, $8::text, $9::jsonb
       where $7::boolean or not exists (select 1 from ${s}.payment_operations where order_id = $1::text and kind = 'charge')
       on conflict (order_id) where kind = 'charge' and status <> 'failed' do nothing
       returning id, traceparent
     ), outbox as (
       insert into ${s}.charge_outbox (operation_id, traceparent) select id, traceparent from op
     )
     select id from op`,
  ),

  /** Every charge operation of an order, newest first. */
  chargeOperationsOfOrder: statement<[orderId: string]>(
    'outboxd_charge_operations_of_order',
    `select ${operationColumns()} from ${s}.payment_operations where order_id = $1 and kind = 'charge' order by created_at desc, id`,
  ),
});
