import type { Operation } from '../payments/operation.ts';

export function printOperations(rows: Operation[], json: boolean): void {
  if (json) return console.log(JSON.stringify(rows));
  if (rows.length === 0) return console.log('no operations');
  const table = rows.map((r) => ({
    id: r.id,
    order: r.order_id,
    status: r.status,
    amount: `${r.amount} ${r.currency}`,
    attempts: String(r.attempts),
    external: r.external_id ?? '-',
    review: r.review_reason ?? (r.last_error ? `(last error: ${r.last_error})` : ''),
  }));
  const cols = Object.keys(table[0]!) as (keyof (typeof table)[0])[];
  const width = (c: (typeof cols)[number]) => Math.max(c.length, ...table.map((r) => (c === 'review' ? 0 : r[c].length)));
  const line = (r: Record<string, string>) => cols.map((c) => (c === 'review' ? r[c] : r[c]!.padEnd(width(c)))).join('  ');
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
