// Requesting an application's effect inside the caller's transaction, as requestCharge does: the
// operation and its outbox row are written on the caller's connection, unique per (kind, key), with the
// policy the kind is defined with here; nothing here begins, commits or rolls back. The input is
// validated before anything is written.
import type { Queryable } from '../../db/pool.ts';
import { ValidationError } from '../../types/errors.ts';
import { isStorableText, MAX_ID_LENGTH, unstorableAt } from '../../types/input.ts';
import { activeTraceparent, ATTR, withSpan } from '../../telemetry/tracing.ts';
import type { EffectDefinitions } from './definition.ts';

/** A payload is kept in the operation row and handed to every execution: JSON, and not a document. */
const MAX_PAYLOAD_BYTES = 64 * 1024;

/** The key names an effect of the kind requested with another payload. */
export class EffectConflictError extends Error {
  override name = 'EffectConflictError';
  readonly kind: string;
  readonly key: string;
  /** The operation the key names. */
  readonly operationId: string;
  constructor(kind: string, key: string, operationId: string) {
    super(`key ${JSON.stringify(key)} of ${kind} is operation ${operationId}, requested with another payload: another effect needs another key`);
    this.kind = kind;
    this.key = key;
    this.operationId = operationId;
  }
}

export interface EffectRequested {
  operationId: string;
  /** false: this key already named an effect of the kind (nothing new was written). */
  created: boolean;
}

export function requestEffect(db: Queryable, defined: EffectDefinitions, kind: unknown, input: unknown): Promise<EffectRequested> {
  const def = typeof kind === 'string' ? defined.get(kind) : undefined;
  if (!def) throw new ValidationError('kind', `no effect of kind ${JSON.stringify(kind)} is defined here: defineEffect(kind, …) first`);
  const { key, payload } = parseEffectInput(input);
  return withSpan('outboxd.request_effect', { [ATTR.kind]: kind as string, [ATTR.policy]: def.policy }, async (span) => {
    const requested = await requestInTransaction(db, kind as string, def.policy, key, payload);
    span.setAttributes({ [ATTR.operationId]: requested.operationId, 'outboxd.created': requested.created });
    return requested;
  });
}

async function requestInTransaction(db: Queryable, kind: string, policy: string, key: string, payload: string): Promise<EffectRequested> {
  const { rows } = await db.query(db.sql.insertEffectOperation(kind, policy, key, payload, activeTraceparent()));
  if (rows[0]) return { operationId: rows[0].id, created: true };
  // The key names one already (committed before this statement, or by a concurrent request it waited for).
  const { rows: found } = await db.query(db.sql.effectOperationByKey(kind, key, payload));
  if (!found[0]) throw new Error(`${kind} ${key}: the key is taken by a request not yet committed; try again`);
  if (!found[0].same_payload) throw new EffectConflictError(kind, key, found[0].id);
  return { operationId: found[0].id, created: false };
}

function parseEffectInput(input: unknown): { key: string; payload: string } {
  const { key, payload, ...rest } = (input ?? {}) as { key?: unknown; payload?: unknown };
  const unknown = Object.keys(rest);
  if (unknown.length > 0) throw new ValidationError(unknown.join(', '), 'unknown field');
  if (typeof key !== 'string' || key.length === 0) throw new ValidationError('key', 'key must be a non-empty string');
  if (key.length > MAX_ID_LENGTH) throw new ValidationError('key', `key must be at most ${MAX_ID_LENGTH} characters`);
  // eslint-disable-next-line no-control-regex
  if (/[\u0000-\u001f\u007f]/.test(key)) throw new ValidationError('key', 'key must not contain control characters');
  if (!isStorableText(key)) throw new ValidationError('key', 'key must not contain U+0000 or half a surrogate pair');
  let json: string | undefined;
  try {
    json = JSON.stringify(payload ?? null);
  } catch (err) {
    throw new ValidationError('payload', `payload must be JSON: ${(err as Error).message}`);
  }
  if (json === undefined) throw new ValidationError('payload', 'payload must be JSON');
  if (Buffer.byteLength(json) > MAX_PAYLOAD_BYTES) throw new ValidationError('payload', `payload must be at most ${MAX_PAYLOAD_BYTES} bytes of JSON`);
  // What is stored is the JSON (toJSON applied), so that is what is checked, keys and strings at any depth.
  const unstorable = json.includes('\\u') ? unstorableAt(JSON.parse(json), 'payload') : undefined;
  if (unstorable) throw new ValidationError(unstorable, 'must not contain U+0000 or half a surrogate pair (PostgreSQL cannot store them)');
  return { key, payload: json };
}
