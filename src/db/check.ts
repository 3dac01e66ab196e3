// What a worker makes sure of before it serves or claims anything: the database answers within
// seconds, and `outboxd migrate` has run. Each failure is one sentence naming where and what to do;
// the database is named by host, port and name only, so no password reaches a log or a terminal.
import pg from 'pg';
import { drizzlePending, readJournal } from './migrate.ts';

export async function checkDatabase(connectionString: string, schema: string, opts: { timeoutMs?: number } = {}): Promise<void> {
  const timeoutMs = opts.timeoutMs ?? 5_000;
  const client = new pg.Client({ connectionString, connectionTimeoutMillis: timeoutMs, query_timeout: timeoutMs, application_name: 'outboxd-check' });
  const where = `${client.host}:${client.port}/${client.database ?? ''}`;
  // A connection lost after the check is the pool's business, not this client's: never an unheard 'error'.
  client.on('error', () => {});
  try {
    await client.connect();
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    const why = /timeout/i.test(e.message) ? `no answer within ${timeoutMs / 1000} s` : e.code && !/^\d/.test(e.code) ? e.code : e.message;
    throw new Error(`cannot reach the database at ${where} (${why}): check DATABASE_URL`, { cause: err });
  }
  try {
    if (await drizzlePending(client, schema, await readJournal())) throw new Error(`the database at ${where} is not migrated: run \`outboxd migrate\``);
  } finally {
    await client.end().catch(() => {});
  }
}
