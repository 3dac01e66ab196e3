// The subset of Stripe's search query language the emulator understands:
//   clause (AND clause)*   where clause is  field:'value'  or  metadata['key']:'value'
// fields: status, customer, currency, amount. Anything else is a 400, as Stripe would answer.
export interface SearchClause {
  field: string;
  metadataKey?: string;
  value: string;
}

const CLAUSE = /^\s*(metadata\[['"]([^'"]+)['"]\]|status|customer|currency|amount)\s*:\s*['"]([^'"]*)['"]\s*$/;

export function parseSearchQuery(query: string): SearchClause[] {
  const parts = query.split(/\s+AND\s+/);
  return parts.map((part) => {
    const m = CLAUSE.exec(part);
    if (!m) throw new Error(`unsupported search clause: ${part.trim() || '(empty)'}`);
    return m[2] ? { field: 'metadata', metadataKey: m[2], value: m[3]! } : { field: m[1]!, value: m[3]! };
  });
}

export function matches(pi: Record<string, unknown>, clauses: SearchClause[]): boolean {
  return clauses.every((c) => {
    if (c.field === 'metadata') return (pi.metadata as Record<string, string>)[c.metadataKey!] === c.value;
    return String(pi[c.field]) === c.value;
  });
}
