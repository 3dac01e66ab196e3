// Every SQL statement outboxd runs against its own tables, in one place. Read top to bottom this is the
// whole data path. On outboxd's own direct connections each is a named prepared statement (parsed and
// planned once per connection: measured, about 40 % of the server's CPU per settled operation); on an
// application's connections and behind a transaction pooler they are unnamed (a pooler hands the next
// transaction to another server connection, where a name prepared earlier does not exist).
// Status writes are only ever issued by src/engine/operation.ts, the operation's state machine.
//
// The statements are built for one schema (OUTBOXD_SCHEMA) and name every table with it: some run on
// the application's own connection, inside its transaction, whose search_path is not ours. Their
// prepared-statement names carry a tag of the schema, so one connection can serve two schemas. No
// statement reads `*` of a table: a column a migration adds must not change a prepared statement's
// result type while old replicas run.
//
// One file per area, each beside the others here: outbox.ts (the outbox and settlement events),
// operations.ts (the state machine's claims, leases and fenced writes), charge.ts, refund.ts, hold.ts
// (captures and cancels) and effects.ts (requesting each kind), reconcile.ts, webhooks.ts, retention.ts, admin.ts, console.ts,
// sessions.ts, budget.ts and health.ts; context.ts holds what they are built from. The example
// application's statements are its own (src/exampleApp/sql.ts).
import { sqlContext } from './context.ts';
import { adminStatements } from './admin.ts';
import { budgetStatements } from './budget.ts';
import { chargeStatements } from './charge.ts';
import { consoleStatements } from './console.ts';
import { effectsStatements } from './effects.ts';
import { healthStatements } from './health.ts';
import { holdStatements } from './hold.ts';
import { operationsStatements } from './operations.ts';
import { outboxStatements } from './outbox.ts';
import { reconcileStatements } from './reconcile.ts';
import { refundStatements } from './refund.ts';
import { retentionStatements } from './retention.ts';
import { sessionsStatements } from './sessions.ts';
import { webhooksStatements } from './webhooks.ts';

export { bossSchemaFor, builtInTypes, DEFAULT_SCHEMA, operationColumns, resultTypes, SCHEMA_NAME } from './context.ts';

export type Statements = ReturnType<typeof build>;

const built = new Map<string, Statements>();

/** The statements for `schema` (a lower-case identifier, as config.ts validates OUTBOXD_SCHEMA);
 * `prepared`: named, for outboxd's own direct connections, or unnamed (see above). */
export function statementsFor(schema: string, prepared = false): Statements {
  const key = `${schema}:${prepared}`;
  let statements = built.get(key);
  if (!statements) built.set(key, (statements = build(schema, prepared)));
  return statements;
}

function build(schema: string, prepared: boolean) {
  const c = sqlContext(schema, prepared);
  return {
    /** The schema they were built for. */
    schema,
    ...outboxStatements(c),
    ...chargeStatements(c),
    ...refundStatements(c),
    ...holdStatements(c),
    ...effectsStatements(c),
    ...operationsStatements(c),
    ...webhooksStatements(c),
    ...retentionStatements(c),
    ...reconcileStatements(c),
    ...adminStatements(c),
    ...sessionsStatements(c),
    ...consoleStatements(c),
    ...budgetStatements(c),
    ...healthStatements(c),
  };
}
