import pg from 'pg';
import type { Db as IDatabase } from 'pg-boss';
import { ConfigError } from '../runtime/config.ts';
import { builtInTypes, resultTypes, statementsFor, type Statements } from '../sql/statements.ts';

export type PoolClient = pg.PoolClient;
/** outboxd's own pool, bound to one schema: `pool.sql` are the statements for it. */
export type Pool = pg.Pool & { readonly sql: Statements };
/** A transaction's client as `inTransaction` hands it out, with the same statements. */
export interface Tx {
  query: pg.PoolClient['query'];
  readonly sql: Statements;
}
/** Anything that runs outboxd's statements: the pool for single statements, a transaction's client. */
export type Queryable = (Pick<pg.Pool, 'query'> | Tx) & { readonly sql: Statements };

/** How long one of outboxd's statements waits for a lock another transaction holds (an application's
 * `select … for update`, a migration's DDL) before it fails and is retried later, instead of holding a
 * connection and a job slot as long as that transaction lasts. */
export const LOCK_TIMEOUT_MS = 5_000;
/** The server's limit on one of outboxd's statements. */
export const STATEMENT_TIMEOUT_MS = 60_000;
/** The client's, beyond the server's: a statement whose answer never comes (a dead socket, a server that
 * stopped answering) gives its connection up, which is then discarded. */
export const QUERY_TIMEOUT_MS = STATEMENT_TIMEOUT_MS + 15_000;

/** outboxd's transactions wait on nothing but their own statements (never a call out): one idle this long
 * is a process frozen inside it (SIGSTOP, a paused VM, a host cut off with its socket open), whose rows
 * (a relay's 500 outbox rows, an operation's) nobody else could take until it resumed, or TCP keepalive
 * gave up hours later. The server ends it. */
export const IDLE_IN_TRANSACTION_MS = 30_000;

/** The timeouts as statements: SET LOCAL in a transaction, SET for a session that is outboxd's alone. */
const timeouts = (scope: 'local' | 'session') =>
  ([['lock_timeout', LOCK_TIMEOUT_MS], ['statement_timeout', STATEMENT_TIMEOUT_MS], ['idle_in_transaction_session_timeout', IDLE_IN_TRANSACTION_MS]] as const)
    .map(([name, ms]) => `set ${scope === 'local' ? 'local ' : ''}${name} = ${ms}`)
    .join('; ');

/** Whether `url` reaches PostgreSQL through a transaction pooler: a direct URL was given beside it. */
export const isPooled = (url: string, directUrl: string | undefined): boolean => directUrl !== undefined && directUrl !== url;

/** How long the pooler check waits to connect, and for each answer. */
const PROBE_TIMEOUT_MS = 10_000;

/**
 * How two connections held open at once showed that they share PostgreSQL sessions, or undefined when
 * each kept its own. Reached directly, or through a pooler in session mode, each is served by one backend
 * of its own throughout; a transaction pooler hands each statement to a free server connection, the one
 * the other connection just used as often as not. Asked in turn three times, so that a pool busy with
 * other clients meanwhile still shows it; never a false alarm on a direct connection. (A pooler that
 * spreads one connection's statements over several servers, as pgpool-II's statement-level load balancing
 * does, is taken for a transaction pooler too.) Two connections beyond the pool's own, for a moment.
 */
export async function sharedSession(connection: string | pg.Pool, applicationName: string): Promise<string | undefined> {
  const config = connectionConfig(connection);
  const clients = [0, 1].map(() => new pg.Client({ ...config, application_name: applicationName, connectionTimeoutMillis: PROBE_TIMEOUT_MS, query_timeout: PROBE_TIMEOUT_MS }));
  // A connection lost between the questions emits 'error': unheard, it would end the application's process.
  for (const c of clients) c.on('error', () => {});
  try {
    await Promise.all(clients.map((c) => c.connect()));
    const pids: number[][] = [[], []];
    for (let round = 0; round < 3; round++) {
      for (const [i, c] of clients.entries()) pids[i]!.push((await c.query('select pg_backend_pid() as pid')).rows[0].pid);
    }
    const [a, b] = pids.map((p) => new Set(p)) as [Set<number>, Set<number>];
    if (a.size > 1 || b.size > 1) return `one connection was served by backends ${[...a, ...b].join(', ')} in turn`;
    const [pid] = [...a];
    if (b.has(pid!)) return `two connections were both served by backend ${pid}`;
    return undefined;
  } finally {
    await Promise.all(clients.map((c) => c.end().catch(() => {})));
  }
}

/** How to open a connection of one's own where `connection` connects. A pool keeps its password off its
 * enumerable options (a spread would drop it, or its function). */
export const connectionConfig = (connection: string | pg.Pool): pg.ClientConfig =>
  typeof connection === 'string' ? { connectionString: connection } : { ...connection.options, password: connection.options.password };

/** Each URL a pool of session settings was made for, checked once per process (sharedSession). */
const sessionChecks = new Map<string, Promise<void>>();

/**
 * Refuses a URL that reaches PostgreSQL through a transaction pooler when it was not said to (no direct
 * URL beside it): a pool for it sets its timeouts on each session and names its statements, and there the
 * settings would stay on the pooler's server connections for its other clients, and the names collide.
 * A check that could not ask (the database away) is asked again by the next connection.
 */
export function ownSessions(connectionString: string): Promise<void> {
  let check = sessionChecks.get(connectionString);
  if (check) return check;
  check = sharedSession(connectionString, 'outboxd-session-check').then((shared) => {
    if (!shared) return;
    throw new ConfigError(
      `the database URL reaches PostgreSQL through a transaction pooler (${shared}), and no direct URL was given beside it: ` +
        "outboxd's session settings and named statements would reach the pooler's other clients. Give the database itself as " +
        'DATABASE_DIRECT_URL (the library: directConnectionString), keeping the pooler as DATABASE_URL (connectionString)',
    );
  });
  check.catch((err: unknown) => {
    if (!(err instanceof ConfigError)) sessionChecks.delete(connectionString);
  });
  sessionChecks.set(connectionString, check);
  return check;
}

export function createPool(
  connectionString: string,
  opts: {
    schema: string;
    max?: number;
    applicationName?: string;
    /** The connection string reaches PostgreSQL through a transaction pooler (PgBouncer's transaction mode):
     * unnamed statements, and no session settings (the next transaction may run on another server
     * connection, and this one serves other clients). */
    pooled?: boolean;
    /** false: no lock, statement or query timeout (the migrator's own connection, whose DDL may run long). */
    timeouts?: boolean;
    /** The client's limit on a statement; default QUERY_TIMEOUT_MS. */
    queryTimeoutMs?: number;
  },
): Pool {
  const limited = opts.timeouts ?? true;
  const pool = new pg.Pool({
    connectionString,
    max: opts.max ?? 10,
    // The only startup parameter besides user and database: PgBouncer refuses the others (timeouts, options).
    application_name: opts.applicationName ?? 'outboxd',
    // A dead server must surface as an error, not as a request that waits forever for a connection.
    connectionTimeoutMillis: 10_000,
    // A peer gone without a word (a failover, a dropped NAT entry) is noticed by the kernel.
    keepAlive: true,
    ...(limited ? { query_timeout: opts.queryTimeoutMs ?? QUERY_TIMEOUT_MS } : {}),
    // A direct session is this pool's alone: its timeouts are set once, before pg-pool hands it out (which
    // ends a client whose hook fails), once the URL is known not to be a pooler's. Behind a pooler only
    // outboxd's transactions have them (SET LOCAL), as a session setting would reach its other clients.
    ...(limited && !opts.pooled
      ? {
          onConnect: async (client: pg.ClientBase) => {
            await ownSessions(connectionString);
            await client.query(timeouts('session'));
          },
        }
      : {}),
    // Raw queries on our own connections read bigints as numbers too, and nothing as the application's
    // global parsers would; those stay untouched.
    types: resultTypes,
  });
  // An idle client losing its server (restart, pg_terminate_backend) emits 'error' on the pool; without
  // a listener that would crash the process. The next checkout gets a fresh connection.
  pool.on('error', () => {});
  // A new client's connection can die in the same network read that completes its connect, after
  // pg-pool stopped listening and before the caller starts (pg_terminate_backend at that instant):
  // an 'error' nobody hears would crash the process. This listener lives as long as the client; the
  // client is then not queryable, its next statement fails and the pool drops it.
  pool.on('connect', (client) => client.on('error', () => {}));
  const outboxdPool = Object.assign(pool, { sql: statementsFor(opts.schema, !opts.pooled) });
  if (limited && opts.pooled) {
    // Behind a pooler a single statement gets its timeouts from a transaction of its own: two more round
    // trips, the price of sharing server connections (a session setting would reach other clients).
    pool.query = ((config: string | pg.QueryConfig, values?: unknown[]) =>
      inTransaction(outboxdPool, (tx) => tx.query(config, values))) as pg.Pool['query'];
  }
  return outboxdPool;
}

/**
 * Runs `fn` in one short transaction on a checked-out client, committing on return and rolling back
 * on throw, with outboxd's lock and statement timeouts. Nothing slow belongs inside: above all no
 * external call (invariant 3). `sql`: the statements the transaction's client hands out, outboxd's own
 * pool's by default (an application's pool has none of its own).
 */
export async function inTransaction<T>(pool: Pool, fn: (tx: Tx) => Promise<T>): Promise<T>;
export async function inTransaction<T>(pool: pg.Pool, fn: (tx: Tx) => Promise<T>, sql: Statements): Promise<T>;
export async function inTransaction<T>(pool: pg.Pool, fn: (tx: Tx) => Promise<T>, sql: Statements = (pool as Pool).sql): Promise<T> {
  return withClient(pool, async (client, markBroken) => {
    try {
      // One round trip: the transaction and its timeouts, which end with it.
      await client.query(`begin; ${timeouts('local')}`);
      const result = await fn({ query: client.query.bind(client) as pg.PoolClient['query'], sql });
      await client.query('commit');
      return result;
    } catch (err) {
      // A client whose rollback fails is in an unknown state: drop it instead of pooling it.
      await client.query('rollback').catch(markBroken);
      throw err;
    }
  });
}

/**
 * Checks a client out for `fn` and back in. While checked out, a client whose connection dies between
 * two statements (a server restart, pg_terminate_backend) emits 'error'; with no listener that would
 * crash the process. The error is kept instead: the next statement fails on its own, and the client is
 * discarded rather than pooled.
 */
export async function withClient<T>(
  pool: pg.Pool,
  fn: (client: pg.PoolClient, markBroken: (err: Error) => void) => Promise<T>,
): Promise<T> {
  const client = await pool.connect();
  let broken: Error | undefined;
  const markBroken = (err: Error) => {
    broken ??= err;
  };
  client.on('error', markBroken);
  try {
    return await fn(client, markBroken);
  } finally {
    client.removeListener('error', markBroken);
    client.release(broken);
  }
}

/**
 * Runs a statement handed to pg-boss's database interface: pg-boss's own (text) with pg's built-in
 * parsers, whatever the application set; any other (a QueryConfig, as outboxd and a transactional
 * settlement handler send through a delivery's transaction) as it is, its values beside it.
 */
export const bossQuery = (client: Pick<pg.ClientBase, 'query'>, text: string | pg.QueryConfig, values?: unknown[]): Promise<pg.QueryResult> =>
  typeof text === 'string' ? client.query({ text, values: values ?? [], types: builtInTypes }) : client.query(text, values);

/** pg-boss's database interface over a transaction's client, so its statements join that transaction. */
export function bossDb(client: Pick<Queryable, 'query'>): IDatabase {
  return { executeSql: (text, values) => bossQuery(client as Pick<pg.ClientBase, 'query'>, text, values as unknown[] | undefined) };
}
