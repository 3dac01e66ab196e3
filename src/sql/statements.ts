// Every SQL statement outboxd runs against its own tables, in one place. Read top to bottom this is the
// whole data path. On outboxd's own direct connections each is a named prepared statement (parsed and
// planned once per connection: measured, about 40 % of the server's CPU per settled operation); on an
// application's connections and behind a transaction pooler they are unnamed (a pooler hands the next
// transaction to another server connection, where a name prepared earlier does not exist).
// Status writes are only ever issued by src/engine/operation.ts, the operation's state machine.
//
// The statements are built for one schema (OUTBOXD_SCHEMA) and name every table with it: some run on
// the application's own connection, inside its transaction, whose search_path is not ours. Their
// prepared-statement names carry a tag of the schema, so one connection can serve two schemas. No
// statement reads `*` of a table: a column a migration adds must not change a prepared statement's
// result type while old replicas run.
import { createHash } from 'node:crypto';
import pg from 'pg';
import type { QueryConfig } from 'pg';

export const DEFAULT_SCHEMA = 'outboxd';
/** A lower-case identifier (never needs quoting rules of its own), short enough that the pg-boss schema
 * derived from it (src/outbox/outbox.ts) stays within pg-boss's 50 bytes. */
export const SCHEMA_NAME = /^[a-z_][a-z0-9_]{0,39}$/;

const UNSETTLED = `status in ('pending', 'unknown')`;

/** payment_operations' columns (src/db/schema.ts), named in every statement that reads them whole: a
 * statement prepared before a migration adds a column keeps its result type, where `*` would change it
 * under a warm connection (0A000 cached plan must not change result type). */
const OPERATION_COLUMNS = [
  'id', 'order_id', 'kind', 'policy', 'amount', 'currency', 'customer_id', 'payment_method', 'metadata', 'status',
  'external_id', 'attempts', 'first_attempted_at', 'last_attempted_at', 'last_error', 'last_outcome', 'review_reason',
  'needs_review', 'settled_at', 'fence', 'lease_owner', 'lease_expires_at', 'traceparent', 'parent_operation_id',
  'effect_key', 'payload', 'result', 'possible_duplicates', 'created_at', 'updated_at',
] as const;
export const operationColumns = (alias?: string): string => OPERATION_COLUMNS.map((c) => (alias ? `${alias}.${c}` : c)).join(', ');

const INT8 = 20;
/** bigint columns (amount, fence) hold values far below 2^53: read as numbers, on any connection (an
 * application's own pool included) without changing how that connection parses its own columns. */
export const resultTypes = {
  getTypeParser: ((oid: number, format?: 'text' | 'binary') =>
    oid === INT8 ? Number : pg.types.getTypeParser(oid, format)) as typeof pg.types.getTypeParser,
};

/** pg-boss's schema for an outboxd schema: `pgboss` for the default one, its own for any other, so two
 * outboxd schemas in one database never share queues. */
export const bossSchemaFor = (schema: string): string => (schema === DEFAULT_SCHEMA ? 'pgboss' : `pgboss_${schema}`);

export type Statements = ReturnType<typeof build>;

const built = new Map<string, Statements>();

/** The statements for `schema` (a lower-case identifier, as config.ts validates OUTBOXD_SCHEMA);
 * `prepared`: named, for outboxd's own direct connections, or unnamed (see above). */
export function statementsFor(schema: string, prepared = false): Statements {
  const key = `${schema}:${prepared}`;
  let statements = built.get(key);
  if (!statements) built.set(key, (statements = build(schema, prepared)));
  return statements;
}

function build(schema: string, prepared: boolean) {
  if (!SCHEMA_NAME.test(schema)) throw new Error(`not a schema name outboxd accepts: ${JSON.stringify(schema)}`);
  const s = `"${schema}"`;
  const boss = `"${bossSchemaFor(schema)}"`;
  // PostgreSQL compares prepared-statement names on their first 63 bytes: a short tag, not the name.
  const tag = createHash('sha256').update(schema).digest('hex').slice(0, 8);
  /** The CTE that records a settlement's event beside the update `op` that settled it; `source` is its parameter. */
  const settlementEvent = (source: string) => `event as (
         insert into ${s}.settlement_outbox (operation_id, source)
         select id, ${source}::text from op where status in ('succeeded', 'failed')
       )`;
  const statement =
    <A extends unknown[]>(name: string, text: string) =>
    (...values: A): QueryConfig => ({ ...(prepared ? { name: `${name}_${tag}` } : {}), text, values, types: resultTypes });
  /**
   * Data-modifying CTEs that add to the operation's timeline, one row per row of `from`: `columns` selects
   * operation_id, type, fence, actor, details. A refusal that repeats (the same flag, or an outcome that
   * executed nothing or only read, with the same details but for the attempt, duration and request id,
   * as the operation's latest event of its type) counts on that row instead (repeats, last_at). A repeated
   * outcome's claim and call, which executed nothing, go with it: a revoked key retried every 30 s, a 429
   * loop, a sweep that flags the same operation each run leave one row, not one a round.
   */
  const event = (from: string, columns: string) => {
    const same = (d: string) => `(${d} - 'attempt' - 'duration_ms' - 'request_id')`;
    return `${from}_ev as (
         select c1::uuid as operation_id, c2::text as type, c3::bigint as fence, c4::text as actor, c5::jsonb as details,
           row_number() over () as ord
         from (select ${columns} from ${from}) raw (c1, c2, c3, c4, c5)
       ), ${from}_repeat as (
         select n.operation_id, n.type, n.fence, last.id
         from ${from}_ev n
         cross join lateral (
           select l.id, l.details from ${s}.operation_events l
           where l.operation_id = n.operation_id and l.type = n.type order by l.id desc limit 1
         ) last
         where (n.type = 'flagged' or (n.type = 'outcome' and (n.details->>'outcome' in ('rate_limited', 'not_executed') or n.details->>'call' <> 'create')))
           and ${same('last.details')} = ${same('n.details')}
       ), ${from}_counted as (
         update ${s}.operation_events e set repeats = e.repeats + 1, last_at = now() from ${from}_repeat r where e.id = r.id
       ), ${from}_cycle as (
         delete from ${s}.operation_events e using ${from}_repeat r
         where r.type = 'outcome' and e.operation_id = r.operation_id and e.fence = r.fence and e.type in ('claimed', 'sent') and e.id > r.id
       ), ${from}_event as (
         insert into ${s}.operation_events (operation_id, type, fence, actor, details)
         select n.operation_id, n.type, n.fence, n.actor, n.details from ${from}_ev n
         where not exists (select 1 from ${from}_repeat r where r.operation_id = n.operation_id and r.type = n.type)
         order by n.ord
       )`;
  };
  /** An operation's keyset cursor: created_at to the microsecond (a JavaScript Date keeps milliseconds). */
  const CURSOR = `to_char(o.created_at at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`;
  const operationsPage = (cmp: '<' | '>', dir: 'asc' | 'desc') =>
    `select ${operationColumns('o')}, ${CURSOR} as cursor_at
     from unnest($1::text[]) k(kind) cross join unnest($2::text[]) st(status)
     cross join lateral (
       select ${operationColumns('p')} from ${s}.payment_operations p
       where p.kind = k.kind and p.status = st.status and (p.created_at, p.id) ${cmp} ($3::timestamptz, $4::uuid)
       order by p.created_at ${dir}, p.id ${dir}
       limit $5
     ) o
     order by o.created_at ${dir}, o.id ${dir}
     limit $5`;
  const reviewPage = (cmp: '<' | '>', dir: 'asc' | 'desc') =>
    `select ${operationColumns('o')}, ${CURSOR} as cursor_at from ${s}.payment_operations o
     where o.review_reason is not null and o.kind = any($1::text[]) and o.status = any($2::text[])
       and (o.created_at, o.id) ${cmp} ($3::timestamptz, $4::uuid)
     order by o.created_at ${dir}, o.id ${dir}
     limit $5`;

  return {
    // ─── orders ────────────────────────────────────────────────────────────────────────────────────────

    insertOrder: statement<[id: string, amount: number, currency: string, customer: string, pm: string]>(
      'outboxd_insert_order',
      `insert into ${s}.orders (id, amount, currency, customer_id, payment_method) values ($1, $2, $3, $4, $5)
       on conflict (id) do nothing`,
    ),

    /** The example's settlement subscriber (`order follow`): paid is final; a failed charge's event leaves
     * an order another card already paid as it is. */
    markOrderSettled: statement<[id: string, status: 'paid' | 'payment_failed']>(
      'outboxd_mark_order_settled',
      `update ${s}.orders set status = $2, updated_at = now() where id = $1 and status <> 'paid'`,
    ),

    // ─── the outbox: written with the operation, relayed to pg-boss in batches ─────────────────────────

    outboxHasRows: statement<[]>('outboxd_outbox_has_rows', `select exists (select 1 from ${s}.charge_outbox) as any`),

    /** Takes the oldest rows no other relay holds; deleting them in the job-creating transaction is the mark.
     * Each operation's timeline records the relay in the same statement. */
    takeOutboxBatch: statement<[limit: number]>(
      'outboxd_take_outbox_batch',
      `with taken as (
       delete from ${s}.charge_outbox
       where id in (select id from ${s}.charge_outbox order by id limit $1 for update skip locked)
       returning operation_id, traceparent, kind
       ), ${event('taken', `operation_id, 'relayed', null, null, '{}'`)}
       select operation_id, traceparent, kind from taken`,
    ),

    outboxRowFor: statement<[operationId: string]>(
      'outboxd_outbox_row_for',
      `select id, created_at from ${s}.charge_outbox where operation_id = $1 order by id limit 1`,
    ),

    outboxDepth: statement<[]>('outboxd_outbox_depth', `select count(*)::int as rows from ${s}.charge_outbox`),

    // ─── settlement events: written by the statement that settles, relayed like the charge outbox ─────

    settlementOutboxHasRows: statement<[]>(
      'outboxd_settlement_outbox_has_rows',
      `select exists (select 1 from ${s}.settlement_outbox) as any`,
    ),

    /** Takes the oldest events no other relay holds, with what they say (the settled operation's fields). */
    takeSettlementBatch: statement<[limit: number]>(
      'outboxd_take_settlement_batch',
      `with taken as (
         delete from ${s}.settlement_outbox
         where id in (select id from ${s}.settlement_outbox order by id limit $1 for update skip locked)
         returning id, operation_id, source
       )
       select op.id as operation_id, op.order_id, op.kind, op.effect_key, op.status, op.external_id, op.amount, op.currency,
              op.settled_at, taken.source, op.traceparent
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

    // ─── payment operations: creation and reads ────────────────────────────────────────────────────────

    /**
     * A charge operation and its outbox row, in ONE statement: both are written or neither, on whatever
     * connection runs it (the caller's, inside its transaction). A first request ($7 false) creates only
     * when the order has no charge operation at all; a new attempt ($7 true) only while none is live,
     * which the partial unique index enforces against concurrent requests too. No row: nothing created.
     * $8: the request's W3C traceparent (null when untraced), kept on both rows.
     */
    insertChargeOperation: statement<
      [orderId: string, amount: number, currency: string, customer: string, pm: string, metadata: string, newAttempt: boolean, traceparent: string | null]
    >(
      'outboxd_insert_charge_operation',
      `with op as (
         insert into ${s}.payment_operations (order_id, kind, amount, currency, customer_id, payment_method, metadata, traceparent)
         select $1::text, 'charge', $2::bigint, $3::text, $4::text, $5::text, $6::jsonb, $8::text
         where $7::boolean or not exists (select 1 from ${s}.payment_operations where order_id = $1::text and kind = 'charge')
         on conflict (order_id) where kind = 'charge' and status <> 'failed' do nothing
         returning id, traceparent
       ), outbox as (
         insert into ${s}.charge_outbox (operation_id, traceparent) select id, traceparent from op
       )
       select id from op`,
    ),

    /**
     * The first step of a refund request, in the caller's transaction: a succeeded charge operation,
     * locked by an update (of nothing) until the caller commits, so that concurrent refund requests of
     * one charge are decided one after the other. An update, not only a lock: under REPEATABLE READ a
     * request that waited on a mere lock would go on reading the refunds committed before it began;
     * an updated row makes it fail instead. No row: no such charge, or it has not succeeded.
     */
    lockChargeForRefund: statement<[chargeOperationId: string]>(
      'outboxd_lock_charge_for_refund',
      `update ${s}.payment_operations set updated_at = updated_at
       where id = $1 and kind = 'charge' and status = 'succeeded'
       returning id`,
    ),

    /**
     * The refund operation and its outbox row, in ONE statement (after lockChargeForRefund, so it reads
     * every refund of the charge committed before): created only when no refund of the charge has this
     * key and the amount fits in what remains unrefunded, counting every refund that has not failed
     * (pending and unknown ones may still succeed). Always one row: what it decided from.
     */
    insertRefundOperation: statement<[chargeOperationId: string, amount: number, key: string, reason: string | null, traceparent: string | null]>(
      'outboxd_insert_refund_operation',
      `with charge as (
         select id, order_id, amount, currency, external_id from ${s}.payment_operations
         where id = $1 and kind = 'charge' and status = 'succeeded'
       ), existing as (
         select id, amount, payload->>'reason' as reason from ${s}.payment_operations
         where kind = 'refund' and parent_operation_id = $1 and effect_key = $3
       ), spent as (
         select coalesce(sum(amount), 0)::bigint as spent from ${s}.payment_operations
         where kind = 'refund' and parent_operation_id = $1 and status <> 'failed'
       ), op as (
         insert into ${s}.payment_operations (order_id, kind, amount, currency, parent_operation_id, effect_key, payload, traceparent)
         select charge.order_id, 'refund', $2::bigint, charge.currency, charge.id, $3::text,
                jsonb_build_object('payment_intent', charge.external_id, 'reason', $4::text), $5::text
         from charge, spent
         where not exists (select 1 from existing) and spent.spent + $2::bigint <= charge.amount
         on conflict (parent_operation_id, effect_key) where kind = 'refund' do nothing
         returning id, traceparent
       ), outbox as (
         insert into ${s}.charge_outbox (operation_id, kind, traceparent) select id, 'refund', traceparent from op
       )
       select (select id from op) as created_id, existing.id as existing_id, existing.amount as existing_amount,
              existing.reason as existing_reason, spent.spent, charge.amount as charge_amount
       from spent left join charge on true left join existing on true`,
    ),

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

    /** Every charge operation of an order, newest first. */
    chargeOperationsOfOrder: statement<[orderId: string]>(
      'outboxd_charge_operations_of_order',
      `select ${operationColumns()} from ${s}.payment_operations where order_id = $1 and kind = 'charge' order by created_at desc, id`,
    ),

    /** The operation, with whether its idempotency key window (seconds from first_attempted_at) has passed,
     * judged by the database clock so that every replica agrees. */
    loadOperation: statement<[id: string, keyWindowSeconds: number]>(
      'outboxd_load_operation',
      `select ${operationColumns()}, coalesce(first_attempted_at < now() - make_interval(secs => $2), false) as key_window_passed
       from ${s}.payment_operations where id = $1`,
    ),

    // ─── lease and fence (docs/architecture.md §3) ─────────────────────────────────────────────────────

    /** Takes the lease if it is free or expired; every claim gets a strictly larger fencing token. A row
     * another transaction holds (an application's `select … for update`) is skipped, not waited for: no row.
     * Returns the claimed operation as loadOperation does (the executor needs no second read), and
     * previous_owner when an expired lease was taken over (its holder died or stalled). The timeline
     * records the claim in the same statement. */
    acquireLease: statement<[id: string, owner: string, ttlMs: number, keyWindowSeconds: number]>(
      'outboxd_acquire_lease',
      `with prev as (select id, lease_owner from ${s}.payment_operations where id = $1 for update skip locked), claimed as (
       update ${s}.payment_operations op
       set fence = op.fence + 1, lease_owner = $2, lease_expires_at = now() + make_interval(secs => $3 / 1000.0),
           updated_at = now()
       from prev
       where op.id = prev.id and op.${UNSETTLED} and (op.lease_expires_at is null or op.lease_expires_at < now())
       returning ${operationColumns('op')}, prev.lease_owner as previous_owner,
         coalesce(op.first_attempted_at < now() - make_interval(secs => $4), false) as key_window_passed
       ), ${event('claimed', `id, 'claimed', fence, lease_owner, jsonb_strip_nulls(jsonb_build_object('previous_owner', previous_owner))`)}
       select * from claimed`,
    ),

    /**
     * The dispatcher's claims, each with the attempt of the call it leads to, many operations in ONE
     * statement: each a claim as acquireLease makes, that also counts the call the kind's policy chooses
     * for what the row holds, and stamps it as recordAttempt does (a create: first_attempted_at once,
     * last_attempted_at now, the stamps before returned for an undo; an at-least-once create after one that
     * may have acted counted as a possible duplicate). $7: the policy's call for each combination of the
     * row's facts, indexed 1 + 4 × (external_id known) + 2 × (key window passed) + (attempted before), for
     * kind $5 under policy $6; a row of another kind or requested under another policy is claimed without
     * an attempt (call null), and the executor chooses and counts, or holds it for a person, as for any
     * claim. A row another transaction holds (an application's `select … for update`) is skipped, not
     * waited for, and an id asked twice is claimed for its first request only. The timeline records each claim and its call as
     * sent, in that order. One row per request, in order: `id` is null when nothing was claimed for it
     * (settled, leased by a live claim, locked: `locked`, or no such operation), and current_* say what the
     * row holds (read without its lock when another transaction holds it).
     */
    claimAttempts: statement<
      [ids: readonly string[], owner: string, ttlMs: number, keyWindowSeconds: number, kind: string, policy: string, calls: readonly string[]]
    >(
      'outboxd_claim_attempts',
      `with req as (
         select r.id, r.ord, row_number() over (partition by r.id order by r.ord) = 1 as first
         from unnest($1::uuid[]) with ordinality r(id, ord)
       ), prev as (
         select op.id, op.kind, op.status, op.lease_owner, op.first_attempted_at, op.last_attempted_at,
           w.passed as key_window_passed,
           case when op.kind = $5 and op.policy = $6 then
             ($7::text[])[1 + 4 * (op.external_id is not null)::int + 2 * w.passed::int + (op.first_attempted_at is not null)::int]
           end as call
         from ${s}.payment_operations op
         cross join lateral (select coalesce(op.first_attempted_at < now() - make_interval(secs => $4), false) as passed) w
         where op.id = any($1::uuid[])
         order by op.id
         for update of op skip locked
       ), claimed as (
         update ${s}.payment_operations op
         set fence = op.fence + 1, lease_owner = $2, lease_expires_at = now() + make_interval(secs => $3 / 1000.0),
             updated_at = now(),
             attempts = op.attempts + (prev.call is not null)::int,
             first_attempted_at = case when prev.call = 'create' then coalesce(op.first_attempted_at, now()) else op.first_attempted_at end,
             last_attempted_at = case when prev.call = 'create' then now() else op.last_attempted_at end,
             possible_duplicates = op.possible_duplicates
               + coalesce(prev.call = 'create' and $6 = 'at-least-once' and op.first_attempted_at is not null, false)::int
         from prev
         where op.id = prev.id and op.${UNSETTLED} and (op.lease_expires_at is null or op.lease_expires_at < now())
         returning ${operationColumns('op')}, prev.lease_owner as previous_owner, prev.key_window_passed, prev.call,
           prev.first_attempted_at as prev_first_attempted_at, prev.last_attempted_at as prev_last_attempted_at
       ), steps as (
         select id, e.type, fence, e.actor, e.details from claimed cross join lateral (values
           (1, 'claimed', lease_owner, jsonb_strip_nulls(jsonb_build_object('previous_owner', previous_owner))),
           (2, 'sent', null, jsonb_build_object('call', call, 'attempt', attempts))
         ) e(step, type, actor, details)
         where e.type = 'claimed' or call is not null
         order by id, e.step
       ), ${event('steps', 'id, type, fence, actor, details')}
       select mine.*, coalesce(prev.status, cur.status) as current_status,
         coalesce(won.lease_owner, prev.lease_owner, cur.lease_owner) as current_owner, prev.id is null and cur.id is not null as locked
       from req
       left join ${s}.payment_operations cur on cur.id = req.id
       left join prev on prev.id = req.id
       left join claimed won on won.id = req.id
       left join claimed mine on mine.id = req.id and req.first
       order by req.ord`,
    ),

    renewLease: statement<[id: string, fence: number, ttlMs: number]>(
      'outboxd_renew_lease',
      `update ${s}.payment_operations set lease_expires_at = now() + make_interval(secs => $3 / 1000.0)
       where id = $1 and fence = $2 and lease_owner is not null
       returning lease_expires_at`,
    ),

    releaseLease: statement<[id: string, fence: number]>(
      'outboxd_release_lease',
      `update ${s}.payment_operations set lease_owner = null, lease_expires_at = null
       where id = $1 and fence = $2 and lease_owner is not null`,
    ),

    /** At shutdown: gives back every lease this replica still holds but those of calls still in flight
     * ($2), so others need not wait for expiry. */
    releaseLeasesOf: statement<[owner: string, inFlight: readonly string[]]>(
      'outboxd_release_leases_of',
      `update ${s}.payment_operations set lease_owner = null, lease_expires_at = null
       where lease_owner = $1 and id <> all($2::uuid[])
       returning id`,
    ),

    // ─── the executor's fenced writes ──────────────────────────────────────────────────────────────────

    /** Counts a call before it is made; for a create, records first_attempted_at (the first send,
     * invariant 7) and last_attempted_at before the send, returning what they were, so that an outcome that
     * proves nothing executed can put them back. $4: an at-least-once kind, whose create after one that
     * may have acted (first_attempted_at already set) is counted as a possible duplicate. Zero rows: the
     * fence moved or the operation settled, and the call must not be made. The timeline records the call
     * as sent: one whose outcome never follows was in flight when its worker died or lost the lease. */
    recordAttempt: statement<[id: string, fence: number, call: string, atLeastOnce: boolean]>(
      'outboxd_record_attempt',
      `with prev as (select first_attempted_at, last_attempted_at from ${s}.payment_operations where id = $1), attempt as (
       update ${s}.payment_operations
       set attempts = attempts + 1, updated_at = now(),
           first_attempted_at = case when $3 = 'create' then coalesce(first_attempted_at, now()) else first_attempted_at end,
           last_attempted_at = case when $3 = 'create' then now() else last_attempted_at end,
           possible_duplicates = possible_duplicates + case when $3 = 'create' and $4 and first_attempted_at is not null then 1 else 0 end
       where id = $1 and fence = $2 and ${UNSETTLED}
       returning attempts, first_attempted_at,
         (select first_attempted_at from prev) as prev_first_attempted_at,
         (select last_attempted_at from prev) as prev_last_attempted_at
       ), ${event('attempt', `$1, 'sent', $2, null, jsonb_build_object('call', $3::text, 'attempt', attempts)`)}
       select * from attempt`,
    ),

    /** Writes outcomes, each ending its claim's lease, many operations in ONE statement ($1: a JSON array,
     * one object per outcome with the fields below). Never touches a settled operation (invariant 5) and
     * only with the claim's current fence (invariant 8). settled_at is set exactly when the new status is
     * settled, and then, in the same statement, its settlement event (`source`: what settled it). `undo`:
     * the call provably executed nothing (a 429, 401/403, a connection never opened), so the attempt stamps
     * go back to first_attempted_at/last_attempted_at: a window that only such calls opened is not open (or
     * a check found that no earlier execution happened: they go back to null). `event`: what the timeline
     * keeps of the call (its outcome, duration, Stripe's request id), written by the same statement.
     * `result`: an application effect's (JSON). One row per outcome, in order: `id` is null when the fence
     * moved or the operation had settled, and current_* say what it holds. */
    recordOutcomes: statement<[outcomes: string]>(
      'outboxd_record_outcomes',
      `with input as (
         select * from jsonb_to_recordset($1::jsonb) as x(
           ord int, id uuid, fence bigint, status text, external_id text, last_outcome text, last_error text,
           review_reason text, undo boolean, first_attempted_at timestamptz, last_attempted_at timestamptz,
           source text, event jsonb, result text)
       ), op as (
       update ${s}.payment_operations o
       set status = x.status, external_id = coalesce(x.external_id, o.external_id), last_outcome = x.last_outcome,
           last_error = x.last_error,
           -- a review reason stays until the operation settles (a later ambiguous retry does not clear it)
           review_reason = case when x.status in ('succeeded', 'failed') then null else coalesce(x.review_reason, o.review_reason) end,
           first_attempted_at = case when x.undo then x.first_attempted_at else o.first_attempted_at end,
           last_attempted_at = case when x.undo then x.last_attempted_at else o.last_attempted_at end,
           result = coalesce(x.result::jsonb, o.result),
           updated_at = now(), lease_owner = null, lease_expires_at = null,
           settled_at = case when x.status in ('succeeded', 'failed') then now() end
       from input x
       where o.id = x.id and o.fence = x.fence and o.${UNSETTLED}
       returning ${operationColumns('o')}, x.ord, x.source, x.event
       ), settled_event as (
         insert into ${s}.settlement_outbox (operation_id, source)
         select id, source from op where status in ('succeeded', 'failed') order by ord
       ), ${event('op', `id, 'outcome', fence, null, event`)}
       select op.*, cur.fence as current_fence, cur.status as current_status
       from input
       left join op on op.ord = input.ord
       left join ${s}.payment_operations cur on cur.id = input.id
       order by input.ord`,
    ),

    /** Fenced: holds an unsettled operation for a person without changing its status; ends the claim. */
    flagForReview: statement<[id: string, fence: number, reason: string]>(
      'outboxd_flag_for_review',
      `with flagged as (
       update ${s}.payment_operations set review_reason = $3, updated_at = now(), lease_owner = null, lease_expires_at = null
       where id = $1 and fence = $2 and ${UNSETTLED}
       returning ${operationColumns()}
       ), ${event('flagged', `id, 'flagged', $2, null, jsonb_build_object('reason', $3::text)`)}
       select * from flagged`,
    ),

    fenceOf: statement<[id: string]>(
      'outboxd_fence_of',
      `select fence, status, lease_owner from ${s}.payment_operations where id = $1`,
    ),

    // ─── settlement from outside the executor: a person (admin resolve) or a Stripe webhook ───────────

    /** Settles an unsettled operation and bumps the fence, so a worker still holding a claim is fenced out;
     * its settlement event ($6: what settled it) in the same statement. */
    settleFromOutside: statement<
      [id: string, status: 'succeeded' | 'failed', externalId: string | null, lastOutcome: string, lastError: string | null, source: string]
    >(
      'outboxd_settle_from_outside',
      `with op as (
       update ${s}.payment_operations
       set fence = fence + 1, lease_owner = null, lease_expires_at = null,
           status = $2, external_id = coalesce($3, external_id), last_outcome = $4, last_error = $5,
           review_reason = null, settled_at = now(), updated_at = now()
       where id = $1 and ${UNSETTLED}
       returning ${operationColumns()}
       ), ${settlementEvent('$6')},
       ${event('op', `id, 'settled', fence, last_outcome, jsonb_strip_nulls(jsonb_build_object('status', status, 'external_id', external_id, 'reason', last_error))`)}
       select * from op`,
    ),

    /** A person's resolution, written under the lease the resolution holds: fenced like any claim, so it
     * cannot land after another claim took the operation over; its settlement event in the same statement. */
    settleUnderLease: statement<
      [id: string, fence: number, status: 'succeeded' | 'failed', externalId: string | null, lastOutcome: string, lastError: string | null]
    >(
      'outboxd_settle_under_lease',
      `with op as (
       update ${s}.payment_operations
       set lease_owner = null, lease_expires_at = null,
           status = $3, external_id = coalesce($4, external_id), last_outcome = $5, last_error = $6,
           review_reason = null, settled_at = now(), updated_at = now()
       where id = $1 and fence = $2 and ${UNSETTLED}
       returning ${operationColumns()}
       ), ${settlementEvent("'admin'")},
       ${event('op', `id, 'settled', fence, last_outcome, jsonb_strip_nulls(jsonb_build_object('status', status, 'external_id', external_id, 'reason', last_error))`)}
       select * from op`,
    ),

    /** How long ago the last create that may have executed was sent, by the database clock (null: never). */
    lastAttemptAge: statement<[id: string]>(
      'outboxd_last_attempt_age',
      `select extract(epoch from now() - coalesce(last_attempted_at, first_attempted_at))::float8 as age_seconds
       from ${s}.payment_operations where id = $1`,
    ),

    insertAudit: statement<[actor: string, action: string, operationId: string | null, details: string]>(
      'outboxd_insert_audit',
      `insert into ${s}.admin_audit (actor, action, operation_id, details) values ($1, $2, $3, $4::jsonb) returning id`,
    ),

    insertWebhookEvent: statement<[id: string, type: string, operationId: string | null, result: string, payload: string]>(
      'outboxd_insert_webhook_event',
      `insert into ${s}.webhook_events (id, type, operation_id, result, payload) values ($1, $2, $3, $4, $5::jsonb)
       on conflict (id) do nothing
       returning id`,
    ),

    webhookEventSeen: statement<[id: string]>(
      'outboxd_webhook_event_seen',
      `select 1 as seen from ${s}.webhook_events where id = $1`,
    ),

    /** Stored events are kept for deduplication and evidence, not forever. */
    pruneWebhookEvents: statement<[retentionDays: number]>(
      'outboxd_prune_webhook_events',
      `delete from ${s}.webhook_events where received_at < now() - make_interval(days => $1)`,
    ),

    /**
     * One batch of the timeline's retention (src/outbox/retention.ts): the $3 oldest rows after id $2, of which
     * those last seen over $1 days ago, of an operation settled over $1 days ago, are deleted. An
     * unsettled operation's history (held for review, or still being driven) is kept whatever its age.
     * Rows are scanned in id order (the primary key), so a batch reads $3 rows, however large the table;
     * reached_window: the batch's last row is inside the window, and so is every later one (ids and times
     * grow together).
     */
    pruneOperationEvents: statement<[retentionDays: number, afterId: number, scan: number]>(
      'outboxd_prune_operation_events',
      `with scanned as (
         select id, operation_id, coalesce(last_at, at) as seen from ${s}.operation_events where id > $2 order by id limit $3
       ), gone as (
         delete from ${s}.operation_events e
         using scanned sc join ${s}.payment_operations o on o.id = sc.operation_id
         where e.id = sc.id and sc.seen < now() - make_interval(days => $1) and o.settled_at < now() - make_interval(days => $1)
         returning e.id
       )
       select (select max(id) from scanned) as last_id, (select count(*)::int from gone) as deleted,
         coalesce((select seen >= now() - make_interval(days => $1) from scanned order by id desc limit 1), true) as reached_window`,
    ),

    /** The audit trail's retention, as pruneOperationEvents: an action about an unsettled operation is kept. */
    pruneAdminAudit: statement<[retentionDays: number, afterId: number, scan: number]>(
      'outboxd_prune_admin_audit',
      `with scanned as (
         select id, operation_id, at from ${s}.admin_audit where id > $2 order by id limit $3
       ), gone as (
         delete from ${s}.admin_audit a
         using scanned sc left join ${s}.payment_operations o on o.id = sc.operation_id
         where a.id = sc.id and sc.at < now() - make_interval(days => $1)
           and (sc.operation_id is null or o.settled_at < now() - make_interval(days => $1))
         returning a.id
       )
       select (select max(id) from scanned) as last_id, (select count(*)::int from gone) as deleted,
         coalesce((select at >= now() - make_interval(days => $1) from scanned order by id desc limit 1), true) as reached_window`,
    ),

    /** Holds an unsettled operation for a person from outside any claim (a webhook that contradicts it).
     * The status is not touched, so no fence is needed; a later outcome keeps the reason unless it settles. */
    flagFromOutside: statement<[id: string, reason: string]>(
      'outboxd_flag_from_outside',
      `with flagged as (
       update ${s}.payment_operations set review_reason = $2, updated_at = now()
       where id = $1 and ${UNSETTLED}
       returning id
       ), ${event('flagged', `id, 'flagged', null, null, jsonb_build_object('reason', $2::text)`)}
       select id from flagged`,
    ),

    /** Serialises admin re-drives of one operation (check for a live job, then enqueue). */
    lockOperationForRequeue: statement<[id: string]>(
      'outboxd_lock_operation_for_requeue',
      `select pg_advisory_xact_lock(hashtextextended('outboxd-requeue:' || $1, 0))`,
    ),

    // ─── reconciliation ────────────────────────────────────────────────────────────────────────────────

    /** What the reconcile sweep may decide, of the kinds it reconciles through the provider ($3): a known
     * object to retrieve, a key window that has passed, or an operation held for review after an attempt
     * that may have acted (searched read-only inside the window too: a dead-lettered job drives it no
     * more). Other operations inside the window without an external id are the dispatcher's, and leased
     * ones are busy. */
    reconcileCandidates: statement<[keyWindowSeconds: number, limit: number, kinds: readonly string[]]>(
      'outboxd_reconcile_candidates',
      `select id from ${s}.payment_operations
       where ${UNSETTLED} and kind = any($3::text[])
         and (external_id is not null
              or first_attempted_at < now() - make_interval(secs => $1)
              or (review_reason is not null and first_attempted_at is not null))
         and (lease_expires_at is null or lease_expires_at < now())
       order by updated_at
       limit $2`,
    ),

    /** Unsettled, unflagged operations of any kind untouched for a while with no lease, nothing in the
     * outbox and no live job in their kind's queue or its dead letter (src/outbox/outbox.ts: queueFor,
     * deadQueueFor; one anti-join over pg-boss's job table, so a large backlog of queued jobs costs one
     * scan): the sweep claims each, checks again for a live job, and flags one that nothing drives. */
    undrivenCandidates: statement<[idleSeconds: number, limit: number]>(
      'outboxd_undriven_candidates',
      `select id from ${s}.payment_operations op
       where ${UNSETTLED} and review_reason is null
         and (lease_expires_at is null or lease_expires_at < now())
         and updated_at < now() - make_interval(secs => $1)
         and not exists (select 1 from ${s}.charge_outbox o where o.operation_id = op.id)
         and not exists (
           select 1 from ${boss}.job j
           where j.name in (op.kind, op.kind || '_dead') and j.state in ('created', 'retry', 'active') and j.data->>'operationId' = op.id::text)
       order by updated_at
       limit $2`,
    ),

    /** Unsettled operations untouched for a while: candidates for `requeue --stuck`. */
    stuckOperations: statement<[olderThanSeconds: number, limit: number]>(
      'outboxd_stuck_operations',
      `select ${operationColumns()} from ${s}.payment_operations
       where ${UNSETTLED} and updated_at < now() - make_interval(secs => $1)
       order by updated_at
       limit $2`,
    ),

    operationsByIds: statement<[ids: string[]]>(
      'outboxd_operations_by_ids',
      `select ${operationColumns()} from ${s}.payment_operations where id = any($1::uuid[])`,
    ),

    /** Operations of a kind known to the provider by these ids (the drift report's refunds of our charges). */
    operationsByExternalIds: statement<[kind: string, externalIds: string[]]>(
      'outboxd_operations_by_external_ids',
      `select ${operationColumns()} from ${s}.payment_operations where kind = $1 and external_id = any($2::text[])`,
    ),

    /** Succeeded operations settled since a time: each must have its charge (refund) in Stripe. */
    succeededSince: statement<[since: Date]>(
      'outboxd_succeeded_since',
      `select ${operationColumns()} from ${s}.payment_operations where status = 'succeeded' and settled_at >= $1`,
    ),

    // ─── the console (src/console/): sessions, and the reads behind its pages ─────────────────────────

    /** A session ends when idle for idleSeconds, and ttlSeconds after it began at the latest. */
    insertConsoleSession: statement<[id: string, operator: string, csrfToken: string, fingerprint: string, ttlSeconds: number, idleSeconds: number]>(
      'outboxd_insert_console_session',
      `insert into ${s}.console_sessions (id, operator, csrf_token, token_fingerprint, expires_at)
       values ($1, $2, $3, $4, now() + make_interval(secs => least($5::float8, $6::float8)))
       returning expires_at`,
    ),

    /** A live session begun with a token in force now (one of `fingerprints`), within ttlSeconds of its
     * start: its idle end moves on. */
    touchConsoleSession: statement<[id: string, fingerprints: string[], ttlSeconds: number, idleSeconds: number]>(
      'outboxd_touch_console_session',
      `update ${s}.console_sessions
       set expires_at = least(created_at + make_interval(secs => $3), now() + make_interval(secs => $4))
       where id = $1 and token_fingerprint = any($2::text[]) and expires_at > now() and created_at + make_interval(secs => $3) > now()
       returning operator, csrf_token, token_fingerprint, expires_at`,
    ),

    deleteConsoleSession: statement<[id: string]>(
      'outboxd_delete_console_session',
      `delete from ${s}.console_sessions where id = $1`,
    ),

    deleteAllConsoleSessions: statement<[]>(
      'outboxd_delete_all_console_sessions',
      `delete from ${s}.console_sessions`,
    ),

    /** Each subject's row, made if missing (a statement of its own: the lock's snapshot must see it). */
    ensureSignInSubjects: statement<[subjects: string[]]>(
      'outboxd_ensure_sign_in_subjects',
      `insert into ${s}.console_sign_in_failures (subject, failures) select unnest($1::text[]), 0
       on conflict (subject) do nothing`,
    ),

    /** Each subject's row, locked for the rest of the transaction, with the seconds it must still wait;
     * refused at once (55P03) when another check holds one. */
    lockSignInSubjects: statement<[subjects: string[]]>(
      'outboxd_lock_sign_in_subjects',
      `select subject, greatest(0, ceil(extract(epoch from blocked_until - now())))::int as wait_seconds
       from ${s}.console_sign_in_failures where subject = any($1::text[])
       order by subject for update nowait`,
    ),

    /**
     * A wrong token, counted for each (locked) subject while its failures are recent: the first within
     * windowSeconds, or a wait that ended within it. From the limit-th on, the subject waits
     * blockSeconds, doubled with each further failure, up to maxBlockSeconds.
     */
    recordSignInFailure: statement<[subjects: string[], limit: number, windowSeconds: number, blockSeconds: number, maxBlockSeconds: number]>(
      'outboxd_record_sign_in_failure',
      (() => {
        const window = `now() - make_interval(secs => $3::float8)`;
        const recent = `(f.failures > 0 and (f.first_failed_at > ${window} or f.blocked_until > ${window}))`;
        const failures = `(case when ${recent} then f.failures + 1 else 1 end)`;
        return `update ${s}.console_sign_in_failures f set
         failures = ${failures},
         first_failed_at = case when ${recent} then f.first_failed_at else now() end,
         blocked_until = case when ${failures} >= $2::int
           then now() + make_interval(secs => least($4::float8 * power(2, least(${failures} - $2::int, 16)), $5::float8))
           else f.blocked_until end
       where f.subject = any($1::text[])
       returning greatest(0, ceil(extract(epoch from f.blocked_until - now())))::int as wait_seconds`;
      })(),
    ),

    /** Subjects whose failures count for nothing any more: none within the window, no wait that ended within it. */
    pruneSignInFailures: statement<[windowSeconds: number]>(
      'outboxd_prune_sign_in_failures',
      `delete from ${s}.console_sign_in_failures
       where first_failed_at < now() - make_interval(secs => $1::float8)
         and (blocked_until is null or blocked_until < now() - make_interval(secs => $1::float8))`,
    ),


    pruneConsoleSessions: statement<[]>(
      'outboxd_prune_console_sessions',
      `delete from ${s}.console_sessions where expires_at <= now()`,
    ),

    // The overview's charts: one row a minute since $1. Each reads only the window (the settled index,
    // the unsettled index, the timeline's BRIN index), so they cost what the window holds, not the table.

    /** Settlements by outcome, and confirm → settled latency, a minute at a time. */
    settlementsByMinute: statement<[from: Date]>(
      'outboxd_settlements_by_minute',
      `select date_trunc('minute', settled_at) as minute,
         count(*) filter (where status = 'succeeded')::int as succeeded,
         count(*) filter (where status = 'failed')::int as failed,
         percentile_cont(0.5) within group (order by extract(epoch from settled_at - created_at)) * 1000 as p50_ms,
         percentile_cont(0.95) within group (order by extract(epoch from settled_at - created_at)) * 1000 as p95_ms
       from ${s}.payment_operations where settled_at >= $1
       group by 1`,
    ),

    /**
     * The age of the oldest unsettled operation at each minute's start. Of all that were unsettled in
     * the window (settled since $1, or unsettled now: of those only the oldest can be the oldest), an
     * operation is the oldest from its creation, or from when every older one had settled, until it
     * settles: an empty range for one that settled before some older one. Minutes are generated per
     * range, so this costs a sort of the window, not a scan of it per minute.
     */
    oldestUnsettledByMinute: statement<[from: Date]>(
      'outboxd_oldest_unsettled_by_minute',
      `with spans as (
         select created_at, settled_at as ended_at from ${s}.payment_operations where settled_at >= $1
         union all
         (select created_at, 'infinity'::timestamptz from ${s}.payment_operations where ${UNSETTLED} order by created_at limit 1)
       ), ordered as (
         select created_at, ended_at,
           coalesce(max(ended_at) over (order by created_at, ended_at rows between unbounded preceding and 1 preceding), '-infinity') as before
         from spans
       )
       select minute, extract(epoch from minute - created_at)::float8 as age_seconds
       from ordered cross join lateral generate_series(
         date_trunc('minute', greatest(created_at, before, $1) + interval '59.999999 seconds'),
         least(ended_at - interval '1 microsecond', now()),
         interval '1 minute') as minute`,
    ),

    /**
     * Gateway calls with an outcome (any kind, any call) but those the budget never sent (their recorded
     * error matches $2), and the ones among them that were answered rate-limited (a 429), from the timeline.
     * A repeated outcome is one row (repeats, last_at): it counts once in the minute it began and the rest
     * in the minute it last happened; one begun before the window is not drawn.
     */
    gatewayCallsByMinute: statement<[from: Date, notSent: string]>(
      'outboxd_gateway_calls_by_minute',
      `select date_trunc('minute', v.at) as minute, sum(v.n)::int as calls,
         sum(v.n) filter (where e.details->>'outcome' = 'rate_limited')::int as rate_limited
       from ${s}.operation_events e
       cross join lateral (values (e.at, 1), (e.last_at, e.repeats - 1)) as v(at, n)
       where e.at >= $1 and e.type = 'outcome' and coalesce(e.details->>'error', '') not like $2 and v.n > 0 and v.at >= $1
       group by 1`,
    ),

    /** The kinds that exist: one probe of the list index per kind (a loose index scan), not a scan. */
    operationKinds: statement<[]>(
      'outboxd_operation_kinds',
      `with recursive kinds(kind) as (
         (select kind from ${s}.payment_operations order by kind limit 1)
         union all
         select (select p.kind from ${s}.payment_operations p where p.kind > kinds.kind order by p.kind limit 1)
         from kinds where kinds.kind is not null
       )
       select kind from kinds where kind is not null`,
    ),

    /** A page of operations, newest first, strictly older than the cursor (created_at, id): one range
     * of the list index per (kind, status), each cut at the page size, merged. */
    operationsOlder: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
      'outboxd_operations_older',
      operationsPage('<', 'desc'),
    ),
    /** The page just newer than the cursor, oldest first (the caller reverses it). */
    operationsNewer: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
      'outboxd_operations_newer',
      operationsPage('>', 'asc'),
    ),
    /** The same pages among operations held for review: few, read through the review index and sorted. */
    reviewOlder: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
      'outboxd_review_older',
      reviewPage('<', 'desc'),
    ),
    reviewNewer: statement<[kinds: string[], statuses: string[], at: string, id: string, limit: number]>(
      'outboxd_review_newer',
      reviewPage('>', 'asc'),
    ),

    /** The review queue, longest waiting first, with when each was last flagged or found to need review. */
    reviewQueue: statement<[limit: number]>(
      'outboxd_review_queue',
      `select ${operationColumns('o')}, ${CURSOR} as cursor_at,
         (select max(e.at) from ${s}.operation_events e
          where e.operation_id = o.id and (e.type = 'flagged' or (e.type = 'outcome' and e.details->>'outcome' = 'needs_review'))) as flagged_at
       from ${s}.payment_operations o
       where o.review_reason is not null
       order by o.created_at, o.id
       limit $1`,
    ),

    /** The overview's figures, each read through an index, never a scan of every operation: unsettled
     * counts by kind and status (the unsettled index), settled counts of the last 24 hours (the settled
     * index), the review count, the oldest unsettled, and the number of operations: counted while the
     * planner believes there are fewer than 100,000 (-1 when never analyzed), estimated beyond. */
    consoleOverview: statement<[]>(
      'outboxd_console_overview',
      `select
         (select coalesce(jsonb_agg(c order by c.kind, c.status), '[]'::jsonb) from (
            select kind, status, count(*)::int as n from ${s}.payment_operations where ${UNSETTLED} group by kind, status
            union all
            select kind, status, count(*)::int from ${s}.payment_operations
            where settled_at >= now() - interval '24 hours' group by kind, status) c) as counts,
         (select case when reltuples < 100000 then (select count(*) from ${s}.payment_operations) else reltuples::bigint end
          from pg_class where oid = '${s}.payment_operations'::regclass) as total,
         (select reltuples < 100000 from pg_class where oid = '${s}.payment_operations'::regclass) as total_exact,
         (select count(*)::int from ${s}.payment_operations where review_reason is not null) as needs_review,
         (select extract(epoch from now() - min(created_at))::float8 from ${s}.payment_operations where ${UNSETTLED}) as oldest_unsettled_seconds,
         (select count(*)::int from ${s}.charge_outbox) as outbox_rows`,
    ),

    /** Operations held for review (their partial index): the console's navigation shows it on every page. */
    reviewCount: statement<[]>(
      'outboxd_review_count',
      `select count(*)::int as n from ${s}.payment_operations where review_reason is not null`,
    ),

    recentSettlements: statement<[limit: number]>(
      'outboxd_recent_settlements',
      `select ${operationColumns()} from ${s}.payment_operations where settled_at is not null order by settled_at desc limit $1`,
    ),

    /** Every operation of an order, of any kind: a charge's refunds, a refund's charge, earlier attempts. */
    operationsOfOrder: statement<[orderId: string, limit: number]>(
      'outboxd_operations_of_order',
      `select ${operationColumns()} from ${s}.payment_operations where order_id = $1 order by created_at, id limit $2`,
    ),

    operationsByExternalId: statement<[externalId: string, limit: number]>(
      'outboxd_operations_by_external_id',
      `select ${operationColumns()} from ${s}.payment_operations where external_id = $1 order by created_at, id limit $2`,
    ),

    /** An operation's timeline rows, oldest first. */
    operationEvents: statement<[operationId: string, limit: number]>(
      'outboxd_operation_events',
      `select id, at, type, fence, actor, details, repeats, last_at from ${s}.operation_events where operation_id = $1 order by id limit $2`,
    ),

    webhookEventsOf: statement<[operationId: string, limit: number]>(
      'outboxd_webhook_events_of',
      `select id, type, received_at, result, payload from ${s}.webhook_events
       where operation_id = $1 order by received_at, id limit $2`,
    ),

    /** The operation's settlement events as pg-boss carries them to the application's onSettled
     * handlers: queued, delivered (completed), retrying, or dead-lettered. */
    settlementEventsOf: statement<[operationId: string, queues: string[], limit: number]>(
      'outboxd_settlement_events_of',
      `select id, name, state, retry_count, created_on, completed_on, data->>'source' as source, output
       from ${boss}.job where name = any($2::text[]) and data->>'operationId' = $1
       order by created_on, id limit $3`,
    ),

    // ─── Stripe's rate limit, shared by the fleet (src/stripe/budget.ts) ──────────────────────────────

    /** Each budget's bucket now, for the console: tokens left and how long since a dispatch call came up
     * short anywhere in the fleet (the budget was the bound then). */
    rateBudgetStates: statement<[]>(
      'outboxd_rate_budget_states',
      `select name, tokens, extract(epoch from now() - short_at)::float8 as short_seconds_ago
       from ${s}.rate_budgets order by name`,
    ),

    /** A budget's bucket, empty: a first replica starts by waiting, not with a burst. */
    ensureRateBudget: statement<[name: string]>(
      'outboxd_ensure_rate_budget',
      `insert into ${s}.rate_budgets (name, tokens, refilled_at) values ($1, 0, now()) on conflict (name) do nothing`,
    ),

    /**
     * Refills the bucket by the database clock (rate $2/s, capacity $3) and grants up to $4 whole tokens,
     * under the row's lock: every replica's takes are serialised, so together they never get more than
     * rate × elapsed + capacity. refilled_at only moves forward (a take that waited for the lock has an
     * older now()), so no interval is credited twice, unless it is over a second ahead: the database clock
     * stepped back (a failover to a standby whose clock lags), and refilling from its now() (nothing for
     * the step itself) keeps the bucket bounded without freezing it until the clock catches up; a short_at
     * ahead likewise yields no longer than $6 s. $5: a background take, granted nothing while a
     * dispatch take anywhere came up short in the last $6 s; a dispatch take that comes up short records
     * when. No row: the bucket does not exist yet (ensureRateBudget).
     */
    takeRateBudget: statement<[name: string, rate: number, capacity: number, want: number, background: boolean, yieldSeconds: number]>(
      'outboxd_take_rate_budget',
      `with cur as (
         select name,
           least($3::float8, tokens + $2::float8 * greatest(0, extract(epoch from now() - refilled_at)::float8)) as avail,
           $5::boolean and coalesce(short_at > now() - make_interval(secs => $6) and short_at < now() + interval '1 minute', false) as yielded
         from ${s}.rate_budgets where name = $1
         for update
       ), g as (
         select name, avail, yielded, case when yielded then 0 else greatest(0, least($4::int, floor(avail)::int)) end as granted from cur
       )
       update ${s}.rate_budgets b
       set tokens = g.avail - g.granted,
           refilled_at = case when b.refilled_at > now() + interval '1 second' then now() else greatest(b.refilled_at, now()) end,
           short_at = case when not $5::boolean and g.granted < $4::int then now() else b.short_at end
       from g where b.name = g.name
       returning g.granted, (g.avail - g.granted)::float8 as remaining, g.yielded`,
    ),

    // ─── health (metrics) ─────────────────────────────────────────────────────────────────────────────

    /** The gauges every scrape reads, each from its partial index (review, unsettled): the few live rows,
     * never the whole table (which every replica's scrape used to read: ~300 ms at 1M operations). */
    operationHealth: statement<[]>(
      'outboxd_operation_health',
      `select
         (select count(*)::int from ${s}.payment_operations where review_reason is not null) as needs_review,
         coalesce((select extract(epoch from now() - min(created_at)) from ${s}.payment_operations where ${UNSETTLED}), 0)::float8
           as oldest_unsettled_seconds`,
    ),

    /**
     * The host database's health as it bears on outboxd (issue 22): the oldest transaction that holds the
     * xmin horizon back (no dead row younger than its snapshot can be vacuumed in this database's tables),
     * as its age in seconds and in transactions; and the dead rows of outboxd's tables and pg-boss's (its
     * job partitions together). A role without pg_read_all_stats sees other roles' sessions without
     * their xmin: grant it to outboxd's role for the whole picture.
     */
    hostHealth: statement<[]>(
      'outboxd_host_health',
      `select
         (select coalesce(max(extract(epoch from now() - xact_start)), 0)::float8 from pg_stat_activity
           where backend_xmin is not null and datname = current_database() and pid <> pg_backend_pid()) as oldest_xmin_seconds,
         (select coalesce(max(age(backend_xmin)), 0)::int from pg_stat_activity
           where backend_xmin is not null and datname = current_database() and pid <> pg_backend_pid()) as oldest_xmin_age,
         coalesce((select json_agg(t order by t.table) from (
           select case when schemaname = '${schema}' then relname::text else 'pg-boss' end as table,
             sum(n_dead_tup)::float8 as dead, sum(n_live_tup)::float8 as live
           from pg_stat_user_tables where schemaname in ('${schema}', '${bossSchemaFor(schema)}')
           group by 1) t), '[]') as tables`,
    ),

    // ─── listings (admin and CLI) ──────────────────────────────────────────────────────────────────────

    listOperations: statement<[status: string | null, needsReview: boolean, limit: number]>(
      'outboxd_list_operations',
      `select ${operationColumns()} from ${s}.payment_operations
       where ($1::text is null or status = $1) and (not $2 or needs_review)
       order by created_at, id
       limit $3`,
    ),

    showOperation: statement<[id: string]>(
      'outboxd_show_operation',
      `select ${operationColumns()} from ${s}.payment_operations where id = $1`,
    ),

    /** Operations whose id begins with a prefix (hex digits, dashes ignored): the short ids people copy.
     * A range of the primary key (uuids order as their hex digits), not a scan of the table. */
    operationsByIdPrefix: statement<[hexPrefix: string, limit: number]>(
      'outboxd_operations_by_id_prefix',
      `select ${operationColumns()} from ${s}.payment_operations
       where id between rpad($1, 32, '0')::uuid and rpad($1, 32, 'f')::uuid
       order by id limit $2`,
    ),

    /** The newest audit entries, of one operation or of all, returned oldest first. */
    listAudit: statement<[operationId: string | null, limit: number]>(
      'outboxd_list_audit',
      `select * from (
         select id, at, actor, action, operation_id, details from ${s}.admin_audit
         where $1::uuid is null or operation_id = $1
         order by at desc, id desc
         limit $2
       ) newest
       order by at, id`,
    ),
  };
}
