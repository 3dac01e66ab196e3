// The caller's transaction, whatever it is: a drizzle node-postgres transaction, a pg PoolClient or
// Client inside BEGIN, or any object with query(text, values). outboxd's statements run on it as they
// are (schema-qualified, so its search_path does not matter); nothing here begins, commits or rolls back.
import type { QueryConfig } from 'pg';
import type { Statements } from '../sql/statements.ts';
import type { Queryable } from './pool.ts';

/** drizzle marks its classes with this (a registered symbol, the same in every copy of drizzle-orm). */
const DRIZZLE_KIND = Symbol.for('drizzle:entityKind');

type QueryFn = (text: string, values?: unknown[]) => Promise<{ rows: unknown[] }>;
type ConfigQueryFn = (config: QueryConfig) => Promise<{ rows: unknown[] }>;

export class TransactionTypeError extends TypeError {
  override name = 'TransactionTypeError';
}

/** `tx` as a Queryable running `sql`, or a TransactionTypeError saying what to pass instead. */
export function callerTransaction(tx: unknown, sql: Statements): Queryable {
  if (tx === null || typeof tx !== 'object') throw new TransactionTypeError(`expected the caller's transaction, got ${tx === null ? 'null' : typeof tx}`);
  const t = tx as Record<string, unknown> & { session?: { client?: unknown } };
  const kind = (t.constructor as unknown as Record<symbol, unknown> | undefined)?.[DRIZZLE_KIND];
  if (typeof kind === 'string') {
    if (!kind.endsWith('Transaction')) {
      throw new TransactionTypeError(`a drizzle ${kind} is not a transaction: pass the tx of db.transaction(async (tx) => …)`);
    }
    const client = t.session?.client;
    if (!isPgClient(client)) throw new TransactionTypeError(`a drizzle ${kind} without a node-postgres client: outboxd joins node-postgres transactions`);
    return fromPgClient(client, sql);
  }
  if (typeof t.query !== 'function') throw new TransactionTypeError(`expected the caller's transaction (an object with query(text, values))`);
  if (typeof t.connect === 'function' && 'idleCount' in t) {
    throw new TransactionTypeError('a pool runs each statement in a transaction of its own: pass a client inside BEGIN (await pool.connect(), then BEGIN)');
  }
  if (isPgClient(t)) return fromPgClient(t, sql);
  return fromQueryFunction((t.query as QueryFn).bind(t), sql);
}

/** Any other query(text, values) must resolve to a result with rows, as pg's does: one that resolves to
 * something else (the rows alone, as pg-promise's and TypeORM's do) is refused before anything is
 * written, by a first statement that writes nothing; afterwards, it would be refused after its write,
 * which the caller might then commit. */
function fromQueryFunction(query: QueryFn, sql: Statements): Queryable {
  const withRows = async (text: string, values?: unknown[]) => {
    const result = await query(text, values);
    if (!Array.isArray(result?.rows)) {
      throw new TransactionTypeError(
        `query(text, values) resolved to ${Array.isArray(result) ? 'an array' : typeof result}, not a result with rows (as pg's): pass a pg client inside BEGIN or a drizzle transaction, or wrap yours to resolve to { rows }`,
      );
    }
    return result;
  };
  let checked: Promise<unknown> | undefined;
  const run = async (config: QueryConfig) => {
    await (checked ??= withRows('select 1'));
    return withRows(config.text, config.values);
  };
  return { sql, query: run as unknown as Queryable['query'] };
}

/** A jsonb column holding an object, of a row read on the caller's transaction: parsed by its driver
 * (pg's default), or its text where the driver (or a type parser of the application's) keeps JSON as text. */
export const jsonObjectOf = <T extends object>(value: unknown): T | null => (typeof value === 'string' ? JSON.parse(value) : value) as T | null;

/** node-postgres' Client or PoolClient, from whichever copy of pg the application uses. */
function isPgClient(c: unknown): c is PgClient {
  return typeof c === 'object' && c !== null && typeof (c as { query?: unknown }).query === 'function' && 'connectionParameters' in c;
}

interface PgClient {
  query: ConfigQueryFn;
  /** The server's word at its last ReadyForQuery: I idle (outside a transaction), T inside one, E failed. */
  getTransactionStatus?: () => string | null;
  // What it has sent or queued and not yet had answered (pg's own fields): a BEGIN among them changes the status.
  _activeQuery?: { text?: unknown } | null;
  _queryQueue?: { text?: unknown }[];
  _sentQueryQueue?: { text?: unknown }[];
}

const BEGIN = /^\s*(begin|start\s+transaction)\b/i;

/** A pg client takes the whole statement: its name (prepared once per connection) and its type parsers.
 * One outside a transaction runs each statement in a transaction of its own: the application's order
 * and its operation would commit apart, so it is refused, unless a BEGIN sent and not yet answered is
 * among what it has in flight: its caller's transaction, which outboxd's statements queue into. */
function fromPgClient(client: PgClient, sql: Statements): Queryable {
  if (client.getTransactionStatus?.() === 'I' && Array.isArray(client._queryQueue)) {
    const pending = [client._activeQuery, ...client._queryQueue, ...(client._sentQueryQueue ?? [])];
    if (!pending.some((q) => typeof q?.text === 'string' && BEGIN.test(q.text))) {
      throw new TransactionTypeError('this pg client is outside a transaction, where each statement commits on its own: send BEGIN on it first');
    }
  }
  return { sql, query: ((config: QueryConfig) => client.query(config)) as unknown as Queryable['query'] };
}
