// Bulk confirmation from a JSON-lines file: each line its own atomic confirmation, bad lines reported
// by number and skipped, a bounded number of confirmations in flight (one process, not one per order).
import { createReadStream } from 'node:fs';
import { createInterface } from 'node:readline';
import type { Pool } from '../db/pool.ts';
import { confirmOrder } from './confirm.ts';

/** Confirmations in flight: enough to keep PostgreSQL's commits busy (npm run bench, confirm-order at 16 clients). */
export const BULK_CONCURRENCY = 16;

export interface BulkFailure {
  line: number;
  error: string;
  field?: string;
}

export interface BulkSummary {
  lines: number;
  confirmed: number;
  alreadyConfirmed: number;
  failed: number;
  failures: BulkFailure[];
}

export async function confirmFromFile(
  db: Pool,
  file: string,
  opts: { concurrency?: number; onProgress?: (s: BulkSummary) => void } = {},
): Promise<BulkSummary> {
  const summary: BulkSummary = { lines: 0, confirmed: 0, alreadyConfirmed: 0, failed: 0, failures: [] };
  const inFlight = new Set<Promise<void>>();
  const limit = opts.concurrency ?? BULK_CONCURRENCY;

  const confirmLine = async (text: string, line: number) => {
    try {
      const { created } = await confirmOrder(db, JSON.parse(text));
      if (created) summary.confirmed++;
      else summary.alreadyConfirmed++;
    } catch (err) {
      const e = err as Error & { field?: string };
      summary.failed++;
      summary.failures.push({ line, error: e.message, ...(e.field ? { field: e.field } : {}) });
    }
    opts.onProgress?.(summary);
  };

  const lines = createInterface({ input: createReadStream(file), crlfDelay: Infinity });
  for await (const text of lines) {
    const line = ++summary.lines;
    if (text.trim() === '') continue;
    const p = confirmLine(text, line).finally(() => inFlight.delete(p));
    inFlight.add(p);
    if (inFlight.size >= limit) await Promise.race(inFlight);
  }
  await Promise.all(inFlight);
  summary.failures.sort((a, b) => a.line - b.line);
  return summary;
}
