// A fresh, migrated database per test file, so files run in parallel without seeing each other.
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import type { PgBoss } from 'pg-boss';
import { inject } from 'vitest';
import { databaseUrl } from '../../src/db/embedded.ts';
import { migrate } from '../../src/db/migrate.ts';
import { createPool, type Pool } from '../../src/db/pool.ts';
import { createBoss } from '../../src/outbox.ts';

export interface TestDb {
  url: string;
  pool: Pool;
  /** A pg-boss that only sends (like the CLI's). */
  boss: PgBoss;
  close(): Promise<void>;
}

export async function createTestDatabase(): Promise<TestDb> {
  const admin = inject('adminUrl');
  const name = `t_${randomUUID().replaceAll('-', '').slice(0, 16)}`;
  const client = new pg.Client({ connectionString: admin });
  await client.connect();
  await client.query(`create database ${name}`);
  await client.end();
  const url = databaseUrl(admin, name);
  await migrate(url);
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
