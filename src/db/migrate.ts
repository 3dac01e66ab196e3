import { readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { createBoss, createQueues } from '../outbox.ts';
import { createPool, withClient, type PoolClient } from './pool.ts';

const MIGRATIONS = fileURLToPath(new URL('../../drizzle', import.meta.url));
/** Serialises concurrent `outboxd migrate` runs (two deploys at once, tests in parallel). */
const MIGRATION_LOCK = 7_411_001;

/** Whether drizzle's journal lists migrations this database has not applied yet. */
export async function drizzlePending(client: Pick<PoolClient, 'query'>): Promise<boolean> {
  const journal = JSON.parse(await readFile(`${MIGRATIONS}/meta/_journal.json`, 'utf8')) as { entries: unknown[] };
  // Two statements: PostgreSQL resolves a table name when it parses, even in a branch never taken.
  const { rows: exists } = await client.query(`select to_regclass('drizzle.__drizzle_migrations') is not null as ok`);
  if (!exists[0].ok) return true;
  const { rows } = await client.query(`select count(*)::int as applied from drizzle.__drizzle_migrations`);
  return rows[0].applied < journal.entries.length;
}

/** Applies drizzle/ migrations, installs or upgrades the pg-boss schema and creates the queues. Idempotent. */
export async function migrate(connectionString: string): Promise<void> {
  const pool = createPool(connectionString, { max: 1, applicationName: 'outboxd-migrate' });
  try {
    await withClient(pool, (client) => migrateWith(client, connectionString));
  } finally {
    await pool.end();
  }
}

async function migrateWith(client: PoolClient, connectionString: string): Promise<void> {
  try {
    await client.query('select pg_advisory_lock($1)', [MIGRATION_LOCK]);
    if (await drizzlePending(client)) {
      // drizzle-orm takes about a second to load: only when there is something to apply.
      const [{ drizzle }, { migrate: drizzleMigrate }] = await Promise.all([
        import('drizzle-orm/node-postgres'),
        import('drizzle-orm/node-postgres/migrator'),
      ]);
      await drizzleMigrate(drizzle({ client }), { migrationsFolder: MIGRATIONS });
    }
    const boss = createBoss(connectionString, 'migrator', 2);
    await boss.start();
    try {
      await createQueues(boss);
    } finally {
      await boss.stop({ graceful: false });
    }
  } finally {
    await client.query('select pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => {});
  }
}
