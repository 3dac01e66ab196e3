// The library: what an application embedding outboxd calls. Its requests (charges, refunds, its own
// kinds of effect) join the application's own transaction; `outboxd worker` replicas, or a worker
// started in the application's process (startWorker), do the rest.
import pg from 'pg';
import type { PgBoss } from 'pg-boss';
import { MAX_SETTLEMENT_HANDLER_TIMEOUT_MS, schemaFromEnv, settlementHandlerTimeoutFromEnv } from './runtime/config.ts';
import { callerTransaction } from './db/caller.ts';
import { migrate } from './db/migrate.ts';
import { createPool, isPooled, type Pool, type Queryable } from './db/pool.ts';
import { isOperationId, type Operation, type OperationStatus } from './engine/operation.ts';
import { callerKeyOf } from './types/operation.ts';
import { requestCharge, type ChargeRequested } from './kinds/charge/request.ts';
import { requestRefund, type RefundRequested } from './kinds/refund/request.ts';
import { requestCancel, requestCapture, type ChangeRequested } from './kinds/hold/request.ts';
import type { CancellationReason, RefundReason } from './stripe/gateway.ts';
import { validDefinition, type EffectDefinition } from './kinds/application/definition.ts';
import { RESERVED_KINDS } from './kinds/index.ts';
import type { Policy } from './engine/kinds.ts';
import { requestEffect, type EffectRequested } from './kinds/application/request.ts';
import { startInProcessWorker, type EffectWorker } from './runtime/inProcess.ts';
import { createBoss, listensOn, onBossWarnings, startBoss } from './outbox/outbox.ts';
import {
  SETTLED_QUEUE,
  SETTLED_SLOTS,
  settledQueueFor,
  subscribeSettlements,
  SUBSCRIBER_NAME,
  TRANSACTIONAL_SLOTS,
  deliverSettlements,
  LEGACY_POLL_SECONDS,
  workSettlements,
  workSettlementsInTransaction,
  type SettlementDelivery,
  type SettlementEvent,
  type SettlementTransaction,
} from './outbox/settlements.ts';
import { SCHEMA_NAME, statementsFor } from './sql/statements.ts';

export type SettlementHandler = (event: SettlementEvent) => Promise<void> | void;
/** A transactional subscriber's handler: its writes through `tx` commit with the event's consumption. */
export type TransactionalSettlementHandler = (event: SettlementEvent, tx: SettlementTransaction) => Promise<void> | void;

/** What onSettled takes beside the handler. */
export interface SettledOptions {
  /** The handler runs in the transaction that records the event consumed by this subscriber: its
   * writes through `tx` and the consumption commit together, once (see onSettled). */
  transactional?: boolean;
  /** This subscriber's name (a-z, 0-9, `-`, `_`; at most 40): it consumes each event once, whatever
   * the other subscribers do, and the processes that subscribe under one name share its events. A
   * transactional subscriber without one is `default`. */
  subscriber?: string;
}

export type OutboxdOptions = (
  | { connectionString: string; pool?: undefined }
  /** The application's own pg Pool: outboxd runs its reads, migrations and subscriptions on it. */
  | { pool: pg.Pool; connectionString?: undefined }
) & {
  /** A session connection, when `connectionString` (or the pool) goes through a transaction pooler
   * (PgBouncer's transaction mode): migrate() takes its lock there, and with `connectionString` the
   * settlement subscription and startWorker LISTEN there, beside `connectionString` or the pool (on a
   * pool without one, they poll). Given, `connectionString` is taken to be a pooler's. */
  directConnectionString?: string;
  /** PostgreSQL schema of outboxd's tables; default OUTBOXD_SCHEMA, else `outboxd`. */
  schema?: string;
  /** Errors of the onSettled subscription's connection (it reconnects by itself); default: console.error. */
  onError?: (err: Error) => void;
  /** One onSettled delivery's time before it counts as failed and is retried; default
   * SETTLEMENT_HANDLER_TIMEOUT_MS, else 30 s. */
  settlementHandlerTimeoutMs?: number;
};

/** What requestCharge takes. */
export interface ChargeRequest {
  /** The application's order: one live charge per order. */
  orderId: string;
  /** In minor units (cents): a positive integer. */
  amount: number;
  /** ISO 4217, as Stripe accepts it (any case). */
  currency: string;
  /** Stripe customer (cus_…). */
  customer: string;
  /** Stripe payment method (pm_…). */
  paymentMethod: string;
  /** Sent to Stripe with the charge, beside operation_id: at most 49 keys (Stripe's 50 with operation_id), keys ≤ 40 and values ≤ 500 characters. */
  metadata?: Record<string, string>;
  /** After every earlier charge of the order failed: charge again even with the same payment method. */
  retry?: boolean;
  /** manual: an authorization. The operation succeeds when Stripe holds the funds (its settlement event
   * carries `hold`, with until when); requestCapture takes them, requestCancel releases them. Default automatic. */
  captureMethod?: 'automatic' | 'manual';
  /** Connect: the connected account (acct_…) the charge is made on; its captures, cancels and refunds too. */
  stripeAccount?: string;
  /** Connect: a destination charge, made on the platform and transferred to this connected account. */
  transferData?: { destination: string };
  /** Connect: the platform's fee in minor units (with stripeAccount or transferData). */
  applicationFeeAmount?: number;
}

/** What requestRefund takes. */
export interface RefundRequest {
  /** The succeeded charge operation to refund. */
  chargeOperationId: string;
  /** In minor units: a positive integer, at most what remains unrefunded of the charge. */
  amount: number;
  /** The caller's name for this refund: the same key of the same charge is the same refund. */
  key: string;
  reason?: RefundReason;
  /** A destination charge's refund: take the transfer back from the connected account too. */
  reverseTransfer?: boolean;
  /** …and give the platform's application fee back. */
  refundApplicationFee?: boolean;
}

/** What requestCapture takes. */
export interface CaptureRequest {
  /** The succeeded charge operation requested with captureMethod manual: an authorization. */
  chargeOperationId: string;
  /** The caller's name for this capture: the same key of the same charge is the same capture. */
  key: string;
  /** In minor units, at most what the authorization holds; absent: all of it. The rest is released. */
  amount?: number;
}

/** What requestCancel takes. */
export interface CancelRequest {
  chargeOperationId: string;
  /** The caller's name for this cancel: the same key of the same charge is the same cancel. */
  key: string;
  reason?: CancellationReason;
}

/** What requestEffect takes. */
export interface EffectRequest {
  /** The application's name for this effect: the same key of the same kind is the same operation. */
  key: string;
  /** What execute (and check) receive; JSON, at most 64 KiB. */
  payload?: unknown;
}

/** An operation as getOperation returns it. */
export interface PaymentOperation {
  id: string;
  /** A charge's or a refund's (null for an application's own kind). */
  orderId: string | null;
  /** `charge`, `refund`, or a kind the application defines. */
  kind: string;
  /** Its policy on an ambiguous outcome: idempotent-key, at-least-once or reconcile-before-retry. */
  policy: Policy;
  /** A charge's or a refund's, in minor units (null for an application's own kind). */
  amount: number | null;
  currency: string | null;
  /** A charge's customer and payment method (null for every other kind). */
  customer: string | null;
  paymentMethod: string | null;
  metadata: Record<string, string>;
  /** A refund's charge operation. */
  parentOperationId: string | null;
  /** The key its request gave: a refund's, capture's or cancel's (unique per charge operation), or an
   * application effect's (unique per kind); as the settlement event says it. */
  key: string | null;
  /** An application effect's payload. */
  payload: unknown;
  /** What an application's effect returned (or its check found). */
  result: unknown;
  /** Executions of an at-least-once effect after one that may have acted. */
  possibleDuplicates: number;
  status: OperationStatus;
  /** The PaymentIntent (pi_…) or Refund (re_…), once known. */
  externalId: string | null;
  /** Calls made to Stripe for it. */
  attempts: number;
  firstAttemptedAt: Date | null;
  lastError: string | null;
  /** Held for a person (see reviewReason); its status is still pending or unknown. */
  needsReview: boolean;
  reviewReason: string | null;
  /** When Stripe first said the payment is `processing` (a refund `pending`): waiting since then. */
  processingSince: Date | null;
  /** While it waits on `processing`: when it is retrieved next. */
  nextCheckAt: Date | null;
  settledAt: Date | null;
  createdAt: Date;
  updatedAt: Date;
}

/** The transactional subscribers one Outboxd on its own connections takes (#roomForTransactionalSubscriber). */
const MAX_TRANSACTIONAL_SUBSCRIBERS = 4;
/** Connections of the pool pg-boss works on that transactional deliveries never take. */
const SPARE_CONNECTIONS = 2;
/** The subscribers' pg-boss pool on outboxd's own connections: a few for fetching and settling, and one
 * for each transactional delivery in hand. Opened as they are needed. */
const SUBSCRIBER_CONNECTIONS = 4 + TRANSACTIONAL_SLOTS * MAX_TRANSACTIONAL_SUBSCRIBERS;

export class Outboxd {
  readonly schema: string;
  readonly #connection: string | pg.Pool;
  readonly #direct: string | undefined;
  readonly #db: Queryable;
  readonly #ownPool: Pool | undefined;
  readonly #onError: (err: Error) => void;
  readonly #handlers: SettlementHandler[] = [];
  readonly #effects = new Map<string, EffectDefinition>();
  readonly #settlementTimeoutMs: number;
  /** The pg-boss queues this instance works: one per named subscriber, and `settled` (a previous release's, for the unnamed handlers). */
  readonly #subscribedQueues = new Set<string>();
  /** The transactional subscribers of this instance: each holds up to TRANSACTIONAL_SLOTS connections of
   * the pool pg-boss works on while its handlers run. */
  #transactionalSubscribers = 0;
  #boss: Promise<PgBoss> | undefined;
  #subscription: Promise<void> | undefined;
  /** The unnamed handlers' delivery from settlement_outbox. */
  #delivery: SettlementDelivery | undefined;
  #worker: Promise<EffectWorker> | undefined;
  /** stop()'s one run, once called: a second call waits for it rather than returning before it is done. */
  #stopping: Promise<void> | undefined;

  constructor(options: OutboxdOptions) {
    const { connectionString, pool } = options ?? {};
    if ((connectionString === undefined) === (pool === undefined)) {
      throw new TypeError('new Outboxd({ connectionString }) or new Outboxd({ pool }): give exactly one');
    }
    this.schema = options.schema ?? schemaFromEnv();
    this.#onError = options.onError ?? ((err) => console.error('outboxd: settlement subscription error:', err));
    if (!SCHEMA_NAME.test(this.schema)) throw new TypeError(`schema must be a lower-case identifier of at most 40 characters: ${JSON.stringify(this.schema)}`);
    const direct = options.directConnectionString;
    if (direct !== undefined && (typeof direct !== 'string' || !direct)) throw new TypeError('directConnectionString must be a connection string');
    // Unset: the connection string is the session connection too (DATABASE_DIRECT_URL's default); with only
    // the application's pool there is none, and the subscription polls.
    this.#direct = direct ?? connectionString;
    this.#settlementTimeoutMs = options.settlementHandlerTimeoutMs ?? settlementHandlerTimeoutFromEnv();
    if (!Number.isSafeInteger(this.#settlementTimeoutMs) || this.#settlementTimeoutMs < 1) throw new TypeError('settlementHandlerTimeoutMs: a positive integer of milliseconds');
    if (this.#settlementTimeoutMs > MAX_SETTLEMENT_HANDLER_TIMEOUT_MS) {
      this.#onError(new Error(`settlementHandlerTimeoutMs ${this.#settlementTimeoutMs} is taken as ${MAX_SETTLEMENT_HANDLER_TIMEOUT_MS} (14 minutes): pg-boss retries a subscriber's event 15 minutes after its delivery began`));
      this.#settlementTimeoutMs = MAX_SETTLEMENT_HANDLER_TIMEOUT_MS;
    }
    if (pool) {
      this.#connection = pool;
      this.#db = { sql: statementsFor(this.schema), query: pool.query.bind(pool) as pg.Pool['query'] };
    } else {
      this.#ownPool = createPool(connectionString!, {
        schema: this.schema,
        max: 4,
        applicationName: 'outboxd-library',
        pooled: isPooled(connectionString!, direct),
      });
      this.#connection = connectionString!;
      this.#db = this.#ownPool;
    }
  }

  /** A table of outboxd's missing (42P01): its migrations have not run on this database, or in this schema. */
  #notMigrated = (err: unknown): never => {
    if ((err as { code?: unknown } | null)?.code !== '42P01') throw err;
    throw new Error(`the database is not migrated (${(err as Error).message}, schema ${this.schema}): run \`outboxd migrate\` or Outboxd.migrate()`, { cause: err });
  };

  /** On the application's connection, whatever it goes through: unnamed statements (a name prepared in one
   * of its transactions may not exist on the server connection of the next, behind a pooler). */
  get #callerSql() {
    return statementsFor(this.schema);
  }

  /** Creates or upgrades outboxd's tables in its schema and pg-boss's queues. Idempotent; safe beside other migrations. */
  migrate(): Promise<void> {
    return migrate(this.#direct ?? this.#connection, this.schema);
  }

  /**
   * Requests a charge inside the caller's transaction `tx` (a drizzle node-postgres transaction, a pg
   * client inside BEGIN, or anything with query(text, values)): the operation and its outbox row commit
   * or roll back with it. The same orderId again returns the same operation (created: false).
   * Throws ValidationError (bad input, naming the field) or OrderConflictError before writing anything.
   */
  async requestCharge(tx: object, request: ChargeRequest): Promise<ChargeRequested> {
    return requestCharge(callerTransaction(tx, this.#callerSql), request).catch(this.#notMigrated);
  }

  /**
   * Requests a refund of a succeeded charge inside the caller's transaction `tx` (as requestCharge):
   * a refund operation and its outbox row, committed or rolled back with it. The same key of the same
   * charge again returns the same refund operation (created: false). Concurrent refunds of one charge
   * wait for each other's transaction. Throws ValidationError, OperationNotFoundError or RefundRefused
   * (the charge has not succeeded; the amount exceeds what remains unrefunded, counting refunds still
   * pending or unknown; the key names a refund of another amount) before writing anything.
   */
  async requestRefund(tx: object, request: RefundRequest): Promise<RefundRequested> {
    return requestRefund(callerTransaction(tx, this.#callerSql), request).catch(this.#notMigrated);
  }

  /**
   * Requests the capture of an authorization (a charge requested with captureMethod manual, succeeded:
   * Stripe holds its funds) inside the caller's transaction `tx`, as requestRefund. The same key again
   * returns the same capture operation (created: false). Throws ValidationError, OperationNotFoundError
   * or AuthorizationRefused (an automatic charge; one that holds nothing: not succeeded, captured,
   * cancelled or expired; more than it holds; the key names another capture) before writing anything.
   */
  async requestCapture(tx: object, request: CaptureRequest): Promise<ChangeRequested> {
    return requestCapture(callerTransaction(tx, this.#callerSql), request).catch(this.#notMigrated);
  }

  /** Requests the cancel of an authorization, releasing what it holds, as requestCapture (refused the same
   * ways; a captured charge is refunded instead). */
  async requestCancel(tx: object, request: CancelRequest): Promise<ChangeRequested> {
    return requestCancel(callerTransaction(tx, this.#callerSql), request).catch(this.#notMigrated);
  }

  /**
   * Defines a kind of effect of the application's, with its policy on an outcome nobody knows:
   * `at-least-once` (executed again; a duplicate is tolerated and counted) or `reconcile-before-retry`
   * (`check` establishes whether an earlier execution happened before any other; when it cannot tell, a
   * person decides). `execute({ operationId, key, payload, attempt, signal })` returns a result to
   * record (JSON) or throws EffectFailed when the effect definitively did not happen; anything else is
   * ambiguous. Define a kind in every process that requests it or runs it, before startWorker.
   */
  defineEffect(kind: string, definition: EffectDefinition): void {
    if (this.#worker) throw new Error('define every effect before startWorker');
    const valid = validDefinition(kind, definition, RESERVED_KINDS);
    // Two modules defining one kind differently would run whichever came last; the same one twice (its
    // functions and settings, in a literal of its own or not) is harmless.
    const defined = this.#effects.get(kind);
    const same = (a: EffectDefinition, b: EffectDefinition) =>
      a.policy === b.policy && a.execute === b.execute && a.check === b.check && a.timeoutMs === b.timeoutMs;
    if (defined !== undefined && !same(defined, valid)) throw new TypeError(`the effect kind ${kind} is already defined here, differently`);
    this.#effects.set(kind, valid);
  }

  /**
   * Requests an effect of a defined kind inside the caller's transaction `tx` (as requestCharge): the
   * operation and its outbox row commit or roll back with it. The same key of the same kind again
   * returns the same operation (created: false). Throws ValidationError (an undefined kind, a bad key or
   * payload) or EffectConflictError (the key names an effect requested with another payload).
   */
  async requestEffect(tx: object, kind: string, request: EffectRequest): Promise<EffectRequested> {
    return requestEffect(callerTransaction(tx, this.#callerSql), this.#effects, kind, request).catch(this.#notMigrated);
  }

  /**
   * Runs a dispatcher in this process: it carries out the built-in kinds (Stripe, as configured by
   * STRIPE_SECRET_KEY and the other variables `outboxd worker` reads) and the kinds defined here, up to
   * `concurrency` operations at once whatever their kind, with the same leases, fences, retries, review and metrics
   * as `outboxd worker` replicas, beside which it may run. stop() ends it.
   */
  async startWorker(options: { concurrency: number }): Promise<EffectWorker> {
    if (this.#stopping) throw new Error('this Outboxd is stopped');
    const concurrency = options?.concurrency;
    if (!Number.isSafeInteger(concurrency) || concurrency < 1 || concurrency > 256) throw new TypeError('startWorker({ concurrency }): an integer from 1 to 256');
    if (this.#worker) throw new Error('this Outboxd already runs a worker');
    const effects = new Map(this.#effects);
    this.#worker = startInProcessWorker({ connection: this.#connection, directUrl: this.#direct, schema: this.schema, sql: this.#db.sql, concurrency, effects });
    this.#worker.catch(() => (this.#worker = undefined));
    return this.#worker;
  }

  /** The operation, or undefined when there is none with this id. */
  async getOperation(id: string): Promise<PaymentOperation | undefined> {
    if (typeof id !== 'string' || !isOperationId(id)) return undefined;
    const { rows } = await this.#db.query(this.#db.sql.showOperation(id.toLowerCase())).catch(this.#notMigrated);
    return rows[0] ? toPaymentOperation(rows[0]) : undefined;
  }

  /**
   * Calls `handler` with every settlement of an operation (succeeded or failed), from whichever
   * process settled it. Resolves once subscribed.
   *
   * By default AT LEAST ONCE: make it idempotent (the operationId identifies the settlement). A handler
   * that throws, or runs past settlementHandlerTimeoutMs, gets the event again later, with backoff;
   * after hours of failures the event is dead-lettered (see the runbook). Up to 10 events (of
   * different operations) are handled at once, each on its own, so a slow one holds up no other.
   * Unnamed handlers of this instance all see each event, one after the other; instances share the
   * events between them, in several processes or in one (two modules each with an Outboxd of its own
   * hear each event once between them: give each a `subscriber` name to hear every event).
   *
   * `{ transactional: true }`: `handler(event, tx)` runs in a transaction in which outboxd also records
   * this event consumed by this subscriber; its writes through `tx` (`tx.query(text, values)`) and that
   * record commit together when it returns, and roll back together when it throws or times out (the
   * event is then redelivered with backoff). A delivery whose claim expired and was taken over commits
   * nothing. So the application's own tables see each event once. Calls to other services from the
   * handler are not covered: give them an idempotency key.
   *
   * `{ subscriber }`: the subscriber's name; each named subscriber consumes each event independently
   * (on a queue of its own), from the events settled after it first subscribed.
   */
  async onSettled(handler: SettlementHandler, options?: SettledOptions & { transactional?: false }): Promise<void>;
  async onSettled(handler: TransactionalSettlementHandler, options: SettledOptions & { transactional: true }): Promise<void>;
  async onSettled(handler: SettlementHandler | TransactionalSettlementHandler, options: SettledOptions = {}): Promise<void> {
    if (this.#stopping) throw new Error('this Outboxd is stopped');
    if (typeof handler !== 'function') throw new TypeError('onSettled takes a function');
    const { transactional = false, subscriber } = options ?? {};
    if (typeof transactional !== 'boolean') throw new TypeError('onSettled: transactional is true or false');
    if (subscriber === undefined && !transactional) {
      this.#handlers.push(handler as SettlementHandler);
      try {
        await (this.#subscription ??= this.#subscribe().catch(async (err) => {
          // Not subscribed: onSettled may be called again, and nothing this attempt started goes on.
          this.#subscription = undefined;
          await this.#delivery?.stop();
          this.#delivery = undefined;
          throw err;
        }));
      } catch (err) {
        this.#handlers.splice(this.#handlers.indexOf(handler as SettlementHandler), 1);
        throw err;
      }
      return;
    }
    const name = subscriber ?? 'default';
    if (typeof name !== 'string' || !SUBSCRIBER_NAME.test(name)) {
      throw new TypeError(`onSettled: subscriber is a name of a-z, 0-9, - and _ (at most 40): ${JSON.stringify(name)}`);
    }
    const queue = settledQueueFor(name);
    if (this.#subscribedQueues.has(queue)) throw new TypeError(`onSettled: this instance already has the subscriber ${JSON.stringify(name)}`);
    if (transactional) this.#roomForTransactionalSubscriber();
    this.#subscribedQueues.add(queue);
    if (transactional) this.#transactionalSubscribers++;
    try {
      const boss = await this.#startBoss();
      await subscribeSettlements(boss, name);
      const work = { queue, subscriber: name, timeoutMs: this.#settlementTimeoutMs };
      if (transactional) {
        // On pg-boss's own pool the handler's statements read with pg's global parsers, as the
        // application's connections do; on the application's pool, with that pool's.
        const handlerTypes = typeof this.#connection === 'string' ? pg.types : undefined;
        await workSettlementsInTransaction(boss, this.#db.sql, { ...work, slots: TRANSACTIONAL_SLOTS, handlerTypes }, async (event, tx) => {
          await (handler as TransactionalSettlementHandler)(event, tx);
        });
      } else {
        await workSettlements(boss, { ...work, slots: SETTLED_SLOTS }, async (event) => {
          await (handler as SettlementHandler)(event);
        });
      }
    } catch (err) {
      // Not subscribed: the same name may be tried again.
      this.#subscribedQueues.delete(queue);
      if (transactional) this.#transactionalSubscribers--;
      throw err;
    }
  }

  /** Refuses a transactional subscriber whose deliveries could take all but SPARE_CONNECTIONS of the pool
   * pg-boss works on: its heartbeats and fetches would wait out their connect timeout, every delivery
   * whose handler outlived the heartbeat would be retried, and none would ever commit. */
  #roomForTransactionalSubscriber(): void {
    const [max, pool] = typeof this.#connection === 'string' ? [SUBSCRIBER_CONNECTIONS, "outboxd's own pool"] : [this.#connection.options.max ?? 10, "the application's pool"];
    const held = TRANSACTIONAL_SLOTS * (this.#transactionalSubscribers + 1);
    if (held + SPARE_CONNECTIONS > max) {
      throw new TypeError(
        `onSettled: a transactional subscriber holds a connection for each of its ${TRANSACTIONAL_SLOTS} deliveries in hand; one more would hold ${held} of the ${max} connections of ${pool}, leaving fewer than ${SPARE_CONNECTIONS} for pg-boss's fetches and heartbeats, and no delivery would commit: subscribe it on another Outboxd${typeof this.#connection === 'string' ? '' : ', or give the pool more connections (max)'}`,
      );
    }
  }

  async #subscribe(): Promise<void> {
    const boss = await this.#startBoss();
    if (this.#stopping) return;
    const handle = async (event: SettlementEvent) => {
      for (const handler of this.#handlers) await handler(event);
    };
    const pool = this.#ownPool ?? (this.#connection as pg.Pool);
    // Woken by the table's NOTIFY where pg-boss LISTENs too (a session connection), else polling.
    const listener = listensOn(this.#direct) ? boss.getDb() : undefined;
    this.#delivery = deliverSettlements({ db: this.#db, pool, boss, listener }, { slots: SETTLED_SLOTS, timeoutMs: this.#settlementTimeoutMs, onError: this.#onError }, handle);
    // What workers of the release before put on the pg-boss queue `settled` (src/outbox/settlements.ts):
    // its first loop looks every few seconds, the others when woken by a job found.
    this.#subscribedQueues.add(SETTLED_QUEUE);
    await workSettlements(boss, { queue: SETTLED_QUEUE, slots: SETTLED_SLOTS, timeoutMs: this.#settlementTimeoutMs, idlePollSeconds: LEGACY_POLL_SECONDS }, handle);
  }

  /** The pg-boss every subscription of this instance works on (SUBSCRIBER_CONNECTIONS). */
  #startBoss(): Promise<PgBoss> {
    this.#boss ??= (async () => {
      const boss = createBoss(this.#connection, 'subscriber', SUBSCRIBER_CONNECTIONS, this.schema, this.#direct);
      boss.on('error', this.#onError);
      onBossWarnings(boss, (message) => this.#onError(new Error(`pg-boss: ${message}`)));
      try {
        await startBoss(boss, this.schema);
        await this.#deliverFromTable();
      } catch (err) {
        // A database not up yet, or not migrated: the next onSettled starts another, and nothing of this
        // one (its connections, its LISTEN, its timers) outlives the failure, or stop().
        this.#boss = undefined;
        await boss.stop({ graceful: false }).catch(() => {});
        throw err;
      }
      return boss;
    })();
    return this.#boss;
  }

  /** An application of this release subscribes: from now on the workers leave settlement events in their
   * table for the unnamed handlers (src/outbox/settlements.ts). A role that may not say so leaves them
   * relaying every event to the queue `settled` as well, which this instance drains too: said once, not fatal. */
  async #deliverFromTable(): Promise<void> {
    try {
      await this.#db.query(this.#db.sql.deliverFromTable());
    } catch (err) {
      if ((err as { code?: string }).code !== '42501') throw err;
      this.#onError(new Error(`settlement events stay on the queue settled: this role may not write settlement_delivery (${(err as Error).message})`));
    }
  }

  /** Stops the worker (calls in flight finish first) and the subscription (a handler running finishes
   * first), and releases what this instance holds (its own pool; never an application's). */
  stop(): Promise<void> {
    return (this.#stopping ??= this.#stop());
  }

  async #stop(): Promise<void> {
    await (await this.#worker?.catch(() => undefined))?.stop();
    // A subscription still starting is let finish first, so that what it starts is stopped too.
    await this.#subscription?.catch(() => undefined);
    await this.#delivery?.stop();
    const boss = await this.#boss?.catch(() => undefined);
    for (const queue of this.#subscribedQueues) await boss?.offWork(queue, { wait: true });
    await boss?.stop({ graceful: true, timeout: 10_000 });
    await this.#ownPool?.end();
  }
}

function toPaymentOperation(op: Operation): PaymentOperation {
  return {
    id: op.id,
    orderId: op.order_id,
    kind: op.kind,
    policy: op.policy,
    amount: op.amount,
    currency: op.currency,
    customer: op.customer_id,
    paymentMethod: op.payment_method,
    metadata: op.metadata,
    parentOperationId: op.parent_operation_id,
    key: callerKeyOf(op),
    payload: op.payload,
    result: op.result,
    possibleDuplicates: op.possible_duplicates,
    status: op.status,
    externalId: op.external_id,
    attempts: op.attempts,
    firstAttemptedAt: op.first_attempted_at,
    lastError: op.last_error,
    needsReview: op.needs_review,
    reviewReason: op.review_reason,
    processingSince: op.processing_since,
    nextCheckAt: op.next_check_at,
    settledAt: op.settled_at,
    createdAt: op.created_at,
    updatedAt: op.updated_at,
  };
}
