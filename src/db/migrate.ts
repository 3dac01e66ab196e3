import { readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { createBoss, createQueues } from '../outbox/outbox.ts';
import { ConfigError } from '../runtime/config.ts';
import { connectionConfig, createPool, sharedSession, withClient, type PoolClient } from './pool.ts';

const MIGRATIONS = fileURLToPath(new URL('../../drizzle', import.meta.url));
/** drizzle's record of applied migrations, kept in outboxd's own schema (drizzle's default is one
 * `drizzle` schema for everyone, which an application using drizzle would share with us). */
const MIGRATIONS_TABLE = '__drizzle_migrations';
/** Where the release that kept its tables in `public` recorded its migrations: drizzle's default. */
const LEGACY_MIGRATIONS = 'drizzle.__drizzle_migrations';
/** Serialises concurrent `outboxd migrate` runs (two deploys at once, tests in parallel). */
export const MIGRATION_LOCK = 7_411_001;
/** How long a migration's statement waits for a table's lock: a DDL statement waiting on an application's
 * long transaction would queue every statement on that table behind it (the application's, the old
 * replicas'). Past it the migration fails, changing nothing, and is run again later. */
export const MIGRATION_LOCK_TIMEOUT_MS = 5_000;
/** The same for a `concurrently` statement, which waits for every older transaction without blocking anyone. */
const CONCURRENT_LOCK_TIMEOUT_MS = 15 * 60_000;
/** A migration with such a statement cannot run in a transaction (PostgreSQL refuses): see applyMigrations. */
const CONCURRENTLY = /\b(create|drop)\s+(unique\s+)?index\s+concurrently\b|\breindex\b.*\bconcurrently\b/i;

interface Journal {
  entries: { when: number }[];
}

export const readJournal = async (folder = MIGRATIONS): Promise<Journal> => JSON.parse(await readFile(`${folder}/meta/_journal.json`, 'utf8'));

/**
 * A database created by the release that kept outboxd's tables in `public` recorded their migrations in
 * drizzle's default table. Those rows (ours by their timestamps; an application's own stay) move to
 * the schema's table, so drizzle continues from them; the migration that follows moves the tables.
 */
async function adoptLegacyMigrations(client: PoolClient, schema: string, journal: Journal): Promise<void> {
  const { rows } = await client.query(`select to_regclass($1) is not null as ok`, [LEGACY_MIGRATIONS]);
  if (!rows[0].ok) return;
  await client.query('begin');
  try {
    await client.query(
      `create table if not exists "${schema}".${MIGRATIONS_TABLE} (id serial primary key, hash text not null, created_at bigint)`,
    );
    await client.query(
      `with moved as (delete from ${LEGACY_MIGRATIONS} where created_at = any($1::bigint[]) returning hash, created_at)
       insert into "${schema}".${MIGRATIONS_TABLE} (hash, created_at) select hash, created_at from moved order by created_at`,
      [journal.entries.map((e) => e.when)],
    );
    await client.query('commit');
  } catch (err) {
    await client.query('rollback');
    throw err;
  }
}

/** Whether drizzle's journal lists migrations this database has not applied yet. */
export async function drizzlePending(client: Pick<PoolClient, 'query'>, schema: string, journal: Journal): Promise<boolean> {
  // Two statements: PostgreSQL resolves a table name when it parses, even in a branch never taken.
  const { rows: exists } = await client.query(`select to_regclass($1) is not null as ok`, [`"${schema}".${MIGRATIONS_TABLE}`]);
  if (!exists[0].ok) return true;
  // By the newest record's timestamp, as drizzle's migrator decides what to apply. A count would call
  // current a database whose last record is another migration of the same number (one withdrawn before
  // a release), and migrate would never hand drizzle the one that replaced it.
  const { rows } = await client.query(`select coalesce(max(created_at), 0) as last from "${schema}".${MIGRATIONS_TABLE}`);
  return Number(rows[0].last) < Math.max(...journal.entries.map((e) => e.when));
}

/**
 * Applies drizzle/ migrations to `schema`, installs or upgrades the pg-boss schema and creates the
 * queues. Idempotent. `connection`: a session's connection string (never a transaction pooler's: the
 * lock that serialises migrators is a session's), or an application's pool. `folder`: the migrations.
 */
export async function migrate(connection: string | pg.Pool, schema: string, folder = MIGRATIONS): Promise<void> {
  const shared = await sharedSession(connection, 'outboxd-migrate');
  if (shared) {
    throw new ConfigError(
      `the migration's connection reaches PostgreSQL through a transaction pooler (${shared}): a migration needs a session of its own, ` +
        'or its lock and settings stay behind on the pooler\'s server connections. Give it the database itself: DATABASE_DIRECT_URL (the library: directConnectionString)',
    );
  }
  // A session of the migrator's own, never one of an application's pooled connections: its settings
  // (search_path, timeouts) would stay behind on that connection in place of the application's.
  const pool =
    typeof connection === 'string'
      ? createPool(connection, { schema, max: 1, applicationName: 'outboxd-migrate', timeouts: false })
      : new pg.Pool({ ...connectionConfig(connection), max: 1, application_name: 'outboxd-migrate', query_timeout: undefined, statement_timeout: undefined });
  pool.on('error', () => {}); // an idle client losing its server: the next statement fails instead
  try {
    await withClient(pool, (client) => migrateWith(client, connection, schema, folder));
  } finally {
    await pool.end();
  }
}

async function migrateWith(client: PoolClient, connection: string | pg.Pool, schema: string, folder: string): Promise<void> {
  try {
    // Taken by polling, not by waiting in pg_advisory_lock: a statement that waits keeps its snapshot,
    // and `create index concurrently` in the migration that holds the lock waits for every snapshot, so
    // two migrators started at once would deadlock.
    while (!(await client.query('select pg_try_advisory_lock($1) as locked', [MIGRATION_LOCK])).rows[0].locked) {
      await new Promise((resolve) => setTimeout(resolve, 100 + Math.random() * 200));
    }
    // After the migrators' own lock, which may rightly be waited for as long as another migration runs.
    await client.query(`set lock_timeout = ${MIGRATION_LOCK_TIMEOUT_MS}`);
    // Only lock_timeout bounds a migration: a default statement_timeout of the database's or role's would
    // cancel `create index concurrently` waiting out older transactions, and leave the index invalid.
    await client.query(`select set_config('statement_timeout', '0', false), set_config('idle_in_transaction_session_timeout', '0', false)`);
    await client.query(`select set_config('transaction_timeout', '0', false) where current_setting('server_version_num')::int >= 170000`);
    await client.query(`create schema if not exists "${schema}"`);
    const journal = await readJournal(folder);
    await adoptLegacyMigrations(client, schema, journal);
    if (await drizzlePending(client, schema, journal)) await applyMigrations(client, schema, folder);
    const boss = createBoss(connection, 'migrator', 2, schema);
    await boss.start();
    try {
      await createQueues(boss);
    } finally {
      await boss.stop({ graceful: false });
    }
  } finally {
    await client.query('reset lock_timeout').catch(() => {});
    await client.query('select pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => {});
  }
}

/**
 * drizzle's migrator over drizzle/, with two adjustments for the schema. The files name outboxd's
 * tables as drizzle-kit wrote them: "outboxd"."…" (src/db/schema.ts), or unqualified and "public"."…"
 * in those of the release that kept them in public. Each statement is applied to `schema` instead
 * (search_path for the unqualified names, the qualifier rewritten for the others), so a new database
 * never creates anything in public, where an application's own `orders` may live.
 *
 * drizzle applies everything pending in one transaction, where PostgreSQL refuses `create index
 * concurrently`. A migration with such a statement is applied apart, each statement committed on its own,
 * then recorded as drizzle records one; the others still go through drizzle, in order around it. Its
 * statements must each be safe to run again, as a failure leaves it half applied and unrecorded
 * (`drop index concurrently if exists` before `create index concurrently`: a failed build leaves an
 * invalid index behind).
 */
async function applyMigrations(client: PoolClient, schema: string, folder: string): Promise<void> {
  // drizzle-orm takes about a second to load: only when there is something to apply.
  const [{ drizzle }, { readMigrationFiles }, { PgDialect }] = await Promise.all([
    import('drizzle-orm/node-postgres'),
    import('drizzle-orm/migrator'),
    import('drizzle-orm/pg-core'),
  ]);
  const config = { migrationsFolder: folder, migrationsSchema: schema, migrationsTable: MIGRATIONS_TABLE };
  const target = `"${schema}".`;
  const migrations = readMigrationFiles(config).map((m) => ({
    ...m,
    sql: m.sql.map((statement) => statement.replaceAll('"public".', target).replaceAll('"outboxd".', target)),
  }));
  await client.query(`set search_path to "${schema}"`);
  try {
    const dialect = new PgDialect();
    // The node-postgres session is the PgSession the dialect wants; drizzle's generics do not say so.
    const session = drizzle({ client })._.session as unknown as Parameters<typeof dialect.migrate>[1];
    const applyBatch = async (batch: typeof migrations) => dialect.migrate(await lockingFirst(client, schema, batch), session, config);
    let batch: typeof migrations = [];
    for (const migration of migrations) {
      if (!migration.sql.some((statement) => CONCURRENTLY.test(statement))) {
        batch.push(migration);
        continue;
      }
      if (batch.length) await applyBatch(batch);
      batch = [];
      const { rows } = await client.query(`select coalesce(max(created_at), 0) as last from "${schema}".${MIGRATIONS_TABLE}`);
      if (Number(rows[0].last) >= migration.folderMillis) continue;
      // `concurrently` blocks no writer while it waits for older transactions to end: it may wait longer
      // than a statement that holds a table's lock would be let (an application's long transaction).
      await client.query(`set lock_timeout = ${CONCURRENT_LOCK_TIMEOUT_MS}`);
      for (const statement of migration.sql) await client.query(statement);
      await client.query(`set lock_timeout = ${MIGRATION_LOCK_TIMEOUT_MS}`);
      await client.query(`insert into "${schema}".${MIGRATIONS_TABLE} (hash, created_at) values ($1, $2)`, [migration.hash, migration.folderMillis]);
    }
    if (batch.length) await applyBatch(batch);
  } finally {
    await client.query('reset search_path');
  }
}

/** outboxd's tables in the order its writers take them: the example's confirmation writes its order,
 * then requestCharge the operation, then its outbox row; an outcome or a settlement the operation, then
 * its settlement event and timeline row. */
const WRITERS_ORDER = ['orders', 'payment_operations', 'charge_outbox', 'settlement_outbox', 'operation_events'];

/**
 * `batch`, the transaction drizzle applies its pending migrations in beginning with a lock of the existing
 * tables they name, in the writers' order. Their statements would take them in the files' order: one
 * taking charge_outbox, then payment_operations, while a confirmation holds the operation it inserted and
 * waits for charge_outbox, deadlocks, and PostgreSQL aborts either, often the application's confirmation.
 */
async function lockingFirst<M extends { sql: string[]; folderMillis: number }>(client: PoolClient, schema: string, batch: M[]): Promise<M[]> {
  const recorded = await client.query(`select to_regclass(format('%I.%I', $1::text, $2::text)) is not null as made`, [schema, MIGRATIONS_TABLE]);
  if (!recorded.rows[0].made) return batch; // a new database: no table to wait for
  const { rows } = await client.query(`select coalesce(max(created_at), 0) as last from "${schema}".${MIGRATIONS_TABLE}`);
  const first = batch.findIndex((m) => m.folderMillis > Number(rows[0].last)); // what drizzle applies: after the last recorded
  if (first < 0) return batch;
  const pending = batch.slice(first);
  const named = WRITERS_ORDER.filter((table) => pending.some((m) => m.sql.some((statement) => new RegExp(`\\b${table}\\b`).test(statement))));
  const existing = await client.query(`select t from unnest($1::text[]) with ordinality u(t, n) where to_regclass(format('%I.%I', $2::text, t)) is not null order by n`, [named, schema]);
  if (existing.rows.length === 0) return batch;
  const lock = `lock table ${existing.rows.map((r: { t: string }) => `"${schema}"."${r.t}"`).join(', ')} in access exclusive mode`;
  return [...batch.slice(0, first), { ...pending[0]!, sql: [lock, ...pending[0]!.sql] }, ...pending.slice(1)];
}
