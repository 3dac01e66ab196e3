// A database as the release that kept outboxd's tables in public created it: its committed migrations
// (drizzle/0000–0002) applied the way it applied them (drizzle's defaults, search_path public).
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { drizzle } from 'drizzle-orm/node-postgres';
import { migrate as drizzleMigrate } from 'drizzle-orm/node-postgres/migrator';
import type pg from 'pg';

export const ROOT = path.resolve(import.meta.dirname, '../..');
const RELEASE_MIGRATIONS = ['0000_init', '0001_admin_audit_and_webhook_inbox', '0002_charge_outbox'];
export const RELEASE_TABLES = ['orders', 'payment_operations', 'admin_audit', 'webhook_events', 'charge_outbox'];

export async function createReleaseDatabase(client: pg.Client): Promise<void> {
  const folder = await mkdtemp(path.join(tmpdir(), 'outboxd-release-'));
  try {
    await cp(path.join(ROOT, 'drizzle'), folder, { recursive: true });
    const journal = JSON.parse(await readFile(path.join(folder, 'meta/_journal.json'), 'utf8'));
    journal.entries = journal.entries.filter((e: { tag: string }) => RELEASE_MIGRATIONS.includes(e.tag));
    if (journal.entries.length !== RELEASE_MIGRATIONS.length) throw new Error('the release migrations are not all in drizzle/');
    await writeFile(path.join(folder, 'meta/_journal.json'), JSON.stringify(journal));
    await drizzleMigrate(drizzle({ client }), { migrationsFolder: folder });
  } finally {
    await rm(folder, { recursive: true, force: true });
  }
}

/** Rows of every kind the release wrote: two orders, a settled and an open operation, an outbox row,
 * an audit entry and a webhook event. */
export async function insertReleaseRows(client: pg.Client): Promise<void> {
  await client.query(`
    insert into orders (id, amount, currency, customer_id, payment_method) values
      ('o-paid', 1000, 'eur', 'cus_1', 'pm_card_visa'), ('o-open', 2000, 'usd', 'cus_2', 'pm_card_visa');
    insert into payment_operations (id, order_id, amount, currency, customer_id, payment_method, status, external_id, attempts, first_attempted_at, settled_at, fence)
      values ('00000000-0000-4000-8000-000000000001', 'o-paid', 1000, 'eur', 'cus_1', 'pm_card_visa', 'succeeded', 'pi_1', 1, now(), now(), 3);
    insert into payment_operations (id, order_id, amount, currency, customer_id, payment_method, review_reason)
      values ('00000000-0000-4000-8000-000000000002', 'o-open', 2000, 'usd', 'cus_2', 'pm_card_visa', 'checked by hand');
    insert into charge_outbox (operation_id) values ('00000000-0000-4000-8000-000000000002');
    insert into admin_audit (actor, action, operation_id, details) values ('cli:ops', 'resolve', '00000000-0000-4000-8000-000000000001', '{"outcome":"succeeded"}');
    insert into webhook_events (id, type, operation_id, result, payload) values ('evt_1', 'payment_intent.succeeded', '00000000-0000-4000-8000-000000000001', 'settled', '{}');
  `);
}

/** Every row of outboxd's tables in `schema`, table by table. */
export async function dumpTables(client: pg.Client, schema: string): Promise<Record<string, Record<string, unknown>[]>> {
  const tables: Record<string, Record<string, unknown>[]> = {};
  for (const t of RELEASE_TABLES) tables[t] = (await client.query(`select * from "${schema}".${t} order by 1`)).rows;
  return tables;
}
