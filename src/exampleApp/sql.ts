// The example application's own statements (`outboxd order confirm`, `order follow`): its orders table,
// kept in outboxd's schema for the demo; outboxd itself never reads it.
import { sqlContext, type SqlContext } from '../sql/context.ts';

export type OrderSettledStatus = 'paid' | 'payment_failed' | 'authorized' | 'released';

const statements = ({ s, statement }: SqlContext) => ({
  insertOrder: statement<[id: string, amount: number, currency: string, customer: string, pm: string]>(
    'outboxd_insert_order',
    `insert into ${s}.orders (id, amount, currency, customer_id, payment_method) values ($1, $2, $3, $4, $5)
     on conflict (id) do nothing`,
  ),

  /** The example's settlement subscriber (`order follow`): paid is final. An authorization's event moves a
   * confirmed order, or one whose earlier card failed, not one its capture or cancel (delivered first)
   * moved on; a failed charge's moves neither an authorized nor a released order (a later card's hold). */
  markOrderSettled: statement<[id: string, status: OrderSettledStatus]>(
    'outboxd_mark_order_settled',
    `update ${s}.orders set status = $2, updated_at = now()
     where id = $1 and status <> 'paid'
       and ($2 <> 'authorized' or status in ('confirmed', 'payment_failed'))
       and ($2 <> 'payment_failed' or status not in ('authorized', 'released'))`,
  ),
});

export type ExampleStatements = ReturnType<typeof statements>;

const built = new Map<string, ExampleStatements>();

/** The example's statements for `schema` (unnamed: they run on whatever connection the example has). */
export function exampleStatementsFor(schema: string): ExampleStatements {
  let found = built.get(schema);
  if (!found) built.set(schema, (found = statements(sqlContext(schema, false))));
  return found;
}
