import pg from 'pg';
import type { Db as IDatabase } from 'pg-boss';

export type Pool = pg.Pool;
export type PoolClient = pg.PoolClient;
/** Anything that runs a query: the pool for single statements, a checked-out client inside a transaction. */
export type Queryable = Pick<pg.Pool, 'query'> | pg.PoolClient;

// bigint columns (amount, fence) hold values far below 2^53: read them as numbers.
pg.types.setTypeParser(pg.types.builtins.INT8, (v) => Number(v));

export function createPool(connectionString: string, opts: { max?: number; applicationName?: string } = {}): pg.Pool {
  const pool = new pg.Pool({
    connectionString,
    max: opts.max ?? 10,
    application_name: opts.applicationName ?? 'outboxd',
    // A dead server must surface as an error, not as a request that waits forever for a connection.
    connectionTimeoutMillis: 10_000,
  });
  // An idle client losing its server (restart, pg_terminate_backend) emits 'error' on the pool; without
  // a listener that would crash the process. The next checkout gets a fresh connection.
  pool.on('error', () => {});
  // A new client's connection can die in the same network read that completes its connect, after
  // pg-pool stopped listening and before the caller starts (pg_terminate_backend at that instant):
  // an 'error' nobody hears would crash the process. This listener lives as long as the client; the
  // client is then not queryable, its next statement fails and the pool drops it.
  pool.on('connect', (client) => client.on('error', () => {}));
  return pool;
}

/**
 * Runs `fn` in one short transaction on a checked-out client, committing on return and rolling back
 * on throw. Nothing slow belongs inside: above all no external call (invariant 3).
 */
export async function inTransaction<T>(pool: pg.Pool, fn: (tx: pg.PoolClient) => Promise<T>): Promise<T> {
  return withClient(pool, async (client, markBroken) => {
    try {
      await client.query('begin');
      const result = await fn(client);
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

/** pg-boss's database interface over a transaction's client, so its statements join that transaction. */
export function bossDb(client: Queryable): IDatabase {
  return { executeSql: (text, values) => client.query(text, values as unknown[]) };
}
