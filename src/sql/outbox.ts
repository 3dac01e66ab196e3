// The statements of the outbox, written with the operation and relayed to pg-boss in batches, and the settlement events,
// written by the statement that settles and relayed alike (src/outbox/).
import type { SqlContext } from './context.ts';

export const outboxStatements = ({ boss, s, schema, statement }: SqlContext) => ({
  /** The channel the outboxes' triggers NOTIFY while a relay sleeps (drizzle/0022_outbox_wake.sql): the
   * relay LISTENs on it instead of waiting out its poll. */
  relayChannel: `outboxd_relay_${schema}`,

  /** Registers (or renews) a relay asleep on empty outboxes, which the outboxes' triggers then NOTIFY,
   * for `seconds`; lapsed registrations, which dead replicas left, go. */
  relaySleeps: statement<[workerId: string, seconds: number]>(
    'outboxd_relay_sleeps',
    `with lapsed as (delete from ${s}.relay_sleepers where expires_at < now())
     insert into ${s}.relay_sleepers (worker_id, expires_at) values ($1, now() + make_interval(secs => $2))
     on conflict (worker_id) do update set expires_at = excluded.expires_at`,
  ),

  relayWakes: statement<[workerId: string]>('outboxd_relay_wakes', `delete from ${s}.relay_sleepers where worker_id = $1`),

  /** Whether each outbox has rows: the relay's one look before it opens a transaction on either. */
  outboxesHaveRows: statement<[]>(
    'outboxd_outboxes_have_rows',
    `select exists (select 1 from ${s}.charge_outbox) as operations, exists (select 1 from ${s}.settlement_outbox) as settlements`,
  ),

  /** Takes the oldest rows no other relay holds; deleting them in the job-creating transaction is the mark.
   * (The timeline does not record the relay: the job's creation says when, at no write on the hot path.) */
  takeOutboxBatch: statement<[limit: number]>(
    'outboxd_take_outbox_batch',
    `delete from ${s}.charge_outbox
     where id in (select id from ${s}.charge_outbox order by id limit $1 for update skip locked)
     returning operation_id, traceparent, kind`,
  ),

  outboxRowFor: statement<[operationId: string]>(
    'outboxd_outbox_row_for',
    `select id, created_at from ${s}.charge_outbox where operation_id = $1 order by id limit 1`,
  ),

  outboxDepth: statement<[]>('outboxd_outbox_depth', `select count(*)::int as rows from ${s}.charge_outbox`),

  /** Takes the oldest events no other relay holds, with what they say (the settled operation's fields),
   * and on each row the named subscribers' queues ($2: pg-boss's event, as settlementSubscriberQueues
   * reads them), read in the same statement and snapshot. */
  takeSettlementBatch: statement<[limit: number, event: string]>(
    'outboxd_take_settlement_batch',
    `with taken as (
       delete from ${s}.settlement_outbox
       where id in (select id from ${s}.settlement_outbox order by id limit $1 for update skip locked)
       returning id, operation_id, source
     )
     select op.id as operation_id, op.order_id, op.kind,
            -- A key qualified by its parent (a capture's or a cancel's effect_key: <charge operation id>/<key>,
            -- the caller's in its payload) is the caller's.
            case when op.effect_key = op.parent_operation_id::text || '/' || (op.payload->>'key')
              then op.payload->>'key' else op.effect_key end as effect_key,
            op.status, op.external_id, op.amount, op.currency, op.settled_at, taken.source, op.traceparent,
            -- An authorization (a built-in kind's, requested with capture_method manual) that succeeded on a
            -- PaymentIntent that held the funds (not one found captured already): a hold.
            case when op.policy = 'idempotent-key' and op.payload->>'capture_method' = 'manual' and op.status = 'succeeded'
                   and coalesce(op.result->>'status', 'requires_capture') = 'requires_capture'
              then jsonb_build_object('captureBefore', op.result->>'capture_before') end as hold,
            (select coalesce(array_agg(q.name order by q.name), '{}') from ${boss}.subscription q where q.event = $2) as subscribers
     from taken join ${s}.payment_operations op on op.id = taken.operation_id
     order by taken.id`,
  ),

  settlementOutboxDepth: statement<[]>(
    'outboxd_settlement_outbox_depth',
    `select count(*)::int as rows from ${s}.settlement_outbox`,
  ),

  /** The named subscribers' queues (pg-boss's subscriptions to the event `settled`, which its foreign
   * key keeps to existing queues), for the relay. */
  settlementSubscriberQueues: statement<[event: string]>(
    'outboxd_settlement_subscriber_queues',
    `select name from ${boss}.subscription where event = $1 order by name`,
  ),

  /** First statement of a transactional delivery: its statement_timeout and its
   * idle_in_transaction_session_timeout, or a tighter bound the role or the server already sets. */
  boundSettlementTransaction: statement<[statementMs: number, idleMs: number]>(
    'outboxd_bound_settlement_transaction',
    `select set_config(g.name, least(g.ms, nullif(p.setting::bigint, 0))::text, true)
     from (values ('statement_timeout', $1::bigint), ('idle_in_transaction_session_timeout', $2::bigint)) g(name, ms)
     join pg_settings p on p.name = g.name`,
  ),

  /** Records `subscriber` consuming the operation's settlement, inside the delivery's transaction: no
   * row back means it consumed it already. */
  consumeSettlement: statement<[subscriber: string, operationId: string]>(
    'outboxd_consume_settlement',
    `insert into ${s}.settlement_consumption (subscriber, operation_id) values ($1, $2)
     on conflict (subscriber, operation_id) do nothing
     returning operation_id`,
  ),
});
