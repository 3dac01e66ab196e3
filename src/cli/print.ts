import type { AuditRow } from '../admin/audit.ts';
import type { Operation } from '../engine/operation.ts';

export function printOperations(rows: Operation[], json: boolean): void {
  if (json) return console.log(JSON.stringify(rows));
  if (rows.length === 0) return console.log('no operations');
  printTable(
    rows.map((r) => ({
      id: r.id,
      kind: r.kind,
      order: r.order_id ?? '-',
      status: r.status,
      amount: r.amount === null ? '-' : `${r.amount} ${r.currency}`,
      attempts: String(r.attempts),
      external: r.external_id ?? '-',
      // Only an operation held for a person has a review reason; its last error is in `ops show`.
      review: r.review_reason ?? '',
    })),
  );
}

export function printAudit(rows: AuditRow[], json: boolean): void {
  if (json) return console.log(JSON.stringify(rows));
  if (rows.length === 0) return console.log('no audit entries');
  printTable(
    rows.map((r) => ({
      at: r.at.toISOString(),
      actor: r.actor,
      action: r.action,
      operation: r.operation_id ?? '-',
      details: JSON.stringify(r.details),
    })),
  );
}

/** Aligned columns under a header; the last column is free text, left unpadded. */
function printTable(table: Record<string, string>[]): void {
  const cols = Object.keys(table[0]!);
  const last = cols[cols.length - 1];
  const width = (c: string) => Math.max(c.length, ...table.map((r) => r[c]!.length));
  const line = (r: Record<string, string>) => cols.map((c) => (c === last ? r[c] : r[c]!.padEnd(width(c)))).join('  ');
  console.log(line(Object.fromEntries(cols.map((c) => [c, c]))));
  for (const r of table) console.log(line(r));
}

/** Sorted line numbers, runs folded: [1, 2, 3, 7, 9, 10] → "1-3, 7, 9-10". */
export function ranges(numbers: number[]): string {
  const parts: string[] = [];
  for (let i = 0; i < numbers.length; i++) {
    const start = numbers[i]!;
    while (numbers[i + 1] === numbers[i]! + 1) i++;
    parts.push(start === numbers[i] ? String(start) : `${start}-${numbers[i]}`);
  }
  return parts.join(', ');
}
