// The outbox. requestCharge (and every other request of an effect) writes a plain charge_outbox row in
// the caller's transaction; workers relay the rows to the pg-boss queue of the operation's kind in
// batches (insert the jobs and delete the rows in one transaction), and pg-boss then gives claiming,
// retries with backoff, heartbeats and dead letter. A job carries only the operation id: the operation
// row is the durable truth, the job is the reminder to drive it (at least once).
//
// Measured here (npm run bench): a pg-boss send() inside the business transaction halves its rate; a
// plain row keeps it near the raw insert rate, and one insert() of a batch costs little per job.
import type pg from 'pg';
import { PgBoss, type Db as IDatabase, type Queue } from 'pg-boss';
import { beginBossTransaction } from '../db/bossTransaction.ts';
import { directListener, PooledBossDb } from '../db/bossDb.ts';
import { bossDb, bossQuery, inTransaction, isPooled, type Pool, type Queryable } from '../db/pool.ts';
import { BUILT_IN_KINDS } from '../kinds/names.ts';
import { DEAD_LETTER_SUFFIX } from '../types/contracts.ts';
import { createSettlementQueues, relaySettlements, SETTLED_DEAD_QUEUE, SETTLED_EVENT, SETTLED_QUEUE } from './settlements.ts';
import { bossSchemaFor, builtInTypes } from '../sql/statements.ts';
import { traceContextPropagator, traceRelay, untraced } from '../telemetry/tracing.ts';
import { createPruneQueue, PRUNE_QUEUE } from './retention.ts';

export { bossSchemaFor };

/**
 * Each kind of effect has a queue of its own, named as the kind, so that only replicas that can carry a
 * kind out take its jobs, and one kind's backlog never holds up another's; its dead letter is the kind's
 * name with DEAD_LETTER_SUFFIX (src/types/contracts.ts, which the sweep's SQL reads too).
 */
export const queueFor = (kind: string): string => kind;
/** Where pg-boss moves a job whose retries ran out; a worker flags its operation for review. */
export const deadQueueFor = (kind: string): string => `${kind}${DEAD_LETTER_SUFFIX}`;

/** What a kind's job carries: the operation it drives. */
export interface OperationJob {
  operationId: string;
  /** Set by the relay when the operation was traced: its first dispatch continues that trace. pg-boss's
   * own propagation cannot carry it, as one insert() stores a single context for the whole batch. */
  traceparent?: string;
}

/**
 * pg-boss's own retention, set on every queue of outboxd's rather than left to its defaults: a completed
 * job is deleted three days after it completed (the ledger and the timeline keep what happened; three days
 * keep a settlement's delivery on the console's timeline through a weekend), a job never taken
 * after two weeks (the reconcile sweep flags an operation no job drives).
 */
export const JOB_RETENTION = { deleteAfterSeconds: 3 * 86_400, retentionSeconds: 14 * 86_400 } as const;

/**
 * Retries are the re-drive of ambiguous (`unknown`) and rate-limited operations: capped exponential
 * backoff with jitter from 1 s to 5 min, always with the same idempotency key because the key is derived
 * from the operation. 40 retries spans several hours; what is still unsettled then is dead-lettered and
 * shown for review, and the reconcile path takes over once the key window has passed.
 * heartbeatSeconds: a killed replica's job is retried within seconds, not after the 15-minute expiry.
 */
export const KIND_QUEUE_OPTIONS: Omit<Queue, 'name' | 'deadLetter'> = {
  ...JOB_RETENTION,
  retryLimit: 40,
  retryDelay: 1,
  retryBackoff: true,
  retryDelayMax: 300,
  heartbeatSeconds: 10,
  expireInSeconds: 15 * 60,
  notify: true,
};

/** Every kind's queue retries alike, into its own dead letter. */
export const queueOptionsFor = (kind: string): Omit<Queue, 'name'> => ({ ...KIND_QUEUE_OPTIONS, deadLetter: deadQueueFor(kind) });

/** Creates a kind's queue and its dead letter (idempotent). */
export async function createKindQueues(boss: PgBoss, kind: string): Promise<void> {
  await boss.createQueue(deadQueueFor(kind), { ...JOB_RETENTION, retryLimit: 5, retryBackoff: true, notify: true });
  await boss.createQueue(queueFor(kind), queueOptionsFor(kind));
}

/** The kinds whose queues a pg-boss instance has seen exist (the built-in ones: created by migrate). */
const knownQueues = new WeakMap<PgBoss, Set<string>>();

/** An application's kind may be requested before any replica that defines it has started: its first
 * relayed row creates its queues (once per process), so the job waits there for such a replica. A
 * dispatcher creates those of the kinds it carries out as it starts, seen then by its own relay. */
export async function ensureKindQueues(boss: PgBoss, kind: string): Promise<void> {
  if (!queuesUnknown(boss, kind)) return;
  await createKindQueues(boss, kind);
  knownQueues.get(boss)!.add(kind);
}

const queuesUnknown = (boss: PgBoss, kind: string): boolean =>
  !BUILT_IN_KINDS.includes(kind) && !(knownQueues.get(boss) ?? knownQueues.set(boss, new Set()).get(boss)!).has(kind);

/** A relay pass met kinds whose queues it has not seen: it gives its rows back, to create them outside its
 * transaction (pg-boss creates a queue on a connection of its own: on an application's pool of one, the
 * pass would wait for itself for ever, holding its rows). */
class QueuesUnknown extends Error {
  readonly kinds: string[];
  constructor(kinds: string[]) {
    super(`no queues seen yet for ${kinds.join(', ')}`);
    this.kinds = kinds;
  }
}

/** Seen to exist no longer (deleted since, by an operator retiring a kind while rows of it still waited):
 * the next relayed row creates its queues again, rather than every pass failing on it, and with it every
 * row of every kind taken in the same batch. */
function forgetKindQueues(boss: PgBoss, kind: string): void {
  knownQueues.get(boss)?.delete(kind);
}

/** Whether a worker can LISTEN: with a session connection for it (DATABASE_DIRECT_URL, or DATABASE_URL
 * itself unless it is a transaction pooler's; the library's directConnectionString, or its
 * connectionString), whatever its statements run on. An application's pool given alone has none. */
export const listensOn = (directUrl: string | undefined): boolean => directUrl !== undefined;

/**
 * `migrator` installs or upgrades pg-boss's schema; `worker` also supervises (heartbeat and expiry
 * checks every few seconds, so a lost job comes back fast) and listens for NOTIFY; `subscriber` (an
 * application's onSettled) listens too; `client` only sends.
 * `connection`: a connection string, or an application's pool (pg-boss then runs on it, and polls).
 * `directUrl`: a session connection for LISTEN (DATABASE_DIRECT_URL); without one pg-boss polls, as a
 * transaction pooler cannot keep a LISTEN.
 */
export function createBoss(
  connection: string | pg.Pool,
  role: 'migrator' | 'worker' | 'subscriber' | 'client',
  max: number,
  schema: string,
  directUrl?: string,
): PgBoss {
  const worker = role === 'worker';
  const listens = (worker || role === 'subscriber') && listensOn(directUrl);
  const application_name = `outboxd-boss-${role}`;
  const pooled = typeof connection === 'string' && isPooled(connection, directUrl);
  // A socket whose peer vanished (a failover) is noticed by the kernel and frees its slot.
  // pg-boss reads its rows (a job's data) with pg's built-in parsers, whatever the application set globally.
  const database = { connectionString: connection as string, max, application_name, keepAlive: true, types: builtInTypes };
  // On an application's pool, with a direct URL: LISTEN on a session of its own there.
  const listener = typeof connection !== 'string' && listens ? directListener(database, directUrl!) : undefined;
  void listener?.open(); // makes the pool it never uses; nothing connects before listen()
  const boss = new PgBoss({
    ...(typeof connection !== 'string'
      ? {
          db: {
            executeSql: (text: string, values?: unknown[]) => bossQuery(connection, text, values),
            beginTransaction: () => beginBossTransaction(connection),
            ...(listener ? { listen: listener.listen.bind(listener) } : {}),
          },
        }
      : listens && pooled
        ? { db: new PooledBossDb(database, directUrl!) }
        : database),
    schema: bossSchemaFor(schema),
    application_name,
    migrate: role === 'migrator',
    createSchema: role === 'migrator',
    supervise: worker,
    schedule: worker,
    useListenNotify: listens,
    superviseIntervalSeconds: 5,
    monitorIntervalSeconds: 5,
    registerInstance: worker,
    // A job sent inside a span (a requeue) is processed in that span's trace: pg-boss's own propagation,
    // trace ids only (no baggage kept in the job table).
    openTelemetry: { propagateContext: true, propagator: traceContextPropagator },
  });
  // A lost LISTEN connection is an error of the listener's (it reconnects): heard where pg-boss's are.
  listener?.on('error', (err: Error) => boss.emit('error', err));
  return boss;
}

/** How often the same pg-boss warning is passed on: pg-boss repeats a backlog's at every monitor pass (5 s). */
const BOSS_WARNING_EVERY_MS = 60_000;

/**
 * pg-boss's warnings (a queue's backlog past 10,000 jobs, the transaction horizon held back, autovacuum
 * off, a query over 30 s, this host's clock apart from the database's, a LISTEN it could not start and so
 * polls), passed to `tell`: the same one (its message, numbers aside) at most once a minute. A slow
 * query's bound values are left out: they may be a whole batch of jobs.
 */
export function onBossWarnings(boss: PgBoss, tell: (message: string, data: Record<string, unknown>) => void): void {
  const toldAt = new Map<string, number>();
  boss.on('warning', ({ message, data }) => {
    const same = message.replace(/\d+(\.\d+)?/g, '#');
    const now = Date.now();
    if (now - (toldAt.get(same) ?? -Infinity) < BOSS_WARNING_EVERY_MS) return;
    toldAt.set(same, now);
    const { values: _values, ...kept } = (data ?? {}) as Record<string, unknown>;
    tell(message, kept);
  });
}

/** What pg-boss's start says of a database where `outboxd migrate` has not run: its schema missing, or older. */
const BOSS_NOT_MIGRATED = new Map([
  ['pg-boss is not installed', 'is missing'],
  ['pg-boss database requires migrations', 'is older than this release'],
]);

/** Starts `boss`; on a database not migrated yet, says so in outboxd's words rather than pg-boss's. */
export async function startBoss(boss: PgBoss, schema: string): Promise<void> {
  try {
    await boss.start();
  } catch (err) {
    const state = BOSS_NOT_MIGRATED.get((err as Error | null)?.message ?? '');
    if (!state) throw err;
    throw new Error(`the database is not migrated (pg-boss's schema ${bossSchemaFor(schema)} ${state}): run \`outboxd migrate\` or Outboxd.migrate()`, { cause: err });
  }
}

/** The scheduled reconcile sweep (pg-boss cron); one sweep at a time across all replicas. */
export const RECONCILE_QUEUE = 'reconcile';

/** Creates the queues (idempotent). Run by `outboxd migrate`, after pg-boss installed its schema. */
export async function createQueues(boss: PgBoss): Promise<void> {
  for (const kind of BUILT_IN_KINDS) await createKindQueues(boss, kind);
  await boss.createQueue(RECONCILE_QUEUE, { policy: 'singleton', retryLimit: 0, expireInSeconds: 15 * 60 });
  await createPruneQueue(boss);
  await createSettlementQueues(boss);
  // Queues made by an earlier release keep the options they were created with: set the retention on them.
  const queues = [...BUILT_IN_KINDS.flatMap((kind) => [queueFor(kind), deadQueueFor(kind)]), RECONCILE_QUEUE, PRUNE_QUEUE, SETTLED_QUEUE];
  for (const queue of queues) await boss.updateQueue(queue, JOB_RETENTION);
  // The dead letter keeps its events for a redrive (src/outbox/settlements.ts); its completed ones go as any.
  await boss.updateQueue(SETTLED_DEAD_QUEUE, { deleteAfterSeconds: JOB_RETENTION.deleteAfterSeconds });
}

export const RELAY_BATCH = 500;

/** What one relay pass moved from each outbox. */
export interface RelayPass {
  operations: number;
  settlements: number;
}

/**
 * Relays both outboxes: operations to jobs of their kind's queue, settlement events to the named
 * subscribers' queues, and to `settled` until the unnamed handlers take them from their table
 * (src/outbox/settlements.ts). An outbox the pass before (`last`) found rows in is taken from at once;
 * otherwise one statement looks into both first, so an idle relay opens no transaction. A pass that
 * moved `limit` rows from either leaves more waiting.
 */
export async function relayOutbox(db: Pool, boss: PgBoss, limit = RELAY_BATCH, last: RelayPass = { operations: 0, settlements: 0 }): Promise<RelayPass> {
  let operations = last.operations > 0;
  let settlements = last.settlements > 0;
  if (!operations || !settlements) {
    const { rows } = await db.query(db.sql.outboxesHaveRows(SETTLED_EVENT));
    operations ||= rows[0].operations;
    settlements ||= rows[0].settlements;
  }
  return {
    operations: operations ? await relayOperations(db, boss, limit) : 0,
    settlements: settlements ? await relaySettlements(db, boss, limit) : 0,
  };
}

/**
 * Moves up to `limit` outbox rows to pg-boss jobs in one transaction: the rows are deleted as their
 * jobs are inserted, so each row becomes exactly one job, and relays on several replicas take
 * disjoint batches (SKIP LOCKED). Returns how many were relayed.
 */
async function relayOperations(db: Pool, boss: PgBoss, limit: number): Promise<number> {
  try {
    return await relayBatch(db, boss, limit);
  } catch (err) {
    if (!(err instanceof QueuesUnknown)) throw err;
    for (const kind of err.kinds) await ensureKindQueues(boss, kind);
    return relayBatch(db, boss, limit);
  }
}

async function relayBatch(db: Pool, boss: PgBoss, limit: number): Promise<number> {
  return inTransaction(db, async (tx) => {
    const { rows } = await tx.query(tx.sql.takeOutboxBatch(limit));
    if (rows.length === 0) return 0;
    const unknown = [...new Set(rows.map((r: { kind: string }) => r.kind))].filter((kind) => queuesUnknown(boss, kind));
    if (unknown.length) throw new QueuesUnknown(unknown);
    await traceRelay(rows, async (traceparents) => {
      const byKind = new Map<string, { data: OperationJob }[]>();
      rows.forEach((r: { operation_id: string; kind: string }, i) => {
        const jobs = byKind.get(r.kind) ?? byKind.set(r.kind, []).get(r.kind)!;
        jobs.push({ data: { operationId: r.operation_id, traceparent: traceparents[i] } });
      });
      for (const [kind, jobs] of byKind) {
        await untraced(() => boss.insert(queueFor(kind), jobs, { db: bossDb(tx) })).catch((err: unknown) => {
          forgetKindQueues(boss, kind);
          throw err;
        });
      }
    });
    return rows.length;
  });
}

/** A job in one of `queues` that will still drive (or is driving) the operation: created, waiting to
 * retry, or active. Read through `db`, so it can join the caller's transaction. */
export async function liveJobFor(db: Queryable, operationId: string, queues: string[]): Promise<{ id: string; state: string } | undefined> {
  const { rows } = await db.query(db.sql.liveJobOf(queues, operationId));
  return rows[0];
}

/** Enqueues a job for the operation on its kind's queue directly (admin re-drive, a reschedule), through
 * `db` so it joins the caller's transaction. */
export async function enqueueOperation(
  boss: PgBoss,
  db: IDatabase,
  op: { id: string; kind: string },
  startAfterSeconds?: number,
): Promise<string | null> {
  return boss.send(queueFor(op.kind), { operationId: op.id } satisfies OperationJob, { db, ...(startAfterSeconds !== undefined ? { startAfter: startAfterSeconds } : {}) });
}
