// A fresh, migrated database on a PostgreSQL server: one per test file, one per demo/chaos/bench run.
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { databaseUrl } from '../../src/db/embedded.ts';
import { migrate } from '../../src/db/migrate.ts';

async function adminQuery(adminUrl: string, text: string): Promise<void> {
  const client = new pg.Client({ connectionString: adminUrl });
  client.on('error', () => {}); // a reset after the query is answered must not crash the harness
  await client.connect();
  try {
    await client.query(text);
  } finally {
    await client.end();
  }
}

export async function createMigratedDatabase(adminUrl: string, prefix: string): Promise<{ url: string; drop(): Promise<void> }> {
  const name = `${prefix}_${randomBytes(6).toString('hex')}`;
  await adminQuery(adminUrl, `create database ${name}`);
  const url = databaseUrl(adminUrl, name);
  await migrate(url);
  return { url, drop: () => adminQuery(adminUrl, `drop database if exists ${name} with (force)`) };
}
