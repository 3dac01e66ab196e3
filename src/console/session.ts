// Console sessions. An operator signs in with ADMIN_TOKEN and a name; the server keeps the session in
// PostgreSQL (console_sessions) and the browser holds a random secret in an HttpOnly, SameSite=Strict
// cookie scoped to /console. Server-side rather than a signed cookie, because:
//   - sign-out ends the session for real (a copied cookie is dead too), which a stateless cookie cannot;
//   - every replica sees every session, so a console behind a load-balanced admin Service keeps working;
//   - changing ADMIN_TOKEN ends every session (each row carries an HMAC of the token it began with);
//   - an idle session ends: every page view moves its end to now + CONSOLE_IDLE_MINUTES, never past
//     8 hours from sign-in; "sign out everywhere" ends them all.
// A session begun with ADMIN_READONLY_TOKEN carries that token's HMAC, under another label: what it
// may do is read from the row, never from anything the browser sends.
// Only the SHA-256 of the cookie's secret is stored. Every form that changes something carries the
// session's CSRF token, compared in constant time; SameSite=Strict and a Sec-Fetch-Site check stand
// in front of it.
import { createHash, createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { Pool, Queryable } from '../db/pool.ts';
import type { Access } from '../http/tokens.ts';

export const SESSION_COOKIE = 'outboxd_console';
/** A working day: an operator signs in again the next morning. */
export const SESSION_TTL_SECONDS = 8 * 60 * 60;
const COOKIE_PATH = '/console';

export interface Session {
  /** The stored id: SHA-256 of the cookie's secret. */
  id: string;
  operator: string;
  /** `read`: signed in with ADMIN_READONLY_TOKEN; every action is refused. */
  access: Access;
  csrfToken: string;
  expiresAt: Date;
}

const sha256 = (s: string) => createHash('sha256').update(s).digest();

/** Equal in constant time, whatever the lengths (both sides are hashed to 32 bytes first). */
function sameSecret(given: string, expected: string): boolean {
  return timingSafeEqual(sha256(given), sha256(expected));
}

/** What ties a session to the token it began with and what that token grants, without storing anything
 * that reveals the token. */
const fingerprint = (token: string, access: Access) =>
  createHmac('sha256', token).update(access === 'act' ? 'outboxd console session' : 'outboxd console session: read only').digest('hex');

/** How long a session may go without a page view (it lasts SESSION_TTL_SECONDS at most). */
export interface SessionTimes {
  idleSeconds: number;
}

/** An operator's name as the audit trail shows it: printable, one line, at most 64 characters. */
export function parseOperatorName(raw: string): string | undefined {
  const name = raw.trim().replace(/\s+/g, ' ');
  if (name.length < 1 || name.length > 64 || /[\p{Cc}\p{Cf}]/u.test(name)) return undefined;
  return name;
}

/** A new session for `operator`, and the Set-Cookie header that hands it to the browser. */
export async function startSession(
  pool: Pool,
  signedInWith: [token: string, access: Access],
  operator: string,
  secure: boolean,
  times: SessionTimes,
): Promise<{ session: Session; cookie: string }> {
  await pool.query(pool.sql.pruneConsoleSessions());
  const secret = randomBytes(32).toString('base64url');
  const id = sha256(secret).toString('hex');
  const csrfToken = randomBytes(32).toString('base64url');
  const [token, access] = signedInWith;
  const { rows } = await pool.query(
    pool.sql.insertConsoleSession(id, operator, csrfToken, fingerprint(token, access), SESSION_TTL_SECONDS, times.idleSeconds),
  );
  const session = { id, operator, access, csrfToken, expiresAt: rows[0].expires_at as Date };
  // The cookie may outlive an idle session: the server's row decides, the cookie only carries the secret.
  return { session, cookie: cookie(secret, SESSION_TTL_SECONDS, secure) };
}

/** The live session the request's cookie names, if any; viewing a page keeps it from going idle. */
export async function sessionOf(pool: Pool, tokens: [string, Access][], req: IncomingMessage, times: SessionTimes): Promise<Session | undefined> {
  const secret = cookieValue(req, SESSION_COOKIE);
  if (!secret || !/^[A-Za-z0-9_-]{43}$/.test(secret)) return undefined;
  const id = sha256(secret).toString('hex');
  const prints = new Map(tokens.map(([token, access]) => [fingerprint(token, access), access]));
  const { rows } = await pool.query(pool.sql.touchConsoleSession(id, [...prints.keys()], SESSION_TTL_SECONDS, times.idleSeconds));
  const access = rows[0] && prints.get(rows[0].token_fingerprint);
  if (!access) return undefined;
  return { id, operator: rows[0].operator, access, csrfToken: rows[0].csrf_token, expiresAt: rows[0].expires_at };
}

export async function endSession(pool: Pool, session: Session): Promise<void> {
  await pool.query(pool.sql.deleteConsoleSession(session.id));
}

/** Ends every console session, of every operator ("sign out everywhere"): how many there were. */
export async function endAllSessions(db: Queryable): Promise<number> {
  return (await db.query(db.sql.deleteAllConsoleSessions())).rowCount ?? 0;
}

/** The Set-Cookie header that removes the session cookie. */
export const clearedCookie = (secure: boolean): string => cookie('', 0, secure);

function cookie(value: string, maxAgeSeconds: number, secure: boolean): string {
  return `${SESSION_COOKIE}=${value}; Path=${COOKIE_PATH}; Max-Age=${maxAgeSeconds}; HttpOnly; SameSite=Strict${secure ? '; Secure' : ''}`;
}

function cookieValue(req: IncomingMessage, name: string): string | undefined {
  for (const part of String(req.headers.cookie ?? '').split(';')) {
    const eq = part.indexOf('=');
    if (eq > 0 && part.slice(0, eq).trim() === name) return part.slice(eq + 1).trim();
  }
  return undefined;
}

/** The form's CSRF token is this session's. */
export function csrfMatches(session: Session, given: string | null | undefined): boolean {
  return typeof given === 'string' && given.length > 0 && sameSecret(given, session.csrfToken);
}

/**
 * A browser says where a request comes from (Sec-Fetch-Site); a state-changing request from another
 * site is refused before its token is even looked at. Clients that send no such header (curl) rely on
 * the CSRF token alone.
 */
export function crossSite(req: IncomingMessage): boolean {
  const site = req.headers['sec-fetch-site'];
  return site !== undefined && site !== 'same-origin' && site !== 'none';
}

/** Behind a TLS-terminating proxy the cookie is marked Secure (it can only make the cookie stricter). */
export function isHttps(req: IncomingMessage): boolean {
  return String(req.headers['x-forwarded-proto'] ?? '').split(',')[0]!.trim() === 'https';
}
