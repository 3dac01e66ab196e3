// Bulk confirmation from a JSON-lines file: each line its own atomic confirmation, bad lines reported
// by number and skipped, a bounded number of confirmations in flight (one process, not one per order).
// A database error is not a bad line: it is retried, and if it persists the run stops and says which
// lines were not confirmed (running the file again is safe: a confirmed order keeps its operation).
import { createReadStream } from 'node:fs';
import { createInterface } from 'node:readline';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Pool } from '../db/pool.ts';
import { OrderConflictError } from '../kinds/charge/request.ts';
import { confirmOrder } from './confirm.ts';
import { ValidationError } from '../types/errors.ts';

/** Confirmations in flight: enough to keep PostgreSQL's commits busy (npm run bench, confirm-order at 16 clients). */
export const BULK_CONCURRENCY = 16;

/** Waits before each retry of a line that failed for a reason other than its content (~4 s in all). */
const RETRY_DELAYS_MS = [250, 500, 1000, 2000];

export interface BulkFailure {
  line: number;
  error: string;
  field?: string;
}

export interface BulkConfirmation {
  line: number;
  operationId: string;
  /** false when the order had been confirmed before (same operation, nothing enqueued). */
  created: boolean;
}

export interface BulkSummary {
  /** Lines read (all of them unless the run stopped). */
  lines: number;
  confirmed: number;
  alreadyConfirmed: number;
  failed: number;
  /** Bad lines: refused for their content, skipped. */
  failures: BulkFailure[];
  /** Each line's operation, when asked for (keepConfirmations): a file of millions of lines would hold
   * as many entries. */
  confirmations: BulkConfirmation[];
  /** Lines whose confirmation kept failing for another reason (the database): not confirmed, the run stopped. */
  unconfirmed: { line: number; error: string }[];
  /** Set when the run stopped before the end of the file: this line and the ones after it were not read. */
  unreadFromLine?: number;
}

/** The line itself is at fault: retrying it cannot help. */
const isBadLine = (err: unknown): boolean =>
  err instanceof SyntaxError || err instanceof ValidationError || err instanceof OrderConflictError;

export async function confirmFromFile(
  db: Pool,
  file: string,
  opts: { concurrency?: number; onProgress?: (s: BulkSummary) => void; keepConfirmations?: boolean } = {},
): Promise<BulkSummary> {
  const summary: BulkSummary = {
    lines: 0,
    confirmed: 0,
    alreadyConfirmed: 0,
    failed: 0,
    failures: [],
    confirmations: [],
    unconfirmed: [],
  };
  const inFlight = new Set<Promise<void>>();
  const limit = opts.concurrency ?? BULK_CONCURRENCY;
  let stopped = false;

  const confirmLine = async (text: string, line: number) => {
    for (let attempt = 0; ; attempt++) {
      try {
        const { operationId, created } = await confirmOrder(db, JSON.parse(text));
        if (opts.keepConfirmations) summary.confirmations.push({ line, operationId, created });
        if (created) summary.confirmed++;
        else summary.alreadyConfirmed++;
        break;
      } catch (err) {
        const e = err as Error & { field?: string };
        if (isBadLine(err)) {
          summary.failed++;
          summary.failures.push({ line, error: e.message, ...(e.field ? { field: e.field } : {}) });
          break;
        }
        const delay = RETRY_DELAYS_MS[attempt];
        if (delay === undefined) {
          summary.unconfirmed.push({ line, error: e.message });
          stopped = true;
          break;
        }
        await sleep(delay + Math.random() * delay * 0.5);
      }
    }
    opts.onProgress?.(summary);
  };

  const input = createReadStream(file);
  const lines = createInterface({ input, crlfDelay: Infinity });
  try {
    for await (const text of lines) {
      if (stopped) {
        summary.unreadFromLine = summary.lines + 1;
        break;
      }
      const line = ++summary.lines;
      if (text.trim() === '') continue;
      const p = confirmLine(text, line).finally(() => inFlight.delete(p));
      inFlight.add(p);
      if (inFlight.size >= limit) await Promise.race(inFlight);
    }
  } finally {
    await Promise.all(inFlight);
    input.destroy();
  }
  summary.failures.sort((a, b) => a.line - b.line);
  summary.confirmations.sort((a, b) => a.line - b.line);
  summary.unconfirmed.sort((a, b) => a.line - b.line);
  return summary;
}
