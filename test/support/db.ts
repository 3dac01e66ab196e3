// A fresh, migrated database per test file, so files run in parallel without seeing each other.
import type { PgBoss } from 'pg-boss';
import { afterAll, inject } from 'vitest';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { createBoss } from '../../src/outbox/outbox.ts';
import { DEFAULT_SCHEMA } from '../../src/sql/statements.ts';
import pg from 'pg';
import { createEmptyDatabase, createMigratedDatabase } from '../../harness/database.ts';

export interface TestDb {
  url: string;
  /** outboxd's schema in it. */
  schema: string;
  pool: Pool;
  /** A pg-boss that only sends (like the CLI's). */
  boss: PgBoss;
  close(): Promise<void>;
}

export async function createTestDatabase(schema = DEFAULT_SCHEMA): Promise<TestDb> {
  const { url } = await createMigratedDatabase(inject('adminUrl'), 't', schema);
  const pool = createPool(url, { schema, max: 10, applicationName: 'outboxd-test' });
  const boss = createBoss(url, 'client', 2, schema);
  await boss.start();
  return {
    url,
    schema,
    pool,
    boss,
    close: async () => {
      await boss.stop({ graceful: false });
      await pool.end();
    },
  };
}

/** `fn` in a transaction on a client of the application's own pool (not outboxd's), as an application
 * runs its business transaction: committed, or rolled back when `commit` is false or `fn` throws. */
export async function inAppTransaction<T>(pool: pg.Pool, fn: (client: pg.PoolClient) => Promise<T>, commit = true): Promise<T> {
  const client = await pool.connect();
  try {
    await client.query('begin');
    const result = await fn(client);
    await client.query(commit ? 'commit' : 'rollback');
    return result;
  } catch (err) {
    await client.query('rollback');
    throw err;
  } finally {
    client.release();
  }
}

/** Empty databases for the tests of the describe (or file) it is called in, each dropped after them. */
export function emptyDatabases(): (prefix: string) => ReturnType<typeof connectedEmptyDatabase> {
  const drops: (() => Promise<void>)[] = [];
  afterAll(async () => {
    for (const drop of drops) await drop();
  });
  return (prefix) => connectedEmptyDatabase(prefix, drops);
}

/** An empty database with a client connected to it; `drops` gets what ends both, for the file's afterAll. */
export async function connectedEmptyDatabase(prefix: string, drops: (() => Promise<void>)[]): Promise<{ url: string; client: pg.Client }> {
  const db = await createEmptyDatabase(inject('adminUrl'), prefix);
  const client = new pg.Client({ connectionString: db.url });
  await client.connect();
  drops.push(async () => {
    await client.end();
    await db.drop();
  });
  return { url: db.url, client };
}
