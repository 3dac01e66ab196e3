// A fresh, migrated database per test file, so files run in parallel without seeing each other.
import type { PgBoss } from 'pg-boss';
import { inject } from 'vitest';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { createBoss } from '../../src/outbox.ts';
import { createMigratedDatabase } from '../../scripts/lib/database.ts';

export interface TestDb {
  url: string;
  pool: Pool;
  /** A pg-boss that only sends (like the CLI's). */
  boss: PgBoss;
  close(): Promise<void>;
}

export async function createTestDatabase(): Promise<TestDb> {
  const { url } = await createMigratedDatabase(inject('adminUrl'), 't');
  const pool = createPool(url, { max: 10, applicationName: 'outboxd-test' });
  const boss = createBoss(url, 'client', 2);
  await boss.start();
  return {
    url,
    pool,
    boss,
    close: async () => {
      await boss.stop({ graceful: false });
      await pool.end();
    },
  };
}
