import { CommanderError } from 'commander';
import { ConfigError } from '../runtime/config.ts';
import { OrderConflictError } from '../kinds/charge/request.ts';
import { ValidationError } from '../types/errors.ts';
import { OperationNotFoundError } from '../engine/operation.ts';
import { ResolutionRefused } from '../admin/resolve.ts';
import { RefundRefused } from '../kinds/refund/request.ts';
import { AuthorizationRefused } from '../kinds/hold/request.ts';

/** Exit codes: 0 done; 1 failure; 2 bad usage, input or a refused action; 3 partly done (bulk lines
 * refused); 4 not found; 5 drift between Stripe and the operations. */
export const EXIT = { ok: 0, failure: 1, usage: 2, partial: 3, notFound: 4, drift: 5 } as const;

export function exitCodeOf(err: unknown): number {
  if (err instanceof CommanderError) return err.exitCode === 0 ? EXIT.ok : EXIT.usage;
  if (err instanceof ValidationError || err instanceof ConfigError || err instanceof OrderConflictError || err instanceof ResolutionRefused || err instanceof RefundRefused || err instanceof AuthorizationRefused) return EXIT.usage;
  if (err instanceof OperationNotFoundError) return EXIT.notFound;
  return EXIT.failure;
}

/** Commander's exits that are not errors, or whose output (the help) has been written already. */
const SHOWN = new Set(['commander.help', 'commander.helpDisplayed', 'commander.version']);

/**
 * What to print on stderr for an error that ended a command: input errors name the flag an operator
 * typed (`--order-id`), not the field behind it (`orderId`). Undefined for help and version output.
 */
export function errorMessage(err: unknown, context: { command?: string; schema?: string } = {}): string | undefined {
  if (err instanceof CommanderError && SHOWN.has(err.code)) return undefined;
  if (err instanceof ValidationError) return `${flagOf(err.field)}: ${err.detail}`;
  const message = err instanceof Error ? err.message : String(err);
  // Every table a command reads is outboxd's own: one missing means the migrations have not run there,
  // or that the command looks in another database or schema than meant.
  if ((err as { code?: unknown } | null)?.code === '42P01' && context.command !== 'migrate') {
    const schema = context.schema ? ` in the schema ${context.schema}` : '';
    return `the database is not migrated${schema} (${message}): run \`outboxd migrate\`, or check DATABASE_URL and OUTBOXD_SCHEMA`;
  }
  return message;
}

/** The command line's name for an input field: orderId → --order-id; an operation id is the OP_ID argument. */
export function flagOf(field: string): string {
  if (field === 'operationId') return 'OP_ID';
  if (field === 'chargeOperationId') return 'CHARGE_OP_ID';
  return `--${field.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)}`;
}
