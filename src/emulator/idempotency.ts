// The idempotency layer in front of every write: the first result of a key (per API key) is stored with
// a hash of the request and replayed byte for byte; the claim, the write and the stored result live in
// the state (state.ts), so every process serving one state agrees on a key.
import { createHash } from 'node:crypto';
import type { ServerResponse } from 'node:http';
import { clock, retentionMs, type Core, type RequestLogEntry } from './core.ts';
import { deliver } from './faults.ts';
import { error, respond } from './http.ts';
import type { Fault } from './state.ts';

/** Stripe's limit on an Idempotency-Key; true when the request was answered (too long). */
export function refuseLongKey(res: ServerResponse, entry: RequestLogEntry): boolean {
  if (entry.idempotencyKey === null || entry.idempotencyKey.length <= 255) return false;
  respond(res, entry, 400, error('invalid_request_error', 'Idempotency-Key must be at most 255 characters.'));
  return true;
}

/**
 * The same key with other parameters is a 400, a key whose first request still executes a 409, a key
 * already done replays its first result. Undefined when the request was answered here; otherwise the
 * key to store the result under (null: no key). `request` names the endpoint and its parameters: a
 * key sent to another endpoint is a mismatch. Keys are the API key's, and a connected account's
 * (Stripe-Account) are its own: the same key on the platform and on an account are two keys.
 */
export async function claimKey(
  core: Core,
  apiKey: string,
  account: string | null,
  request: string,
  res: ServerResponse,
  entry: RequestLogEntry,
  faults: Fault[],
): Promise<{ storeKey: string | null } | undefined> {
  const key = entry.idempotencyKey;
  // The platform's keys keep the form they had before accounts, so a state kept in PostgreSQL still replays them.
  const storeKey = key === null ? null : JSON.stringify(account === null ? [apiKey, key] : [apiKey, key, account]);
  if (storeKey === null) return { storeKey };
  const paramsHash = createHash('sha256').update(request).digest('hex');
  const claim = await core.state.claimKey(storeKey, paramsHash, await clock(core), retentionMs(core));
  if (claim.kind === 'mismatch') {
    respond(res, entry, 400, error('idempotency_error',
      `Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '${key}' if you meant to execute a different request.`));
    return undefined;
  }
  if (claim.kind === 'executing') {
    respond(res, entry, 409, error('invalid_request_error',
      'There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): ' + key + '. Please try again later.',
      { code: 'idempotency_key_in_use' }));
    return undefined;
  }
  if (claim.kind === 'done') {
    entry.replayed = true;
    res.setHeader('Idempotent-Replayed', 'true');
    deliver(res, entry, claim.response, faults);
    return undefined;
  }
  return { storeKey };
}

/** Runs a write under a claimed key: a write that does not commit (`commit` returns false, or throws) frees the key. */
export async function underKey(core: Core, storeKey: string | null, write: () => Promise<boolean>): Promise<void> {
  let committed = false;
  try {
    committed = await write();
  } finally {
    if (!committed && storeKey !== null) await core.state.releaseKey(storeKey);
  }
}
