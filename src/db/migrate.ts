import { fileURLToPath } from 'node:url';
import { drizzle } from 'drizzle-orm/node-postgres';
import { migrate as drizzleMigrate } from 'drizzle-orm/node-postgres/migrator';
import { createBoss, createQueues } from '../outbox.ts';
import { createPool } from './pool.ts';

const MIGRATIONS = fileURLToPath(new URL('../../drizzle', import.meta.url));
/** Serialises concurrent `outboxd migrate` runs (two deploys at once, tests in parallel). */
const MIGRATION_LOCK = 7_411_001;

/** Applies drizzle/ migrations, installs or upgrades the pg-boss schema and creates the queues. Idempotent. */
export async function migrate(connectionString: string): Promise<void> {
  const pool = createPool(connectionString, { max: 1, applicationName: 'outboxd-migrate' });
  const client = await pool.connect();
  try {
    await client.query('select pg_advisory_lock($1)', [MIGRATION_LOCK]);
    await drizzleMigrate(drizzle({ client }), { migrationsFolder: MIGRATIONS });
    const boss = createBoss(connectionString, 'migrator', 2);
    await boss.start();
    try {
      await createQueues(boss);
    } finally {
      await boss.stop({ graceful: false });
    }
  } finally {
    await client.query('select pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => {});
    client.release();
    await pool.end();
  }
}
