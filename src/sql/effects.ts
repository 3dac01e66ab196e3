// The statements of requesting an application's effect (src/kinds/application/request.ts): unique per (kind, key).
import type { SqlContext } from './context.ts';

export const effectsStatements = ({ s, statement }: SqlContext) => ({
  /**
   * An application's effect of kind $1 under key $3 (unique per kind) and its outbox row, in ONE
   * statement, with the policy it is requested under ($2). No row: the key already names one
   * (effectOperationByKey reads it).
   */
  insertEffectOperation: statement<[kind: string, policy: string, key: string, payload: string, traceparent: string | null]>(
    'outboxd_insert_effect_operation',
    `with op as (
       insert into ${s}.payment_operations (kind, policy, effect_key, payload, traceparent)
       values ($1, $2, $3, $4::jsonb, $5)
       on conflict (kind, effect_key) where kind not in ('charge', 'refund') do nothing
       returning id, kind, traceparent
     ), outbox as (
       insert into ${s}.charge_outbox (operation_id, kind, traceparent) select id, kind, traceparent from op
     )
     select id from op`,
  ),

  /** The effect a kind's key names, and whether it was requested with this payload. */
  effectOperationByKey: statement<[kind: string, key: string, payload: string]>(
    'outboxd_effect_operation_by_key',
    `select id, payload = $3::jsonb as same_payload from ${s}.payment_operations where kind = $1 and effect_key = $2`,
  ),
});
