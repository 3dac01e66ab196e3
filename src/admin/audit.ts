import type { Queryable } from '../db/pool.ts';

export interface AuditEntry {
  actor: string;
  action: 'resolve' | 'resolve_refused' | 'acknowledge' | 'acknowledge_refused' | 'requeue' | 'requeue_refused' | 'reconcile' | 'sign-out-everywhere';
  operationId: string | null;
  details: Record<string, unknown>;
}

/** Written in the same transaction as the action it records. */
export async function recordAudit(db: Queryable, entry: AuditEntry): Promise<void> {
  await db.query(db.sql.insertAudit(entry.actor, entry.action, entry.operationId, JSON.stringify(entry.details)));
}

export interface AuditRow {
  id: number;
  at: Date;
  actor: string;
  action: string;
  operation_id: string | null;
  details: Record<string, unknown>;
}

/** The newest `limit` entries, of one operation or of all, oldest first. */
export async function listAudit(db: Queryable, filter: { operationId?: string; limit: number }): Promise<AuditRow[]> {
  const { rows } = await db.query(db.sql.listAudit(filter.operationId ?? null, filter.limit));
  return rows;
}
