// A fresh, migrated database on a PostgreSQL server: one per test file, one per demo/chaos/bench run.
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { databaseUrl } from '../src/db/embedded.ts';
import { migrate } from '../src/db/migrate.ts';
import { DEFAULT_SCHEMA } from '../src/sql/statements.ts';

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

export async function createEmptyDatabase(adminUrl: string, prefix: string): Promise<{ url: string; drop(): Promise<void> }> {
  const name = `${prefix}_${randomBytes(6).toString('hex')}`;
  await adminQuery(adminUrl, `create database ${name}`);
  return { url: databaseUrl(adminUrl, name), drop: () => adminQuery(adminUrl, `drop database if exists ${name} with (force)`) };
}

export async function createMigratedDatabase(
  adminUrl: string,
  prefix: string,
  schema = DEFAULT_SCHEMA,
): Promise<{ url: string; drop(): Promise<void> }> {
  const database = await createEmptyDatabase(adminUrl, prefix);
  await migrate(database.url, schema);
  // Only this release runs here: settlement events wait in their table for the unnamed handlers, as once
  // an application of this release has subscribed (src/outbox/settlements.ts).
  await adminQuery(database.url, `insert into "${schema}".settlement_delivery default values`);
  return database;
}
