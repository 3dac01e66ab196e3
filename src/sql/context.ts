// What every area's statements are built from (src/sql/<area>.ts): the schema, quoted; the statement
// builder that names a prepared statement per schema; the timeline and settlement-event CTEs several
// writes share; and the column list every whole-row read names.
import { createHash } from 'node:crypto';
import pg from 'pg';
import type { QueryConfig } from 'pg';
import textParsers from 'pg-types/lib/textParsers.js';
import { LIVE_JOB_STATES } from '../types/contracts.ts';

export const DEFAULT_SCHEMA = 'outboxd';
/** A lower-case identifier (never needs quoting rules of its own), short enough that the pg-boss schema
 * derived from it (src/outbox/outbox.ts) stays within pg-boss's 50 bytes. */
export const SCHEMA_NAME = /^[a-z_][a-z0-9_]{0,39}$/;

export const UNSETTLED = `status in ('pending', 'unknown')`;
/** A pg-boss job that will still drive its operation (src/types/contracts.ts: LIVE_JOB_STATES): read
 * through pg-boss's index on its live jobs, never among the completed ones a queue keeps for days. */
export const LIVE_JOB = (alias: string) => `${alias}.state in (${LIVE_JOB_STATES.map((st) => `'${st}'`).join(', ')})`;

/** payment_operations' columns (src/db/schema.ts), named in every statement that reads them whole: a
 * statement prepared before a migration adds a column keeps its result type, where `*` would change it
 * under a warm connection (0A000 cached plan must not change result type). */
const OPERATION_COLUMNS = [
  'id', 'order_id', 'kind', 'policy', 'amount', 'currency', 'customer_id', 'payment_method', 'metadata', 'status',
  'external_id', 'attempts', 'first_attempted_at', 'last_attempted_at', 'last_error', 'last_outcome', 'review_reason',
  'needs_review', 'settled_at', 'fence', 'lease_owner', 'lease_expires_at', 'traceparent', 'parent_operation_id',
  'effect_key', 'payload', 'result', 'possible_duplicates', 'processing_since', 'next_check_at', 'created_at', 'updated_at',
] as const;
export const operationColumns = (alias?: string): string => OPERATION_COLUMNS.map((c) => (alias ? `${alias}.${c}` : c)).join(', ');

/** What the console's lists show of an operation: all but its JSON (an effect's payload and result, up to
 * 64 KiB each, and the metadata), which only its own page shows. A page of 500 read them whole: tens of
 * megabytes, and four such pages at once took a replica past its heap. */
const LISTED_COLUMNS = OPERATION_COLUMNS.filter((c) => c !== 'metadata' && c !== 'payload' && c !== 'result');
export const listedColumns = (alias?: string): string => LISTED_COLUMNS.map((c) => (alias ? `${alias}.${c}` : c)).join(', ');

/** A listing's JSON value longer than this (as text) is given as `{"omitted_bytes": n}`. */
const LISTED_JSON_BYTES = 4096;
/** Every column, for the admin API's and the CLI's listings, which give them all: the JSON ones only
 * when short. A thousand rows of 64 KiB payloads and results, the API's default page, took a replica
 * past its heap; the operation itself (`ops show`, GET /admin/operations/{id}) gives them whole. */
export const briefColumns = (alias?: string): string =>
  OPERATION_COLUMNS.map((c) => {
    const col = alias ? `${alias}.${c}` : c;
    return c === 'metadata' || c === 'payload' || c === 'result'
      ? `case when octet_length(${col}::text) > ${LISTED_JSON_BYTES} then jsonb_build_object('omitted_bytes', octet_length(${col}::text)) else ${col} end as ${c}`
      : col;
  }).join(', ');

/** pg's own text parsers as pg-types ships them, apart from its registry, which every connection in the
 * process reads and an application may change (pg.types.setTypeParser: timestamps kept as text, jsonb
 * as a string): outboxd's reads, and pg-boss's on its connections, keep to these. */
const BUILT_IN = new Map<number, (text: string) => unknown>();
textParsers.init((oid, parse) => BUILT_IN.set(oid, parse));
export const builtInTypes = {
  getTypeParser: ((oid: number, format?: 'text' | 'binary') =>
    format === 'binary' ? pg.types.getTypeParser(oid, format) : (BUILT_IN.get(oid) ?? String)) as typeof pg.types.getTypeParser,
};

const INT8 = 20;
/** bigint columns (amount, fence) hold values far below 2^53: read as numbers, on any connection (an
 * application's own pool included) without changing how that connection parses its own columns. */
export const resultTypes = {
  getTypeParser: ((oid: number, format?: 'text' | 'binary') =>
    oid === INT8 ? Number : builtInTypes.getTypeParser(oid, format)) as typeof pg.types.getTypeParser,
};

/** pg-boss's schema for an outboxd schema: `pgboss` for the default one, its own for any other, so two
 * outboxd schemas in one database never share queues. */
export const bossSchemaFor = (schema: string): string => (schema === DEFAULT_SCHEMA ? 'pgboss' : `pgboss_${schema}`);

/**
 * Statements that take a batch (the dispatcher's claims and outcomes, the relay's settlement events) find
 * each operation by its primary key whatever the statistics say. Their input (an array, a JSON array, the
 * rows a CTE took) tells the planner nothing of its size, and joined on it alone a batch was hashed against
 * every unsettled operation (a backlog's worth of rows at each outcome) or the whole ledger, or read every
 * entry of the partial index of unsettled operations while statistics counted few
 * (test/database/batchPlans.test.ts). So where they read the ledger they also name their ids as an array
 * (`byIds`: the planner counts 10 elements, which the primary key serves), and test the status in a form
 * the partial index's predicate does not match (`unsettledRow`).
 */
const byIds = (alias: string, ids: string) => `${alias}.id = any(${ids})`;
const unsettledRow = (alias: string) => `coalesce(${alias}.${UNSETTLED}, false)`;

export type SqlContext = ReturnType<typeof sqlContext>;

/** The builders for `schema`; `prepared`: named statements (outboxd's own direct connections). */
export function sqlContext(schema: string, prepared: boolean) {
  if (!SCHEMA_NAME.test(schema)) throw new Error(`not a schema name outboxd accepts: ${JSON.stringify(schema)}`);
  const s = `"${schema}"`;
  const boss = `"${bossSchemaFor(schema)}"`;
  // PostgreSQL compares prepared-statement names on their first 63 bytes: a short tag, not the name.
  const tag = createHash('sha256').update(schema).digest('hex').slice(0, 8);
  /** The CTE that records a settlement's event beside the update `op` that settled it; `source` is its parameter. */
  const settlementEvent = (source: string) => `event as (
         insert into ${s}.settlement_outbox (operation_id, source)
         select id, ${source}::text from op where status in ('succeeded', 'failed')
       )`;
  /** The operation `op` (an alias of payment_operations) is driven by nothing: no live lease, no row
   * waiting in the outbox, no live job carrying its id on one of `queues` (SQL of queue names, from
   * `op`). One anti-join over pg-boss's live jobs, so a large backlog of queued jobs costs one scan. */
  const undriven = (op: string, queues: string) =>
    `(${op}.lease_expires_at is null or ${op}.lease_expires_at < now())
       and not exists (select 1 from ${s}.charge_outbox o where o.operation_id = ${op}.id)
       and not exists (select 1 from ${boss}.job j where j.name in (${queues}) and ${LIVE_JOB('j')} and j.data->>'operationId' = ${op}.id::text)`;
  const statement =
    <A extends unknown[]>(name: string, text: string) =>
    (...values: A): QueryConfig => ({ ...(prepared ? { name: `${name}_${tag}` } : {}), text, values, types: resultTypes });
  /**
   * Data-modifying CTEs that add to the operation's timeline, one row per row of `from`: `columns` selects
   * operation_id, type, fence, actor, details. A refusal that repeats (the same flag, or an outcome that
   * executed nothing or only read, with the same details but for the attempt, duration and request id,
   * as the operation's latest event of its type) counts on that row instead (repeats, last_at); a flag
   * only on the operation's latest event, of the same fence: one after a person acknowledged it, or
   * raised by another claim, is news of its own (and an old row it counted on could be pruned under it,
   * the operation held again with no flag in its timeline). A repeated
   * outcome's claim (and a call sent, as releases before one row per call wrote it), which executed
   * nothing, go with it, but a takeover's, which is evidence: a revoked key retried every 30 s, a 429 loop,
   * a sweep that flags the same operation each run leave one row, not one a round.
   */
  const event = (from: string, columns: string) => {
    const same = (d: string) => `(${d} - 'attempt' - 'duration_ms' - 'request_id')`;
    return `${from}_ev as (
         select c1::uuid as operation_id, c2::text as type, c3::bigint as fence, c4::text as actor, c5::jsonb as details,
           row_number() over () as ord
         from (select ${columns} from ${from}) raw (c1, c2, c3, c4, c5)
       ), ${from}_repeat as (
         select n.operation_id, n.type, n.fence, last.id
         from ${from}_ev n
         cross join lateral (
           select l.id, l.fence, l.details from ${s}.operation_events l
           where l.operation_id = n.operation_id and l.type = n.type order by l.id desc limit 1
         ) last
         where (n.type = 'outcome' and (n.details->>'outcome' in ('rate_limited', 'not_executed') or n.details->>'call' <> 'create')
                or n.type = 'flagged' and last.fence is not distinct from n.fence
                  and not exists (select 1 from ${s}.operation_events x where x.operation_id = n.operation_id and x.id > last.id))
           and ${same('last.details')} = ${same('n.details')}
       ), ${from}_counted as (
         update ${s}.operation_events e set repeats = e.repeats + 1, last_at = now() from ${from}_repeat r where e.id = r.id
       ), ${from}_cycle as (
         delete from ${s}.operation_events e using ${from}_repeat r
         where r.type = 'outcome' and e.operation_id = r.operation_id and e.fence = r.fence and e.type in ('claimed', 'sent') and e.id > r.id
           and not e.details ? 'previous_owner'
       ), ${from}_event as (
         insert into ${s}.operation_events (operation_id, type, fence, actor, details)
         select n.operation_id, n.type, n.fence, n.actor, n.details from ${from}_ev n
         where not exists (select 1 from ${from}_repeat r where r.operation_id = n.operation_id and r.type = n.type)
         order by n.ord
       )`;
  };
  /** An operation's keyset cursor: created_at to the microsecond (a JavaScript Date keeps milliseconds). */
  const CURSOR = `to_char(o.created_at at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`;
  const operationsPage = (cmp: '<' | '>', dir: 'asc' | 'desc') =>
    `select ${listedColumns('o')}, ${CURSOR} as cursor_at
     from unnest($1::text[]) k(kind) cross join unnest($2::text[]) st(status)
     cross join lateral (
       select ${listedColumns('p')} from ${s}.payment_operations p
       where p.kind = k.kind and p.status = st.status and (p.created_at, p.id) ${cmp} ($3::timestamptz, $4::uuid)
       order by p.created_at ${dir}, p.id ${dir}
       limit $5
     ) o
     order by o.created_at ${dir}, o.id ${dir}
     limit $5`;
  const reviewPage = (cmp: '<' | '>', dir: 'asc' | 'desc') =>
    `select ${listedColumns('o')}, ${CURSOR} as cursor_at from ${s}.payment_operations o
     where o.review_reason is not null and o.kind = any($1::text[]) and o.status = any($2::text[])
       and (o.created_at, o.id) ${cmp} ($3::timestamptz, $4::uuid)
     order by o.created_at ${dir}, o.id ${dir}
     limit $5`;
  return { schema, s, boss, statement, settlementEvent, event, CURSOR, operationsPage, reviewPage, UNSETTLED, operationColumns, listedColumns, briefColumns, byIds, unsettledRow, undriven };
}
