// The drift report: Stripe against our operations, kind by kind (each kind's evidence lists its objects
// and says what does not add up: src/kinds/<kind>/evidence.ts). Drift is money that moved without a succeeded
// operation to show for it, or a succeeded operation without its money.
import type { Pool } from '../db/pool.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import { isOperationId, type Operation } from '../types/operation.ts';
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
      named: (objects) => namedPages(pool, objects, (id) => compared.add(id)),
      byExternalIds: async (of, ids) => (await pool.query(pool.sql.operationsByExternalIds(of, ids))).rows,
      succeeded: () => succeededPages(pool, since, kind, (id) => compared.add(id)),
    });
    report[part.label] = part.listed;
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

/** Objects by the operation id each names, with that operation (looked up DRIFT_PAGE ids at a time), each
 * operation found told to `seen`. */
async function* namedPages<T extends { operationId?: string | undefined }>(
  pool: Pool,
  objects: readonly T[],
  seen: (id: string) => void,
): AsyncIterable<[string, T[], Operation | undefined][]> {
  const byOperation = new Map<string, T[]>();
  for (const o of objects) {
    if (o.operationId === undefined) continue;
    const list = byOperation.get(o.operationId);
    if (list) list.push(o);
    else byOperation.set(o.operationId, [o]);
  }
  const named = [...byOperation];
  for (let page = 0; page < named.length; page += DRIFT_PAGE) {
    const batch = named.slice(page, page + DRIFT_PAGE);
    const ids = batch.map(([id]) => id).filter(isOperationId);
    const ops = new Map<string, Operation>((await pool.query(pool.sql.operationsByIds(ids))).rows.map((o: Operation) => [o.id, o]));
    for (const id of ops.keys()) seen(id);
    yield batch.map(([id, list]) => [id, list, ops.get(id)]);
  }
}
