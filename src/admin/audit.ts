import type { Queryable } from '../db/pool.ts';

export interface AuditEntry {
  actor: string;
  action: 'resolve' | 'requeue' | 'reconcile';
  operationId: string | null;
  details: Record<string, unknown>;
}

/** Written in the same transaction as the action it records. */
export async function recordAudit(db: Queryable, entry: AuditEntry): Promise<void> {
  await db.query(db.sql.insertAudit(entry.actor, entry.action, entry.operationId, JSON.stringify(entry.details)));
}
