// Guessing a token, at the console's sign-in or on the admin API. Wrong tokens are counted per client
// address (and, at the console, per operator name), in PostgreSQL so that every replica counts the same
// failures. After LIMIT wrong tokens, the subject waits before any token is looked at again, the right
// one included (or the answer would tell a guesser when a guess was right), and each further wrong
// token doubles the wait. Failures stay counted while they are recent: the first within the window, or a
// wait that ended within it; a right token clears nothing (the read-only token would otherwise reset
// a guesser's count at the admin token).
//
// Each check holds its subjects' rows locked from the look at the wait to the count of the failure, so
// a burst of simultaneous guesses is judged one at a time: none passes a wait that an earlier one began.
// One that finds the rows locked never waits on the lock (a flood would hold the pool's connections): it
// tries again a few times within a second, holding no connection meanwhile, then is refused (429). So
// requests sent together with the right token (a script's parallel calls) are each judged in turn.
//
// The client is the socket's address: X-Forwarded-For is anyone's to write, so behind a proxy every
// client shares the proxy's count (a guesser there makes everyone wait), and the operator name's count
// still applies.
import { createHash, timingSafeEqual } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { Config } from '../runtime/config.ts';
import { inTransaction, type Pool } from '../db/pool.ts';

/** What a token may do: `act` (ADMIN_TOKEN) or only `read` (ADMIN_READONLY_TOKEN). */
export type Access = 'act' | 'read';

/** The tokens a deployment accepts; none: the admin API and the console do not exist. */
export function accessTokens(config: Config): [token: string, access: Access][] {
  const { token, readonlyToken } = config.admin;
  return [
    ...(token ? [[token, 'act'] as [string, Access]] : []),
    ...(readonlyToken ? [[readonlyToken, 'read'] as [string, Access]] : []),
  ];
}

const digest = (s: string) => createHash('sha256').update(s).digest();

/** The access `given` grants, compared with every token in constant time (equal-length digests). */
export function accessOf(given: string, tokens: [string, Access][]): Access | undefined {
  let access: Access | undefined;
  for (const [token, grants] of tokens) if (timingSafeEqual(digest(given), digest(token))) access = grants;
  return access;
}

export const SIGN_IN_THROTTLE = {
  /** Wrong tokens a subject may give before it must wait. */
  limit: 5,
  windowSeconds: 15 * 60,
  /** The first wait; doubled with every further wrong token. */
  blockSeconds: 30,
  maxBlockSeconds: 15 * 60,
} as const;

/** Who a token is counted against: the client, and the name an operator signs in under. */
export function tokenSubjects(req: IncomingMessage, operator?: string): string[] {
  const subjects = [`client:${req.socket.remoteAddress ?? 'unknown'}`];
  if (operator !== undefined) subjects.push(`operator:${operator.toLowerCase()}`);
  // One order for every transaction, so that two checks never wait on each other's rows.
  return subjects.sort();
}

export type TokenCheck =
  | { access: Access }
  /** `wait`: seconds before the subjects' next token is looked at (0: none yet, for a wrong token). */
  | { refused: 'throttled' | 'wrong_token'; wait: number };

const LOCK_NOT_AVAILABLE = '55P03';

/** How long a check tries again while another check of its subjects holds their rows. */
const LOCKED_RETRY_FOR_MS = 1_000;

/** How often a replica drops the failures that count for nothing any more. */
const PRUNE_EVERY_MS = 60_000;
const lastPruned = new WeakMap<Pool, number>();

/** `given` compared with the deployment's tokens, unless the subjects must wait; a wrong one is counted. */
export async function checkToken(pool: Pool, subjects: string[], given: string, tokens: [string, Access][]): Promise<TokenCheck> {
  if (Date.now() - (lastPruned.get(pool) ?? 0) > PRUNE_EVERY_MS) {
    lastPruned.set(pool, Date.now());
    await pool.query(pool.sql.pruneSignInFailures(SIGN_IN_THROTTLE.windowSeconds));
  }
  const giveUpAt = Date.now() + LOCKED_RETRY_FOR_MS;
  for (let pause = 10; ; pause = Math.min(2 * pause, 200)) {
    const check = await checkUnlessLocked(pool, subjects, given, tokens);
    if (check) return check;
    if (Date.now() >= giveUpAt) return { refused: 'throttled', wait: 1 };
    await new Promise((r) => setTimeout(r, pause * (0.5 + Math.random())));
  }
}

/** checkToken's one try; undefined, having looked at nothing, when another check holds the subjects' rows. */
function checkUnlessLocked(pool: Pool, subjects: string[], given: string, tokens: [string, Access][]): Promise<TokenCheck | undefined> {
  return inTransaction(pool, async (tx) => {
    await tx.query(tx.sql.ensureSignInSubjects(subjects));
    const locked = await tx.query(tx.sql.lockSignInSubjects(subjects)).catch((err: { code?: string }) => {
      if (err.code === LOCK_NOT_AVAILABLE) return undefined;
      throw err;
    });
    if (!locked) return undefined;
    const { rows } = locked;
    const wait = Math.max(0, ...rows.map((r: { wait_seconds: number }) => r.wait_seconds));
    if (wait > 0) return { refused: 'throttled', wait };
    const access = accessOf(given, tokens);
    if (access) return { access };
    const t = SIGN_IN_THROTTLE;
    const counted = await tx.query(tx.sql.recordSignInFailure(subjects, t.limit, t.windowSeconds, t.blockSeconds, t.maxBlockSeconds));
    return { refused: 'wrong_token', wait: Math.max(0, ...counted.rows.map((r: { wait_seconds: number }) => r.wait_seconds)) };
  });
}
