// The statements of the console's sessions and sign-in throttling (src/console/session.ts, src/http/tokens.ts).
import type { SqlContext } from './context.ts';

export const sessionsStatements = ({ s, statement }: SqlContext) => ({
  /** A session ends when idle for idleSeconds, and ttlSeconds after it began at the latest. */
  insertConsoleSession: statement<[id: string, operator: string, csrfToken: string, fingerprint: string, ttlSeconds: number, idleSeconds: number]>(
    'outboxd_insert_console_session',
    `insert into ${s}.console_sessions (id, operator, csrf_token, token_fingerprint, expires_at)
     values ($1, $2, $3, $4, now() + make_interval(secs => least($5::float8, $6::float8)))
     returning expires_at`,
  ),

  /** A live session begun with a token in force now (one of `fingerprints`), within ttlSeconds of its
   * start: its idle end moves on. */
  touchConsoleSession: statement<[id: string, fingerprints: string[], ttlSeconds: number, idleSeconds: number]>(
    'outboxd_touch_console_session',
    `update ${s}.console_sessions
     set expires_at = least(created_at + make_interval(secs => $3), now() + make_interval(secs => $4))
     where id = $1 and token_fingerprint = any($2::text[]) and expires_at > now() and created_at + make_interval(secs => $3) > now()
     returning operator, csrf_token, token_fingerprint, expires_at`,
  ),

  deleteConsoleSession: statement<[id: string]>(
    'outboxd_delete_console_session',
    `delete from ${s}.console_sessions where id = $1`,
  ),

  deleteAllConsoleSessions: statement<[]>(
    'outboxd_delete_all_console_sessions',
    `delete from ${s}.console_sessions`,
  ),

  /** Each subject's row, made if missing (a statement of its own: the lock's snapshot must see it). */
  ensureSignInSubjects: statement<[subjects: string[]]>(
    'outboxd_ensure_sign_in_subjects',
    `insert into ${s}.console_sign_in_failures (subject, failures) select unnest($1::text[]), 0
     on conflict (subject) do nothing`,
  ),

  /** Each subject's row, locked for the rest of the transaction, with the seconds it must still wait;
   * refused at once (55P03) when another check holds one. */
  lockSignInSubjects: statement<[subjects: string[]]>(
    'outboxd_lock_sign_in_subjects',
    `select subject, greatest(0, ceil(extract(epoch from blocked_until - now())))::int as wait_seconds
     from ${s}.console_sign_in_failures where subject = any($1::text[])
     order by subject for update nowait`,
  ),

  /**
   * A wrong token, counted for each (locked) subject while its failures are recent: the first within
   * windowSeconds, or a wait that ended within it. From the limit-th on, the subject waits
   * blockSeconds, doubled with each further failure, up to maxBlockSeconds.
   */
  recordSignInFailure: statement<[subjects: string[], limit: number, windowSeconds: number, blockSeconds: number, maxBlockSeconds: number]>(
    'outboxd_record_sign_in_failure',
    (() => {
      const window = `now() - make_interval(secs => $3::float8)`;
      const recent = `(f.failures > 0 and (f.first_failed_at > ${window} or f.blocked_until > ${window}))`;
      const failures = `(case when ${recent} then f.failures + 1 else 1 end)`;
      return `update ${s}.console_sign_in_failures f set
       failures = ${failures},
       first_failed_at = case when ${recent} then f.first_failed_at else now() end,
       blocked_until = case when ${failures} >= $2::int
         then now() + make_interval(secs => least($4::float8 * power(2, least(${failures} - $2::int, 16)), $5::float8))
         else f.blocked_until end
     where f.subject = any($1::text[])
     returning greatest(0, ceil(extract(epoch from f.blocked_until - now())))::int as wait_seconds`;
    })(),
  ),

  /** Subjects whose failures count for nothing any more: none within the window, no wait that ended within it. */
  pruneSignInFailures: statement<[windowSeconds: number]>(
    'outboxd_prune_sign_in_failures',
    `delete from ${s}.console_sign_in_failures
     where first_failed_at < now() - make_interval(secs => $1::float8)
       and (blocked_until is null or blocked_until < now() - make_interval(secs => $1::float8))`,
  ),

  pruneConsoleSessions: statement<[]>(
    'outboxd_prune_console_sessions',
    `delete from ${s}.console_sessions where expires_at <= now()`,
  ),
});
