// The tables outboxd owns. drizzle-kit generates the SQL migrations in drizzle/ from this file;
// the statements the worker runs live in src/sql/ (named prepared statements on direct connections), not
// in query builders, with every column they read named (a column added here breaks no running replica).
// They live in their own schema, written here as "outboxd": src/db/migrate.ts applies the migrations
// to whichever schema OUTBOXD_SCHEMA names.
import { sql } from 'drizzle-orm';
import { bigint, boolean, check, doublePrecision, index, integer, jsonb, pgSchema, primaryKey, text, timestamp, uniqueIndex, uuid, type AnyPgColumn } from 'drizzle-orm/pg-core';
import { OPERATION_STATUSES, POLICIES } from '../types/status.ts';

const outboxd = pgSchema('outboxd');

const timestamps = {
  createdAt: timestamp('created_at', { withTimezone: true }).notNull().defaultNow(),
  updatedAt: timestamp('updated_at', { withTimezone: true }).notNull().defaultNow(),
};

export const orders = outboxd.table(
  'orders',
  {
    id: text('id').primaryKey(),
    amount: bigint('amount', { mode: 'number' }).notNull(),
    currency: text('currency').notNull(),
    customerId: text('customer_id').notNull(),
    paymentMethod: text('payment_method').notNull(),
    status: text('status').notNull().default('confirmed'),
    confirmedAt: timestamp('confirmed_at', { withTimezone: true }).notNull().defaultNow(),
    ...timestamps,
  },
  // confirmed by `order confirm`; by its settlement subscriber (`order follow`): paid, payment_failed, or
  // for an authorization authorized (funds held), then paid once captured or released once cancelled.
  (t) => [check('orders_status_check', sql`${t.status} in ('confirmed', 'paid', 'payment_failed', 'authorized', 'released')`)],
);

export const paymentOperations = outboxd.table(
  'payment_operations',
  {
    /** Time-ordered (UUIDv7, drizzle/0024_operation_ids_v7.sql): each new id sorts after the last, so
     * inserts fill the primary key's rightmost pages and those of the indexes that lead with an
     * operation id. A random id wrote to any page of the ledger's index, each first write to a page after
     * a checkpoint a full 8 KB image of it in the WAL. */
    id: uuid('id').primaryKey().default(sql`"outboxd"."uuidv7"()`),
    /** The application's order (any table of its own, or the example orders below): not a foreign key.
     * A refund's is its charge's; an application's own kind of effect has none. */
    orderId: text('order_id'),
    /** What the effect is, and so its policy on an ambiguous outcome (src/engine/kinds.ts). */
    kind: text('kind').notNull().default('charge'),
    /** The kind's policy when the operation was requested; a worker that defines the kind otherwise
     * holds it for a person rather than apply another. */
    policy: text('policy', { enum: POLICIES }).notNull().default('idempotent-key'),
    /** A charge's or a refund's (minor units); an application's effect has none. */
    amount: bigint('amount', { mode: 'number' }),
    currency: text('currency'),
    /** A charge's; no other kind has one. */
    customerId: text('customer_id'),
    paymentMethod: text('payment_method'),
    /** The application's metadata, sent to Stripe beside operation_id (Stripe's limits, checked on input). */
    metadata: jsonb('metadata').$type<Record<string, string>>().notNull().default({}),
    status: text('status', { enum: OPERATION_STATUSES }).notNull().default('pending'),
    externalId: text('external_id'),
    /** Calls made to the gateway for this operation (create, retrieve or search). */
    attempts: integer('attempts').notNull().default(0),
    /** Set before the first create is sent: the idempotency key window is measured from it. */
    firstAttemptedAt: timestamp('first_attempted_at', { withTimezone: true }),
    /** Set before each create is sent: Search is not read-after-write, so a failed resolution waits a
     * freshness horizon after the last create that may have executed. */
    lastAttemptedAt: timestamp('last_attempted_at', { withTimezone: true }),
    lastError: text('last_error'),
    /** The last gateway outcome class (succeeded, declined, ambiguous, rate_limited, …), for people. */
    lastOutcome: text('last_outcome'),
    /** Why a person must look at this operation; null when no review is needed. */
    reviewReason: text('review_reason'),
    needsReview: boolean('needs_review')
      .notNull()
      .generatedAlwaysAs(sql`review_reason is not null`),
    settledAt: timestamp('settled_at', { withTimezone: true }),
    fence: bigint('fence', { mode: 'number' }).notNull().default(0),
    leaseOwner: text('lease_owner'),
    leaseExpiresAt: timestamp('lease_expires_at', { withTimezone: true }),
    /** W3C traceparent of the request that created it (null when it was not traced): later attempts link to it. */
    traceparent: text('traceparent'),
    /** A refund's, a capture's or a cancel's charge operation. */
    parentOperationId: uuid('parent_operation_id').references((): AnyPgColumn => paymentOperations.id),
    /** The caller's key: of a refund, unique per charge operation; of a capture or a cancel,
     * `<charge operation id>/<key>` (so unique per charge as well); of an application's effect, unique per
     * kind. The same key is the same operation. */
    effectKey: text('effect_key'),
    /** What the kind needs beyond the columns: a charge's capture method and Connect account (null for an
     * automatic charge on the platform), the PaymentIntent, account and reason of a refund, capture or
     * cancel, an application effect's payload. */
    payload: jsonb('payload'),
    /** What an application's effect returned (or its check found), as JSON; a manual charge's hold. */
    result: jsonb('result'),
    /** Executions of an at-least-once effect after one that may have acted: possible duplicates. */
    possibleDuplicates: integer('possible_duplicates').notNull().default(0),
    /** When Stripe first answered that the payment is `processing` (a refund: `pending`): a payment that
     * takes days (SEPA Debit, ACH) waits, checked again on a slowing schedule, and is held for a person
     * only PROCESSING_REVIEW_DAYS after this (src/engine/processing.ts). Kept once settled. */
    processingSince: timestamp('processing_since', { withTimezone: true }),
    /** While it waits on `processing`: when its job retrieves it next (null otherwise). */
    nextCheckAt: timestamp('next_check_at', { withTimezone: true }),
    ...timestamps,
  },
  (t) => [
    index('payment_operations_order_idx').on(t.orderId, t.kind),
    // At most one live charge per order, so at most one can succeed; a new one (a new key) only once
    // every earlier one failed: the customer pays with another card.
    uniqueIndex('payment_operations_live_charge_idx')
      .on(t.orderId)
      .where(sql`${t.kind} = 'charge' and ${t.status} <> 'failed'`),
    // A refund of a charge operation under a key: asking again with the key returns it.
    uniqueIndex('payment_operations_refund_key_idx')
      .on(t.parentOperationId, t.effectKey)
      .where(sql`${t.kind} = 'refund'`),
    // An application's effect of a kind under a key: requesting it again with the key returns it.
    uniqueIndex('payment_operations_effect_key_idx')
      .on(t.kind, t.effectKey)
      .where(sql`${t.kind} not in ('charge', 'refund')`),
    // An authorization is changed once: at most one capture or cancel of a charge that has not failed,
    // whatever the requests' transactions (src/kinds/hold/request.ts decides them; this is the backstop).
    uniqueIndex('payment_operations_live_change_idx')
      .on(t.parentOperationId)
      .where(sql`${t.kind} in ('capture', 'cancel') and ${t.status} <> 'failed'`),
    // Any kind's name is its queue's (src/outbox/outbox.ts), and `<kind>_dead` its dead letter's.
    check('payment_operations_kind_check', sql`${t.kind} ~ '^[a-z][a-z0-9_]{0,39}$'`),
    check('payment_operations_policy_check', sql`${t.policy} in ('idempotent-key', 'at-least-once', 'reconcile-before-retry')`),
    check('payment_operations_money_check', sql`${t.kind} not in ('charge', 'refund') or (${t.orderId} is not null and ${t.amount} is not null and ${t.currency} is not null)`),
    check('payment_operations_charge_check', sql`${t.kind} <> 'charge' or (${t.customerId} is not null and ${t.paymentMethod} is not null)`),
    check('payment_operations_refund_check', sql`${t.kind} <> 'refund' or (${t.parentOperationId} is not null and ${t.effectKey} is not null)`),
    // A capture or a cancel names its charge, the money it moves or releases, and its key. Its effect_key
    // is `<charge operation id>/<key>`: the application-effect index on (kind, effect_key) keeps it
    // unique per charge, and no index had to be built or dropped under running releases.
    check(
      'payment_operations_change_check',
      sql`${t.kind} not in ('capture', 'cancel') or (${t.parentOperationId} is not null and ${t.effectKey} like ${t.parentOperationId}::text || '/%' and ${t.orderId} is not null and ${t.amount} is not null and ${t.currency} is not null)`,
    ),
    check('payment_operations_effect_check', sql`${t.kind} in ('charge', 'refund') or ${t.effectKey} is not null`),
    check('payment_operations_status_check', sql`${t.status} in ('pending', 'unknown', 'succeeded', 'failed')`),
    check('payment_operations_amount_check', sql`${t.amount} > 0`),
    check(
      'payment_operations_settled_check',
      sql`(${t.status} in ('succeeded', 'failed')) = (${t.settledAt} is not null)`,
    ),
    index('payment_operations_unsettled_idx')
      .on(t.createdAt)
      .where(sql`${t.status} in ('pending', 'unknown')`),
    // By created_at, the order the review queue is read in; not by updated_at, which every claim and
    // renewal changes: a column of any index makes each update write every index anew (no HOT update).
    index('payment_operations_review_created_idx')
      .on(t.createdAt, t.id)
      .where(sql`${t.reviewReason} is not null`),
    // The console's lists: newest first by (created_at, id) keyset, for any kind and status filter
    // (src/console/queries.ts reads one range of it per kind and status, and merges them).
    index('payment_operations_list_idx').on(t.kind, t.status, t.createdAt, t.id),
    // Search by Stripe id; recent settlements and the drift report's succeeded operations. Both partial:
    // an operation gets its entry once (settled rows are never updated again).
    index('payment_operations_external_idx')
      .on(t.externalId)
      .where(sql`${t.externalId} is not null`),
    // Held authorizations by their expiry (capture_before, ISO-8601 text): the reconcile sweep finds those
    // Stripe has released by now (src/sql/hold.ts authorizationsToFollowUp).
    index('payment_operations_hold_expiry_idx')
      .on(sql`(${t.result}->>'capture_before')`)
      .where(sql`${t.kind} = 'charge' and ${t.status} = 'succeeded' and ${t.payload}->>'capture_method' = 'manual'`),
    index('payment_operations_settled_idx')
      .on(t.settledAt)
      .where(sql`${t.settledAt} is not null`),
  ],
);

/** Every admin action (resolve, requeue, reconcile run), with who, when, what and the evidence. */
export const adminAudit = outboxd.table(
  'admin_audit',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    at: timestamp('at', { withTimezone: true }).notNull().defaultNow(),
    actor: text('actor').notNull(),
    action: text('action').notNull(),
    operationId: uuid('operation_id').references(() => paymentOperations.id),
    details: jsonb('details').notNull().default({}),
  },
  (t) => [index('admin_audit_operation_idx').on(t.operationId, t.at)],
);

/** Stripe webhook inbox: one row per event id, so a redelivered event is acknowledged, not reprocessed. */
export const webhookEvents = outboxd.table(
  'webhook_events',
  {
    id: text('id').primaryKey(),
    type: text('type').notNull(),
    operationId: uuid('operation_id'),
    receivedAt: timestamp('received_at', { withTimezone: true }).notNull().defaultNow(),
    /** What processing decided: settled, already_settled, ignored, no_operation, mismatch. */
    result: text('result').notNull(),
    payload: jsonb('payload').notNull(),
  },
  // An operation's events, for its timeline in the console; the oldest events, for their retention.
  (t) => [index('webhook_events_operation_idx').on(t.operationId), index('webhook_events_received_idx').on(t.receivedAt)],
);

/**
 * Each operation's history, for the people who must decide what happened (the console's timeline):
 * every gateway call with its outcome (owner, duration, Stripe's request id, error), claims that took
 * over an expired lease (the owner they took over from, the calls it left unanswered), flags and
 * settlements from outside a claim. Each row
 * is written by the statement that makes the change it records (a data-modifying CTE), so history costs
 * the dispatcher no round trip. No foreign key: checking one would lock the operation row against the
 * claim that is updating it.
 */
export const operationEvents = outboxd.table(
  'operation_events',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    operationId: uuid('operation_id').notNull(),
    at: timestamp('at', { withTimezone: true }).notNull().defaultNow(),
    /** outcome (a gateway call with what it answered: one row per call), claimed (a takeover of an
     * expired lease, or a claim outside the dispatcher's), flagged, settled; releases before one row
     * per call also wrote relayed and sent. */
    type: text('type').notNull(),
    /** The fencing token of the claim that wrote it (none for the relay or a flag from outside). */
    fence: bigint('fence', { mode: 'number' }),
    /** Who: the lease owner of a claim; the source of an outside settlement. */
    actor: text('actor'),
    details: jsonb('details').notNull().default({}),
    /** How many times this event happened: a refusal repeated every few seconds (a revoked key, a 429
     * loop, the review sweep) is one row counted, not a row each time (src/sql/statements.ts). */
    repeats: integer('repeats').notNull().default(1),
    /** When it last happened, once it repeated. */
    lastAt: timestamp('last_at', { withTimezone: true }),
  },
  (t) => [
    index('operation_events_operation_idx').on(t.operationId, t.id),
    // The console's charts read the last hours of the whole timeline. BRIN: rows arrive in `at` order,
    // so a few pages of summaries find the range, at almost no cost to the inserts on the hot path.
    index('operation_events_at_idx').using('brin', t.at),
  ],
);

/**
 * The relays asleep on an empty outbox, LISTENing for the outboxes' NOTIFY (drizzle/0022_outbox_wake.sql):
 * a NOTIFY serializes the commits of the transactions that send one, so the application's confirming
 * transactions send one only while some relay sleeps, never while the relays keep up with a load. A
 * relay registers when its poll finds nothing and leaves when it finds rows or drains; a registration
 * that a dead replica left behind lapses at its expiry, renewed while its relay lives.
 */
export const relaySleepers = outboxd.table('relay_sleepers', {
  workerId: text('worker_id').primaryKey(),
  expiresAt: timestamp('expires_at', { withTimezone: true }).notNull(),
});

/**
 * The applications whose unnamed onSettled handlers wait on an empty settlement_outbox, LISTENing for
 * its NOTIFY (drizzle/0026_settlement_wake.sql), as relay_sleepers for the relays: the workers' settling
 * transactions send one only while some application waits, never while its handlers are kept busy. A
 * delivery registers when a loop of it finds nothing and leaves when a load arrives or it stops; a
 * registration that a dead process left behind lapses at its expiry, renewed while it lives.
 */
export const settlementSleepers = outboxd.table('settlement_sleepers', {
  deliveryId: text('delivery_id').primaryKey(),
  expiresAt: timestamp('expires_at', { withTimezone: true }).notNull(),
});

/**
 * The outbox proper: one row per operation to drive (of any kind: the name is the first kind's),
 * inserted in the requesting transaction (a plain insert, far cheaper there than a pg-boss job) and
 * relayed to pg-boss in batches by the workers, to its kind's queue, deleted in the transaction that
 * creates its job. A statement trigger (not modelled here: drizzle/0022_outbox_wake.sql) wakes the
 * relays that sleep (relay_sleepers), as on settlement_outbox.
 */
export const chargeOutbox = outboxd.table('charge_outbox', {
  id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
  /** Written with its operation, in the same statement (no foreign key: its check would lock the
   * operation's row, a WAL record per operation for a reference the statement already guarantees). */
  operationId: uuid('operation_id').notNull(),
  /** The operation's kind, so the relay knows its queue without reading the operation. */
  kind: text('kind').notNull().default('charge'),
  createdAt: timestamp('created_at', { withTimezone: true }).notNull().defaultNow(),
  /** The operation's traceparent: the relay and the first dispatch continue its trace. */
  traceparent: text('traceparent'),
});

/**
 * Settlement events on their way to the application's onSettled: one row per settled operation,
 * inserted by the very statement that settles it (so in its transaction). The row is where the unnamed
 * handlers take the event from (src/outbox/settlements.ts): leased (leased_until, in no index, so that
 * the lease is a HOT update), deleted once a handler returned, put off with backoff (not_before) when one
 * threw. The relay copies
 * it to each named subscriber's pg-boss queue, once (fanned_out), and only while one exists. The event's
 * other fields are the operation's, which nothing changes once it is settled.
 */
export const settlementOutbox = outboxd.table(
  'settlement_outbox',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    /** Written by the statement that settles the operation (no foreign key, as for charge_outbox). */
    operationId: uuid('operation_id').notNull(),
    /** What settled it: dispatcher, reconcile, webhook or admin. */
    source: text('source').notNull(),
    createdAt: timestamp('created_at', { withTimezone: true }).notNull().defaultNow(),
    /** Copied to the named subscribers' queues: the unnamed handlers take it only then, while any exists. */
    fannedOut: boolean('fanned_out').notNull().default(false),
    /** Deliveries to the unnamed handlers begun (the fence of the one in hand). */
    attempts: integer('attempts').notNull().default(0),
    /** When a handler may take it: its insert, or the end of its backoff after a failed delivery. */
    notBefore: timestamp('not_before', { withTimezone: true }).notNull().defaultNow(),
    /** The end of the lease of the delivery in hand: until then no other handler takes it. */
    leasedUntil: timestamp('leased_until', { withTimezone: true }),
    /** Why the last delivery failed. */
    lastError: text('last_error'),
  },
  (t) => [
    index('settlement_outbox_ready_idx').on(t.notBefore, t.id),
    index('settlement_outbox_fan_out_idx').on(t.id).where(sql`not ${t.fannedOut}`),
  ],
);

/**
 * One row once the unnamed onSettled handlers take settlement events from settlement_outbox: written by
 * the first application of that release to start them, or by the migration of a new database (no earlier
 * application can run there). Until then workers relay every event to the pg-boss queue `settled`, as
 * releases before did, which is where earlier applications look (src/outbox/settlements.ts).
 */
export const settlementDelivery = outboxd.table(
  'settlement_delivery',
  {
    id: integer('id').primaryKey().default(1),
    since: timestamp('since', { withTimezone: true }).notNull().defaultNow(),
  },
  (t) => [check('settlement_delivery_one_row', sql`${t.id} = 1`)],
);

/**
 * Which transactional subscriber consumed which settlement (src/outbox/settlements.ts): written in the
 * delivery's transaction, beside the application's own writes and the job's fenced completion, so the
 * three commit together. The key makes a second consumption of one event by one subscriber impossible,
 * whatever delivered it twice.
 */
export const settlementConsumption = outboxd.table(
  'settlement_consumption',
  {
    /** onSettled's `subscriber` name. */
    subscriber: text('subscriber').notNull(),
    /** The settled operation: its settlement is one event. */
    operationId: uuid('operation_id').notNull(),
    consumedAt: timestamp('consumed_at', { withTimezone: true }).notNull().defaultNow(),
  },
  // By consumed_at: the retention's batches (src/sql/retention.ts) read what they delete.
  (t) => [primaryKey({ columns: [t.subscriber, t.operationId] }), index('settlement_consumption_consumed_idx').on(t.consumedAt)],
);

/**
 * Signed-in operators of the console (src/console/session.ts). The cookie carries a random secret; only
 * its SHA-256 is stored, so a read of this table gives no usable session. A session ends at expires_at,
 * at sign-out (the row is deleted), or when ADMIN_TOKEN changes (token_fingerprint no longer matches).
 */
export const consoleSessions = outboxd.table('console_sessions', {
  /** SHA-256 (hex) of the cookie's secret. */
  id: text('id').primaryKey(),
  /** The name the operator signed in with: the audit trail names actions `console:<operator>`. */
  operator: text('operator').notNull(),
  /** Every form that changes something carries it; compared in constant time. */
  csrfToken: text('csrf_token').notNull(),
  /** HMAC of the token signed in with (ADMIN_TOKEN, or ADMIN_READONLY_TOKEN under another label). */
  tokenFingerprint: text('token_fingerprint').notNull(),
  createdAt: timestamp('created_at', { withTimezone: true }).notNull().defaultNow(),
  expiresAt: timestamp('expires_at', { withTimezone: true }).notNull(),
});

/**
 * Wrong tokens at the console's sign-in and on the admin API, counted per subject (`client:<address>`,
 * `operator:<name>`) for every replica alike (src/http/tokens.ts): past a few, the subject waits, longer
 * each time, before any token (the right one too) is looked at again.
 */
export const consoleSignInFailures = outboxd.table('console_sign_in_failures', {
  subject: text('subject').primaryKey(),
  failures: integer('failures').notNull(),
  firstFailedAt: timestamp('first_failed_at', { withTimezone: true }).notNull().defaultNow(),
  blockedUntil: timestamp('blocked_until', { withTimezone: true }),
});

/**
 * Stripe's rate limit as a budget shared by every replica (src/stripe/budget.ts): one token bucket per
 * budget, refilled by the database clock and taken from by one statement, so that the replicas together
 * stay under the limit however many there are. The rate and capacity are the caller's (the configuration).
 */
export const rateBudgets = outboxd.table('rate_budgets', {
  name: text('name').primaryKey(),
  /** Whole and fractional tokens left as of refilled_at. */
  tokens: doublePrecision('tokens').notNull(),
  refilledAt: timestamp('refilled_at', { withTimezone: true }).notNull().defaultNow(),
  /** When a dispatch take last came up short anywhere in the fleet: background takes yield for a while. */
  shortAt: timestamp('short_at', { withTimezone: true }),
});
