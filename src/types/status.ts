// An operation's statuses and the policies it can be requested under: the lists the table's checks
// (src/db/schema.ts) and the code share. Kept apart from the schema so that the worker, which never
// builds a query with drizzle, does not load drizzle-orm (18 MB of a replica's memory, measured).
export const OPERATION_STATUSES = ['pending', 'unknown', 'succeeded', 'failed'] as const;
export type OperationStatus = (typeof OPERATION_STATUSES)[number];

export const POLICIES = ['idempotent-key', 'at-least-once', 'reconcile-before-retry'] as const;
export type Policy = (typeof POLICIES)[number];
