// The emulator's own small PostgreSQL helper over `pg`: it shares no code with outboxd's pool, since it
// is the ledger outboxd is checked against.
import pg from 'pg';

/** bigint columns (milliseconds, sequence numbers) hold values far below 2^53: read as numbers. */
const types = {
  getTypeParser: ((oid: number, format?: 'text' | 'binary') =>
    oid === pg.types.builtins.INT8 ? Number : pg.types.getTypeParser(oid, format)) as typeof pg.types.getTypeParser,
};

export type Tx = Pick<pg.PoolClient, 'query'>;

export function openPool(url: string, applicationName: string): pg.Pool {
  const pool = new pg.Pool({ connectionString: url, max: 4, application_name: applicationName, connectionTimeoutMillis: 10_000, keepAlive: true, types });
  // A client losing its server (idle in the pool, or just connected) emits 'error'; unheard, it would
  // crash the process. Its next statement fails and the pool drops it.
  pool.on('error', () => {});
  pool.on('connect', (client) => client.on('error', () => {}));
  return pool;
}

/** Runs `fn` in one transaction on a checked-out client: committed on return, rolled back on throw. */
export async function inTransaction<T>(pool: pg.Pool, fn: (tx: Tx) => Promise<T>): Promise<T> {
  const client = await pool.connect();
  let broken: Error | undefined;
  const markBroken = (err: Error) => void (broken ??= err);
  // A connection dying while checked out emits 'error' on the client: kept, so the client is discarded.
  client.on('error', markBroken);
  try {
    await client.query('begin');
    const result = await fn(client);
    await client.query('commit');
    return result;
  } catch (err) {
    await client.query('rollback').catch(markBroken);
    throw err;
  } finally {
    client.removeListener('error', markBroken);
    client.release(broken);
  }
}
