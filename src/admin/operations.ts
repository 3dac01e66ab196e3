// Read-side of the admin capability: listings for people and scripts.
import type { Queryable } from '../db/pool.ts';
import { ValidationError } from '../types/errors.ts';
import { isOperationId, OperationNotFoundError, type Operation } from '../engine/operation.ts';

function parseOperationId(id: string): string {
  if (!isOperationId(id)) throw new ValidationError('operationId', `not an operation id (a UUID): ${JSON.stringify(id)}`);
  return id.toLowerCase();
}

export async function listOperations(
  db: Queryable,
  filter: { status?: string; needsReview?: boolean; limit?: number; newestFirst?: boolean },
): Promise<Operation[]> {
  const list = filter.needsReview
    ? filter.newestFirst ? db.sql.listReviewNewest : db.sql.listReview
    : filter.newestFirst ? db.sql.listOperationsNewest : db.sql.listOperations;
  const { rows } = await db.query(list(filter.status ?? null, filter.limit ?? 1000));
  return rows;
}

export async function showOperation(db: Queryable, id: string): Promise<Operation> {
  const { rows } = await db.query(db.sql.showOperation(parseOperationId(id)));
  if (!rows[0]) throw new OperationNotFoundError(id);
  return rows[0];
}

/** What findOperation takes, checked before anything is opened: an operation id, or a prefix of 8 or
 * more of its hex digits (dashes optional), lower-cased. */
export function operationReference(text: string, field: 'operationId' | 'chargeOperationId' = 'operationId'): string {
  const typed = text.trim().toLowerCase();
  if (!isOperationId(typed) && !/^[0-9a-f]{8,32}$/.test(typed.replaceAll('-', ''))) {
    throw new ValidationError(field, `not an operation id (a UUID, or its first 8 or more hex digits): ${JSON.stringify(text)}`);
  }
  return typed;
}

/** Candidates named when a short id is ambiguous. */
const AMBIGUOUS_SHOWN = 10;

/**
 * The operation an operator means: by its full UUID, or by a unique prefix of at least 8 hex digits (dashes
 * optional), such as the short id the console and the demo print (shortOperationId). An ambiguous prefix
 * is refused, listing the candidates: 8 digits of a time-ordered id name every operation of ~65 s.
 */
export async function findOperation(db: Queryable, text: string): Promise<Operation> {
  const typed = operationReference(text);
  if (isOperationId(typed)) return showOperation(db, typed);
  const hex = typed.replaceAll('-', '');
  const { rows } = await db.query(db.sql.operationsByIdPrefix(hex, AMBIGUOUS_SHOWN + 1));
  if (rows.length === 0) throw new OperationNotFoundError(text);
  if (rows.length > 1) {
    const ids = rows.slice(0, AMBIGUOUS_SHOWN).map((r: Operation) => r.id);
    throw new ValidationError('operationId', `${text} is ambiguous, it begins ${ids.join(', ')}${rows.length > AMBIGUOUS_SHOWN ? ', …' : ''}`);
  }
  return rows[0];
}
