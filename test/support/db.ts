// A fresh, migrated database per test file, so files run in parallel without seeing each other.
import type { PgBoss } from 'pg-boss';
import { inject } from 'vitest';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { createBoss } from '../../src/outbox.ts';
import { DEFAULT_SCHEMA } from '../../src/sql/statements.ts';
import { createMigratedDatabase } from '../../scripts/lib/database.ts';

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
