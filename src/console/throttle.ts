// Guessing the admin token at the console's sign-in. Wrong tokens are counted per client address and
// per operator name, in PostgreSQL so that every replica behind the admin Service counts the same
// failures. After LIMIT wrong tokens within the window, the subject waits before any token is looked at
// again, the right one included (or the wait would tell a guesser when a guess was right), and each
// further wrong token doubles the wait. A right token clears the counts of both subjects.
//
// The client is the socket's address: X-Forwarded-For is anyone's to write, so behind a proxy every
// client shares the proxy's count, and the operator name's count still applies.
import type { IncomingMessage } from 'node:http';
import type { Pool } from '../db/pool.ts';

export const SIGN_IN_THROTTLE = {
  /** Wrong tokens a subject may give within the window before it must wait. */
  limit: 5,
  windowSeconds: 15 * 60,
  /** The first wait; doubled with every further wrong token. */
  blockSeconds: 30,
  maxBlockSeconds: 15 * 60,
} as const;

/** Who a sign-in is counted against. */
export function signInSubjects(req: IncomingMessage, operator: string): string[] {
  return [`client:${req.socket.remoteAddress ?? 'unknown'}`, `operator:${operator.toLowerCase()}`];
}

/** Seconds the subjects must still wait before their next sign-in is looked at; 0: none. */
export async function signInWait(pool: Pool, subjects: string[]): Promise<number> {
  const { rows } = await pool.query(pool.sql.signInWait(subjects));
  return Math.max(0, rows[0]?.wait_seconds ?? 0);
}

/** Counts a wrong token against the subjects: the wait it now imposes, in seconds (0: none yet). */
export async function recordSignInFailure(pool: Pool, subjects: string[]): Promise<number> {
  const t = SIGN_IN_THROTTLE;
  await pool.query(pool.sql.pruneSignInFailures(t.windowSeconds));
  await pool.query(pool.sql.recordSignInFailure(subjects, t.limit, t.windowSeconds, t.blockSeconds, t.maxBlockSeconds));
  return signInWait(pool, subjects);
}

export async function clearSignInFailures(pool: Pool, subjects: string[]): Promise<void> {
  await pool.query(pool.sql.clearSignInFailures(subjects));
}
