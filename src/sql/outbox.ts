// The statements of the outbox, written with the operation and relayed to pg-boss in batches, and of the settlement
// events, written by the statement that settles, taken from their table by the unnamed handlers and copied by the
// relay to the named subscribers' queues (src/outbox/).
import { LIVE_JOB, type SqlContext } from './context.ts';

/** The most rows of an outbox the metrics and the console count (outboxd_outbox_rows,
 * outboxd_settlement_events and _outbox_rows saturate there): a count of a backlog of millions, at every
 * scrape, would read all of it. */
export const DEPTH_CAP = 100_000;

export const outboxStatements = ({ boss, byIds, s, schema, statement }: SqlContext) => {
  /** Whether anyone subscribed by name to pg-boss's event $n (`settled`): the relay copies events only then. */
  const subscribed = (n: number) => `exists (select 1 from ${boss}.subscription where event = $${n})`;
  /** `op` is an authorization: a built-in charge (idempotent-key is the built-in kinds' policy, an
   * application's kind has none) requested with capture_method manual. */
  const AUTHORIZATION = `op.policy = 'idempotent-key' and op.payload->>'capture_method' = 'manual'`;
  /** What a settlement event says, from the settled operation `op` and its settlement_outbox row `taken`. */
  const EVENT = `op.id as operation_id, op.order_id, op.kind,
            -- A key qualified by its parent (a capture's or a cancel's effect_key: <charge operation id>/<key>,
            -- the caller's in its payload) is the caller's.
            case when op.effect_key = op.parent_operation_id::text || '/' || (op.payload->>'key')
              then op.payload->>'key' else op.effect_key end as effect_key,
            op.status, op.external_id,
            -- An authorization found captured already (in the dashboard) when it settled charged what Stripe
            -- took, which a capture there may have made less than it asked for. An application's own kind
            -- has no amount, whatever its payload and result hold (a cast failing on one would stop every
            -- event's delivery behind it).
            case when ${AUTHORIZATION} and op.result->>'status' = 'succeeded' and jsonb_typeof(op.result->'amount_received') = 'number'
              then (op.result->>'amount_received')::bigint else op.amount end as amount,
            op.currency, op.settled_at, taken.source, op.traceparent,
            -- An authorization that succeeded on a PaymentIntent that held the funds (not one found captured
            -- already): a hold.
            case when ${AUTHORIZATION} and op.status = 'succeeded'
                   and coalesce(op.result->>'status', 'requires_capture') = 'requires_capture'
              then jsonb_build_object('captureBefore', op.result->>'capture_before') end as hold`;
  /** The events of the rows `taken` (a CTE returning id, operation_id, source, created_at, fanned_out)
   * that the relay holds, with on each the named subscribers' queues ($2: pg-boss's event) that
   * subscribed before it settled (none for a row copied already), read in the same statement and snapshot. */
  const relayedEvents = (taken: string) => `with taken as (${taken})
       select ${EVENT},
              (select coalesce(array_agg(q.name order by q.name), '{}') from ${boss}.subscription q
               where q.event = $2 and q.created_on <= taken.created_at and not taken.fanned_out) as subscribers
       from taken join ${s}.payment_operations op on op.id = taken.operation_id and ${byIds('op', 'array(select operation_id from taken)')}
       order by taken.id`;
  /** The advisory lock between a relay's pass over settlement events (shared) and the switch to the
   * unnamed handlers' table (exclusive): no pass that began before the switch is still taking rows after
   * it, and one that waited for it takes none the old way (takeSettlementBatchForQueue). */
  const SWITCH_LOCK = `hashtextextended('${schema}.settlement_delivery', 0)`;
  /** The oldest settlement_outbox rows no other relay holds, matching `where`: their ids as an array, as
   * byIds names them (src/sql/context.ts), since `id in (…)` was hashed against the whole table. */
  const oldest = (where: string) =>
    `id = any(array(select id from ${s}.settlement_outbox where ${where} order by id limit $1 for update skip locked))`;
  return {
    /** A job of the operation's in one of these queues that still drives it (created, waiting to retry,
     * or active), among the queues' live jobs: not pg-boss's findJobs, which reads every job the queues
     * keep (the completed ones for 3 days, millions on a busy ledger) for each operation asked about. */
    liveJobOf: statement<[queues: string[], operationId: string]>(
      'outboxd_live_job_of',
      `select j.id, j.state from ${boss}.job j where j.name = any($1::text[]) and ${LIVE_JOB('j')} and j.data->>'operationId' = $2 limit 1`,
    ),

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

    /** The channel settlement_outbox's triggers NOTIFY while an application's unnamed handlers wait
     * (drizzle/0026_settlement_wake.sql), and the registration that asks for it, as the relay's. */
    settlementChannel: `outboxd_settlements_${schema}`,
    /** As relaySleeps, but no more than $3 deliveries registered besides this one (no row back: refused). */
    settlementSleeps: statement<[deliveryId: string, seconds: number, atMost: number]>(
      'outboxd_settlement_sleeps',
      `with lapsed as (delete from ${s}.settlement_sleepers where expires_at < now())
       insert into ${s}.settlement_sleepers (delivery_id, expires_at)
       select $1, now() + make_interval(secs => $2)
       where (select count(*) from ${s}.settlement_sleepers where expires_at >= now() and delivery_id <> $1) < $3
       on conflict (delivery_id) do update set expires_at = excluded.expires_at
       returning delivery_id`,
    ),
    settlementWakes: statement<[deliveryId: string]>('outboxd_settlement_wakes', `delete from ${s}.settlement_sleepers where delivery_id = $1`),

    /** Whether each outbox has rows to relay: the relay's one look before it opens a transaction on either.
     * Once the unnamed handlers take events from their table, settlement events are relayed only to named
     * subscribers ($1: pg-boss's event), and only once; before, every one is. */
    outboxesHaveRows: statement<[event: string]>(
      'outboxd_outboxes_have_rows',
      `select exists (select 1 from ${s}.charge_outbox) as operations,
         case when d.on then exists (select 1 from ${s}.settlement_outbox where not fanned_out) and ${subscribed(1)}
           else exists (select 1 from ${s}.settlement_outbox) end as settlements
       from (select exists (select 1 from ${s}.settlement_delivery) as on) d`,
    ),

    /** The unnamed handlers take events from settlement_outbox from now on (src/outbox/settlements.ts),
     * once every relay pass begun before has ended. */
    deliverFromTable: statement<[]>(
      'outboxd_deliver_from_table',
      `with switch as (select pg_advisory_xact_lock(${SWITCH_LOCK}))
       insert into ${s}.settlement_delivery (id) select 1 from switch on conflict do nothing`,
    ),

    /** First statement of a relay's pass over settlement events: whether the unnamed handlers take them
     * from their table, read under the switch's lock (shared, until the pass commits). */
    settlementRelayMode: statement<[]>(
      'outboxd_settlement_relay_mode',
      `select exists (select 1 from ${s}.settlement_delivery) as table_delivery from (select pg_advisory_xact_lock_shared(${SWITCH_LOCK})) l`,
    ),

    /** Takes the oldest rows no other relay holds (their ids as an array, as `oldest` takes them);
     * deleting them in the job-creating transaction is the mark.
     * (The timeline does not record the relay: the job's creation says when, at no write on the hot path.) */
    takeOutboxBatch: statement<[limit: number]>(
      'outboxd_take_outbox_batch',
      `delete from ${s}.charge_outbox
       where id = any(array(select id from ${s}.charge_outbox order by id limit $1 for update skip locked))
       returning operation_id, traceparent, kind`,
    ),

    outboxRowFor: statement<[operationId: string]>(
      'outboxd_outbox_row_for',
      `select id, created_at from ${s}.charge_outbox where operation_id = $1 order by id limit 1`,
    ),

    outboxDepth: statement<[]>('outboxd_outbox_depth', `select count(*)::int as rows from (select from ${s}.charge_outbox limit ${DEPTH_CAP}) capped`),

    /** Takes the oldest events no relay copied yet and no other relay holds, with what they say and the
     * subscribers to copy each to. The rows stay for the unnamed handlers, marked copied. */
    takeSettlementBatch: statement<[limit: number, event: string]>(
      'outboxd_take_settlement_batch',
      relayedEvents(`update ${s}.settlement_outbox set fanned_out = true where ${oldest('not fanned_out')}
         returning id, operation_id, source, created_at, false as fanned_out`),
    ),

    /** As takeSettlementBatch, while the unnamed handlers do not take events from their table: the rows go,
     * as their jobs on the queue `settled` are made (releases before did only this); not one a delivery
     * holds (the switch was undone under it). None once the switch is read made: settlementRelayMode read
     * the mode in a snapshot taken before it waited for the switch's lock, this statement's comes after. */
    takeSettlementBatchForQueue: statement<[limit: number, event: string]>(
      'outboxd_take_settlement_batch_for_queue',
      relayedEvents(`delete from ${s}.settlement_outbox
         where ${oldest(`(leased_until is null or leased_until < now()) and not exists (select 1 from ${s}.settlement_delivery)`)}
         returning id, operation_id, source, created_at, fanned_out`),
    ),

    /**
     * Leases the next event an unnamed handler may take for $1 seconds, fenced by its attempt: one whose
     * time has come (its insert, or the end of its backoff), that no delivery holds (a lapsed lease is
     * a delivery that died), and, while anyone is subscribed by name ($2: pg-boss's event), that the
     * relay copied to their queues already (so that consuming it never takes it from them). `lapsed`:
     * its last delivery's lease ran out with nothing recorded (its process died or stalled in the
     * handler), and it is leased for $3 seconds instead (a delivery alone waits for the others first).
     * The lease touches no indexed column: a HOT update. `orphan`: its operation does not exist.
     */
    takeSettlementEvent: statement<[leaseSeconds: number, event: string, lapsedLeaseSeconds: number]>(
      'outboxd_take_settlement_event',
      `with next as (
         select id, leased_until is not null as lapsed from ${s}.settlement_outbox
         where not_before <= now() and (leased_until is null or leased_until <= now()) and (fanned_out or not ${subscribed(2)})
         order by not_before, id limit 1 for update skip locked
       ), taken as (
         update ${s}.settlement_outbox o
         set attempts = o.attempts + 1, leased_until = now() + make_interval(secs => case when next.lapsed then $3::int else $1::int end)
         from next where o.id = next.id
         returning o.id, o.operation_id, o.source, o.attempts, o.last_error, next.lapsed
       )
       select taken.id, taken.attempts, taken.last_error, taken.lapsed, op.id is null as orphan, ${EVENT}
       from taken left join ${s}.payment_operations op on op.id = taken.operation_id`,
    ),

    /** The lease of a delivery in hand, for $3 seconds from now (0: given back, as if it had lapsed), unless
     * another took it over. */
    leaseSettlementEvent: statement<[id: number, attempt: number, seconds: number]>(
      'outboxd_lease_settlement_event',
      `update ${s}.settlement_outbox set leased_until = now() + make_interval(secs => $3::int) where id = $1 and attempts = $2 returning id`,
    ),

    /** A delivery in hand is over (handled, or dead-lettered): the event goes, unless another took it over. */
    settlementEventDone: statement<[id: number, attempt: number]>(
      'outboxd_settlement_event_done',
      `delete from ${s}.settlement_outbox where id = $1 and attempts = $2`,
    ),

    /** A delivery in hand failed: the event waits $3 seconds, unless another took it over. */
    settlementEventRetry: statement<[id: number, attempt: number, delaySeconds: number, error: string]>(
      'outboxd_settlement_event_retry',
      `update ${s}.settlement_outbox set not_before = now() + make_interval(secs => $3), leased_until = null, last_error = $4
       where id = $1 and attempts = $2`,
    ),

    /** A redriven event of the unnamed handlers, back in their table (already copied to the named
     * subscribers, who had their own); none for an operation that does not exist. */
    redriveSettlementEvent: statement<[operationId: string, source: string]>(
      'outboxd_redrive_settlement_event',
      `insert into ${s}.settlement_outbox (operation_id, source, fanned_out)
       select $1, $2, true where exists (select 1 from ${s}.payment_operations where id = $1)
       returning id`,
    ),

    /** An operation's event waiting for the unnamed handlers, as the console shows it. */
    settlementEventOf: statement<[operationId: string]>(
      'outboxd_settlement_event_of',
      `select id, created_at, attempts, greatest(not_before, leased_until) as not_before, last_error from ${s}.settlement_outbox
       where operation_id = $1 order by id`,
    ),

    /** Events waiting in the table for the unnamed handlers, and those the relay has still to take ($1:
     * pg-boss's event): to copy to named subscribers, or, before the unnamed handlers take events from
     * the table, to relay to the queue `settled`. One scan of at most DEPTH_CAP rows: the table keeps 14
     * days of events nobody takes. */
    settlementOutboxDepth: statement<[event: string]>(
      'outboxd_settlement_outbox_depth',
      `select case when d.on then c.n else 0 end as waiting,
         case when not d.on then c.n when ${subscribed(1)} then c.unfanned else 0 end as unrelayed
       from (select count(*)::int as n, (count(*) filter (where not fanned_out))::int as unfanned
             from (select fanned_out from ${s}.settlement_outbox limit ${DEPTH_CAP}) capped) c,
            (select exists (select 1 from ${s}.settlement_delivery) as on) d`,
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
     * row back means it consumed it already. `xid`: the transaction's id (the insert gave it one). */
    consumeSettlement: statement<[subscriber: string, operationId: string]>(
      'outboxd_consume_settlement',
      `insert into ${s}.settlement_consumption (subscriber, operation_id) values ($1, $2)
       on conflict (subscriber, operation_id) do nothing
       returning operation_id, pg_current_xact_id()::text as xid`,
    ),

    /** The id of the transaction the statement runs in, if it has one (null: none, or autocommit). */
    currentTransactionId: statement<[]>('outboxd_current_transaction_id', `select pg_current_xact_id_if_assigned()::text as xid`),
  };
};
