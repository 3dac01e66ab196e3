// The drift report: Stripe against our operations, kind by kind (each kind's evidence lists its objects
// and says what does not add up: src/kinds/<kind>/evidence.ts). Drift is money that moved without a succeeded
// operation to show for it, or a succeeded operation without its money.
import type { Pool } from '../db/pool.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import type { Operation } from '../types/operation.ts';
import { DRIFT_PAGE, type Drift } from '../types/kind.ts';
import { inBackground } from '../stripe/budgetedGateway.ts';
import { evidenceOf } from '../kinds/index.ts';

export type { Drift };

/** Since when, how many objects of each kind Stripe listed (`charges`, `refunds`), how many operations
 * were compared, and the drift. */
export type DriftReport = { since: string; operations: number; drift: Drift[] } & Record<string, string | number | Drift[]>;

export async function driftReport(pool: Pool, budgeted: PaymentGateway, since: Date): Promise<DriftReport> {
  // A report yields to the dispatchers in the fleet's Stripe budget.
  const gateway = inBackground(budgeted);
  const kinds = evidenceOf(gateway);
  const compared = new Set<string>();
  const report: DriftReport = { since: since.toISOString(), operations: 0, drift: [] };
  const drift: Drift[] = [];
  for (const { kind, evidence } of kinds) {
    const part = await evidence.drift({
      since,
      operations: async (ids) => (await pool.query(pool.sql.operationsByIds(ids))).rows,
      byExternalIds: async (of, ids) => (await pool.query(pool.sql.operationsByExternalIds(of, ids))).rows,
      succeeded: () => succeededPages(pool, since, kind, (id) => compared.add(id)),
    });
    report[part.label] = part.listed;
    for (const id of part.operationIds) compared.add(id);
    drift.push(...part.drift);
  }
  return { ...report, operations: compared.size, drift };
}

/** A kind's succeeded operations settled since `since`, DRIFT_PAGE at a time, each id told to `seen`. */
async function* succeededPages(pool: Pool, since: Date, kind: string, seen: (id: string) => void): AsyncIterable<Operation[]> {
  let after: { settledAt: string; id: string } | null = null;
  for (;;) {
    const rows: (Operation & { cursor_settled_at: string })[] = (await pool.query(pool.sql.succeededSince(since, kind, after?.settledAt ?? null, after?.id ?? null, DRIFT_PAGE))).rows;
    for (const op of rows) seen(op.id);
    if (rows.length > 0) yield rows;
    if (rows.length < DRIFT_PAGE) return;
    const last = rows.at(-1)!;
    after = { settledAt: last.cursor_settled_at, id: last.id };
  }
}
