// Read-side of the admin capability: listings for people and scripts.
import type { Queryable } from '../db/pool.ts';
import { ValidationError } from '../orders/validate.ts';
import { isOperationId, OperationNotFoundError, type Operation } from '../payments/operation.ts';

function parseOperationId(id: string): string {
  if (!isOperationId(id)) throw new ValidationError('operationId', `not an operation id (a UUID): ${JSON.stringify(id)}`);
  return id.toLowerCase();
}

export async function listOperations(
  db: Queryable,
  filter: { status?: string; needsReview?: boolean; limit?: number },
): Promise<Operation[]> {
  const { rows } = await db.query(db.sql.listOperations(filter.status ?? null, !!filter.needsReview, filter.limit ?? 1000));
  return rows;
}

export async function showOperation(db: Queryable, id: string): Promise<Operation> {
  const { rows } = await db.query(db.sql.showOperation(parseOperationId(id)));
  if (!rows[0]) throw new OperationNotFoundError(id);
  return rows[0];
}
