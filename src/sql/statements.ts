// Every SQL statement outboxd runs against its own tables, in one place, each a named prepared
// statement (parsed once per connection). Read top to bottom this is the whole data path.
// Status writes are only ever issued by src/payments/operation.ts, the operation's state machine.
//
// The statements are built for one schema (OUTBOXD_SCHEMA) and name every table with it: some run on
// the application's own connection, inside its transaction, whose search_path is not ours. Their
// prepared-statement names carry a tag of the schema, so one connection can serve two schemas.
import { createHash } from 'node:crypto';
import pg from 'pg';
import type { QueryConfig } from 'pg';

export const DEFAULT_SCHEMA = 'outboxd';
/** A lower-case identifier (never needs quoting rules of its own), short enough that the pg-boss schema
 * derived from it (src/outbox.ts) stays within pg-boss's 50 bytes. */
export const SCHEMA_NAME = /^[a-z_][a-z0-9_]{0,39}$/;

const UNSETTLED = `status in ('pending', 'unknown')`;

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

/** The statements for `schema` (a lower-case identifier, as config.ts validates OUTBOXD_SCHEMA). */
export function statementsFor(schema: string): Statements {
  let statements = built.get(schema);
  if (!statements) built.set(schema, (statements = build(schema)));
  return statements;
}

function build(schema: string) {
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
    (...values: A): QueryConfig => ({ name: `${name}_${tag}`, text, values, types: resultTypes });

  return {
    // ─── orders ────────────────────────────────────────────────────────────────────────────────────────

    insertOrder: statement<[id: string, amount: number, currency: string, customer: string, pm: string]>(
      'outboxd_insert_order',
      `insert into ${s}.orders (id, amount, currency, customer_id, payment_method) values ($1, $2, $3, $4, $5)
       on conflict (id) do nothing`,
    ),

    // ─── the outbox: written with the operation, relayed to pg-boss in batches ─────────────────────────

    outboxHasRows: statement<[]>('outboxd_outbox_has_rows', `select exists (select 1 from ${s}.charge_outbox) as any`),

    /** Takes the oldest rows no other relay holds; deleting them in the job-creating transaction is the mark. */
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
              op.settled_at, taken.source
       from taken join ${s}.payment_operations op on op.id = taken.operation_id
       order by taken.id`,
    ),

    settlementOutboxDepth: statement<[]>(
      'outboxd_settlement_outbox_depth',
      `select count(*)::int as rows from ${s}.settlement_outbox`,
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
      `select * from ${s}.payment_operations where order_id = $1 and kind = 'charge' order by created_at desc, id`,
    ),

    /** The operation, with whether its idempotency key window (seconds from first_attempted_at) has passed,
     * judged by the database clock so that every replica agrees. */
    loadOperation: statement<[id: string, keyWindowSeconds: number]>(
      'outboxd_load_operation',
      `select *, coalesce(first_attempted_at < now() - make_interval(secs => $2), false) as key_window_passed
       from ${s}.payment_operations where id = $1`,
    ),

    // ─── lease and fence (docs/architecture.md §3) ─────────────────────────────────────────────────────

    /** Takes the lease if it is free or expired; every claim gets a strictly larger fencing token.
     * Returns the claimed operation as loadOperation does (the executor needs no second read), and
     * previous_owner when an expired lease was taken over (its holder died or stalled). */
    acquireLease: statement<[id: string, owner: string, ttlMs: number, keyWindowSeconds: number]>(
      'outboxd_acquire_lease',
      `with prev as (select id, lease_owner from ${s}.payment_operations where id = $1 for update)
       update ${s}.payment_operations op
       set fence = op.fence + 1, lease_owner = $2, lease_expires_at = now() + make_interval(secs => $3 / 1000.0),
           updated_at = now()
       from prev
       where op.id = prev.id and op.${UNSETTLED} and (op.lease_expires_at is null or op.lease_expires_at < now())
       returning op.*, prev.lease_owner as previous_owner,
         coalesce(op.first_attempted_at < now() - make_interval(secs => $4), false) as key_window_passed`,
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

    /** At shutdown: gives back every lease this replica still holds, so others need not wait for expiry. */
    releaseLeasesOf: statement<[owner: string]>(
      'outboxd_release_leases_of',
      `update ${s}.payment_operations set lease_owner = null, lease_expires_at = null
       where lease_owner = $1
       returning id`,
    ),

    // ─── the executor's fenced writes ──────────────────────────────────────────────────────────────────

    /** Counts a call before it is made; for a create, records first_attempted_at (the first send,
     * invariant 7) and last_attempted_at before the send, returning what they were, so that an outcome that
     * proves nothing executed can put them back. $4: an at-least-once kind, whose create after one that
     * may have acted (first_attempted_at already set) is counted as a possible duplicate. Zero rows: the
     * fence moved or the operation settled, and the call must not be made. */
    recordAttempt: statement<[id: string, fence: number, isCreate: boolean, atLeastOnce: boolean]>(
      'outboxd_record_attempt',
      `with prev as (select first_attempted_at, last_attempted_at from ${s}.payment_operations where id = $1)
       update ${s}.payment_operations
       set attempts = attempts + 1, updated_at = now(),
           first_attempted_at = case when $3 then coalesce(first_attempted_at, now()) else first_attempted_at end,
           last_attempted_at = case when $3 then now() else last_attempted_at end,
           possible_duplicates = possible_duplicates + case when $3 and $4 and first_attempted_at is not null then 1 else 0 end
       where id = $1 and fence = $2 and ${UNSETTLED}
       returning attempts, first_attempted_at,
         (select first_attempted_at from prev) as prev_first_attempted_at,
         (select last_attempted_at from prev) as prev_last_attempted_at`,
    ),

    /** Writes an outcome and ends the claim's lease. Never touches a settled operation (invariant 5) and
     * only with the current fence (invariant 8). settled_at is set exactly when the new status is settled,
     * and then, in the same statement, its settlement event ($11: what settled it).
     * $8: the call provably executed nothing (a 429, 401/403, a connection never opened), so the attempt
     * stamps go back to $9/$10: a window that only such calls opened is not open (or a check found that
     * no earlier execution happened: they go back to null). $12: an application effect's result. */
    recordOutcome: statement<
      [
        id: string,
        fence: number,
        status: string,
        externalId: string | null,
        lastOutcome: string,
        lastError: string | null,
        reviewReason: string | null,
        undoAttempt: boolean,
        firstAttemptedAt: Date | null,
        lastAttemptedAt: Date | null,
        source: string,
        result: string | null,
      ]
    >(
      'outboxd_record_outcome',
      `with op as (
       update ${s}.payment_operations
       set status = $3, external_id = coalesce($4, external_id), last_outcome = $5, last_error = $6,
           -- a review reason stays until the operation settles (a later ambiguous retry does not clear it)
           review_reason = case when $3 in ('succeeded', 'failed') then null else coalesce($7, review_reason) end,
           first_attempted_at = case when $8 then $9::timestamptz else first_attempted_at end,
           last_attempted_at = case when $8 then $10::timestamptz else last_attempted_at end,
           result = coalesce($12::jsonb, result),
           updated_at = now(), lease_owner = null, lease_expires_at = null,
           settled_at = case when $3 in ('succeeded', 'failed') then now() end
       where id = $1 and fence = $2 and ${UNSETTLED}
       returning *
       ), ${settlementEvent('$11')}
       select * from op`,
    ),

    /** Fenced: holds an unsettled operation for a person without changing its status; ends the claim. */
    flagForReview: statement<[id: string, fence: number, reason: string]>(
      'outboxd_flag_for_review',
      `update ${s}.payment_operations set review_reason = $3, updated_at = now(), lease_owner = null, lease_expires_at = null
       where id = $1 and fence = $2 and ${UNSETTLED}
       returning *`,
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
       returning *
       ), ${settlementEvent('$6')}
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
       returning *
       ), ${settlementEvent("'admin'")}
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
      `insert into ${s}.admin_audit (actor, action, operation_id, details) values ($1, $2, $3, $4::jsonb) returning *`,
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

    /** Holds an unsettled operation for a person from outside any claim (a webhook that contradicts it).
     * The status is not touched, so no fence is needed; a later outcome keeps the reason unless it settles. */
    flagFromOutside: statement<[id: string, reason: string]>(
      'outboxd_flag_from_outside',
      `update ${s}.payment_operations set review_reason = $2, updated_at = now()
       where id = $1 and ${UNSETTLED}
       returning id`,
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
     * outbox and no live job in their kind's queue or its dead letter (src/outbox.ts: queueFor,
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
      `select * from ${s}.payment_operations
       where ${UNSETTLED} and updated_at < now() - make_interval(secs => $1)
       order by updated_at
       limit $2`,
    ),

    operationsByIds: statement<[ids: string[]]>(
      'outboxd_operations_by_ids',
      `select * from ${s}.payment_operations where id = any($1::uuid[])`,
    ),

    /** Charge operations known to Stripe by these PaymentIntents (the drift report's refunds of our charges). */
    chargeOperationsByExternalIds: statement<[externalIds: string[]]>(
      'outboxd_charge_operations_by_external_ids',
      `select * from ${s}.payment_operations where kind = 'charge' and external_id = any($1::text[])`,
    ),

    /** Succeeded operations settled since a time: each must have its charge (refund) in Stripe. */
    succeededSince: statement<[since: Date]>(
      'outboxd_succeeded_since',
      `select * from ${s}.payment_operations where status = 'succeeded' and settled_at >= $1`,
    ),

    // ─── health (metrics) ─────────────────────────────────────────────────────────────────────────────

    operationHealth: statement<[]>(
      'outboxd_operation_health',
      `select
         count(*) filter (where needs_review)::int as needs_review,
         count(*) filter (where ${UNSETTLED})::int as unsettled,
         coalesce(extract(epoch from now() - min(created_at) filter (where ${UNSETTLED})), 0)::float8 as oldest_unsettled_seconds
       from ${s}.payment_operations`,
    ),

    // ─── listings (admin and CLI) ──────────────────────────────────────────────────────────────────────

    listOperations: statement<[status: string | null, needsReview: boolean, limit: number]>(
      'outboxd_list_operations',
      `select * from ${s}.payment_operations
       where ($1::text is null or status = $1) and (not $2 or needs_review)
       order by created_at, id
       limit $3`,
    ),

    showOperation: statement<[id: string]>(
      'outboxd_show_operation',
      `select * from ${s}.payment_operations where id = $1`,
    ),

    /** Operations whose id begins with a prefix (hex digits, dashes ignored): the short ids people copy. */
    operationsByIdPrefix: statement<[hexPrefix: string, limit: number]>(
      'outboxd_operations_by_id_prefix',
      `select * from ${s}.payment_operations where replace(id::text, '-', '') like $1 || '%' order by id limit $2`,
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
