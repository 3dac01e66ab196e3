// Who may use the console and the admin API, against a real worker process over HTTP: the read-only
// token sees everything and the server refuses its every action; wrong tokens are throttled, at the
// sign-in per client address and per operator name and on the admin API per client (429 + Retry-After,
// counted), a burst no better than a sequence, and the right token works again once the wait is over;
// sessions end when idle, and all at once with "sign out everywhere".
import { request as httpRequest } from 'node:http';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SIGN_IN_THROTTLE } from '../../src/http/tokens.ts';
import { startReplica, waitUntil, type Replica } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation } from '../support/fixtures.ts';

const TOKEN = 'console-access-admin-token-0123';
const READONLY = 'console-access-read-only-token-0123';
let t: TestDb;
let e: RunningEmulator;
let replica: Replica;
let admin: number;

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  replica = await startReplica({
    DATABASE_URL: t.url,
    STRIPE_API_BASE: e.url,
    ADMIN_TOKEN: TOKEN,
    ADMIN_READONLY_TOKEN: READONLY,
    CONSOLE_IDLE_MINUTES: '5',
    ADMIN_HTTP_PORT: '0',
    // Every loopback address reaches it: the tests sign in from several client addresses.
    ADMIN_HTTP_HOST: '0.0.0.0',
    HTTP_HOST: '127.0.0.1',
    WORKER_CONCURRENCY: '2',
    RECONCILE_CRON: '0 0 1 1 *',
  });
  admin = (replica.logs.find((l) => l.msg === 'worker ready') as { adminHttpPort: number }).adminHttpPort;
});
afterAll(async () => {
  if (replica) {
    replica.kill('SIGTERM');
    await replica.exited;
  }
  await Promise.all([t?.close(), e?.close()]);
});

interface Answer {
  status: number;
  headers: Record<string, string | string[] | undefined>;
  body: string;
}

/** An HTTP request to the admin listener from a chosen loopback address (a client of its own). */
function send(method: string, path: string, opts: { from?: string; headers?: Record<string, string>; body?: string } = {}): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(
      { host: '127.0.0.1', port: admin, method, path, localAddress: opts.from ?? '127.0.0.1', headers: { ...opts.headers, ...(opts.body ? { 'Content-Length': Buffer.byteLength(opts.body) } : {}) } },
      (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (c) => (body += c));
        res.on('end', () => resolve({ status: res.statusCode!, headers: res.headers, body }));
      },
    );
    req.on('error', reject);
    req.end(opts.body);
  });
}

const FORM = { 'Content-Type': 'application/x-www-form-urlencoded' };
const signIn = (operator: string, token: string, from?: string) =>
  send('POST', '/console/sign-in', { from, headers: FORM, body: new URLSearchParams({ operator, token }).toString() });

/** Signs in and returns the cookie and the page's CSRF token. */
async function session(operator: string, token: string): Promise<{ cookie: string; csrf: string }> {
  const res = await signIn(operator, token);
  expect(res.status, JSON.stringify(replica.logs.filter((l) => l.level as number >= 50).slice(-2))).toBe(303);
  const cookie = String(res.headers['set-cookie']).split(';')[0]!;
  const page = await send('GET', '/console/', { headers: { Cookie: cookie } });
  const csrf = /name="csrf" value="([^"]+)"/.exec(page.body)![1]!;
  return { cookie, csrf };
}

const post = (path: string, s: { cookie: string; csrf: string }, fields: Record<string, string> = {}) =>
  send('POST', path, { headers: { ...FORM, Cookie: s.cookie }, body: new URLSearchParams({ csrf: s.csrf, ...fields }).toString() });
const audit = async () => (await t.pool.query(`select actor, action, operation_id from outboxd.admin_audit order by id`)).rows;
const bearer = (token: string) => ({ Authorization: `Bearer ${token}`, 'Content-Type': 'application/json' });

describe('the overview', () => {
  it('reads its figures once for every view of the replica for a while (they count a day of settlements): one reloaded at once shows the same counts', async () => {
    const viewer = await session('viewer', READONLY);
    const needsReview = async () => /<div class="card-label">Needs review<\/div><div class="card-value">(\d+)<\/div>/.exec((await send('GET', '/console/', { headers: { Cookie: viewer.cookie } })).body)![1];
    const before = await needsReview();
    const held = [await confirm(t), await confirm(t)];
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'checked by hand' where id = any($1::uuid[])`, [held]);
    expect(await needsReview()).toBe(before);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now(), review_reason = null where id = any($1::uuid[])`, [held]);
  });
});

describe('the read-only token', () => {
  it('reads the admin API, and every action it asks for is refused with 403 and changes nothing', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await waitUntil(async () => (await operation(t, op)).status === 'unknown', 20_000, 'the operation to wait on Stripe');
    const list = await send('GET', '/admin/operations', { headers: bearer(READONLY) });
    expect(list.status).toBe(200);
    expect(JSON.parse(list.body).operations.map((o: { id: string }) => o.id)).toContain(op);
    expect((await send('GET', `/admin/operations/${op}`, { headers: bearer(READONLY) })).status).toBe(200);
    const before = await operation(t, op);
    for (const [path, body] of [
      [`/admin/operations/${op}/resolve`, { outcome: 'failed', reason: 'read-only tries' }],
      [`/admin/operations/${op}/requeue`, { dryRun: true }],
      [`/admin/operations/${op}/acknowledge`, { note: 'read-only tries' }],
      ['/admin/requeue-stuck', { olderThanSeconds: 0 }],
      ['/admin/reconcile', {}],
    ] as const) {
      const res = await send('POST', path, { headers: bearer(READONLY), body: JSON.stringify(body) });
      expect(res.status, path).toBe(403);
      expect(JSON.parse(res.body).error, path).toBe('read_only');
    }
    expect(await audit()).toEqual([]);
    expect((await operation(t, op)).fence).toBe(before.fence);
    expect((await operation(t, op)).status).toBe('unknown');
    // The admin token still acts.
    expect((await send('POST', `/admin/operations/${op}/requeue`, { headers: bearer(TOKEN), body: '{"dryRun":true}' })).status).not.toBe(403);
  });

  it('signs in to the console, sees every page without a form that changes anything, and is refused on the server', async () => {
    const op = (await t.pool.query(`select id from outboxd.payment_operations where status = 'unknown' limit 1`)).rows[0].id as string;
    const reader = await session('rita', READONLY);
    const page = await send('GET', `/console/operations/${op}`, { headers: { Cookie: reader.cookie } });
    expect(page.status).toBe(200);
    expect(page.body).toContain('read-only');
    expect(page.body).toContain('You signed in with the read-only token');
    expect(page.body).not.toContain(`action="/console/operations/${op}/resolve"`);
    expect(page.body).not.toContain(`action="/console/operations/${op}/requeue"`);
    expect(page.body).not.toContain('Sign out everywhere');
    const stuck = await send('GET', '/console/requeue-stuck?older_than_minutes=0', { headers: { Cookie: reader.cookie } });
    expect(stuck.status).toBe(200);
    expect(stuck.body).not.toContain('method="post" action="/console/requeue-stuck"');

    // A forged form, with the session's own CSRF token: the server refuses it all the same.
    for (const [path, fields] of [
      [`/console/operations/${op}/resolve`, { outcome: 'failed', reason: 'a reader tries' }],
      [`/console/operations/${op}/requeue`, {}],
      ['/console/requeue-stuck', { op }],
      ['/console/sign-out-everywhere', {}],
    ] as const) {
      const res = await post(path, reader, fields);
      expect(res.status, path).toBe(403);
      expect(res.body, path).toContain('read-only token');
    }
    expect(await audit()).toEqual([]);
    expect((await operation(t, op)).status).toBe('unknown');
    // Signing out is not an action on anything: a reader may.
    expect((await post('/console/sign-out', reader)).status).toBe(303);
    expect((await send('GET', '/console/', { headers: { Cookie: reader.cookie } })).status).toBe(303);
  });

  it('one list of stuck operations at a time per replica: another asked meanwhile is answered 429', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await waitUntil(async () => (await operation(t, op)).status === 'unknown', 20_000, 'the operation to wait on Stripe');
    // Its job lost: stuck, so the list looks at it.
    await waitUntil(async () => (await operation(t, op)).lease_owner === null, 20_000, 'its lease released');
    await t.pool.query(`delete from pgboss.job where data->>'operationId' = $1`, [op]);
    const reader = await session('rhea', READONLY);
    const holder = await t.pool.connect();
    try {
      // The list's look at this operation waits on its requeue lock.
      await holder.query('begin');
      await holder.query(`select pg_advisory_xact_lock(hashtextextended('outboxd-requeue:' || $1, 0))`, [op]);
      const first = send('GET', '/console/requeue-stuck?older_than_minutes=0', { headers: { Cookie: reader.cookie } });
      await waitUntil(async () => {
        const { rows } = await t.pool.query(`select count(*)::int as n from pg_locks where locktype = 'advisory' and not granted and database = (select oid from pg_database where datname = current_database())`);
        return rows[0].n > 0;
      }, 10_000, 'the first list waits');
      const second = await send('GET', '/console/requeue-stuck?older_than_minutes=0', { headers: { Cookie: reader.cookie } });
      expect(second.status).toBe(429);
      expect(second.body).toContain('try again when it is done');
      await holder.query('commit');
      expect((await first).status).toBe(200);
    } finally {
      holder.release();
    }
  });

  it('a settled operation held for a discrepancy: the admin token acknowledges it in the console, audited; a reader sees no form and is refused', async () => {
    const op = await confirm(t);
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'settled');
    await t.pool.query(`update outboxd.payment_operations set review_reason = E'discrepancy with Stripe: pi_second carries its id\\rand \\'quotes\\' & <marks>' where id = $1`, [op]);
    const form = `action="/console/operations/${op}/acknowledge"`;
    const reader = await session('rosa', READONLY);
    expect((await send('GET', `/console/operations/${op}`, { headers: { Cookie: reader.cookie } })).body).not.toContain(form);
    expect((await post(`/console/operations/${op}/acknowledge`, reader, { note: 'a reader tries' })).status).toBe(403);
    const operator = await session('olivia', TOKEN);
    const page = await send('GET', `/console/operations/${op}`, { headers: { Cookie: operator.cookie } });
    expect(page.body).toContain(form);
    expect(page.body).toContain('pi_second carries its id');
    // As a browser sends the page's hidden field back: entities decoded, each line break (a lone CR here) as CRLF.
    const seen = "discrepancy with Stripe: pi_second carries its id\r\nand 'quotes' & <marks>";
    expect((await post(`/console/operations/${op}/acknowledge`, operator, { note: '', review_reason: seen })).status).toBe(422);
    // A page read before another discrepancy was added: refused, and the new reason shown.
    const stale = await post(`/console/operations/${op}/acknowledge`, operator, { note: 'refunded pi_second', review_reason: 'discrepancy with Stripe: an older one' });
    expect(stale.status).toBe(422);
    expect(stale.body).toContain('changed since it was read');
    const done = await post(`/console/operations/${op}/acknowledge`, operator, { note: 'refunded pi_second', review_reason: seen });
    expect(done.status).toBe(303);
    expect(done.headers.location).toBe(`/console/operations/${op}?done=acknowledged`);
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', needs_review: false });
    expect((await audit()).filter((a) => a.operation_id === op)).toEqual([
      { actor: 'console:olivia', action: 'acknowledge_refused', operation_id: op }, // the stale page
      { actor: 'console:olivia', action: 'acknowledge', operation_id: op },
    ]);
    expect((await send('GET', `/console/operations/${op}`, { headers: { Cookie: operator.cookie } })).body).not.toContain(form);
  });
});

describe('sign-in throttling', () => {
  const wrong = 'not-the-admin-token-0123456789';

  it('answers 429 with Retry-After after a few wrong tokens from one client, the right token too, until the wait is over', async () => {
    const from = '127.0.0.2';
    for (let i = 1; i < SIGN_IN_THROTTLE.limit; i++) expect((await signIn(`guess-${i}`, wrong, from)).status).toBe(401);
    const limited = await signIn('guess-last', wrong, from);
    expect(limited.status).toBe(429);
    expect(Number(limited.headers['retry-after'])).toBeGreaterThan(SIGN_IN_THROTTLE.blockSeconds - 3);
    expect(Number(limited.headers['retry-after'])).toBeLessThanOrEqual(SIGN_IN_THROTTLE.blockSeconds);
    // The right token, from the same client, under another name: refused while the client waits.
    const right = await signIn('alice', TOKEN, from);
    expect(right.status).toBe(429);
    expect(right.headers['set-cookie']).toBeUndefined();
    // Another client is not held up by this one.
    expect((await signIn('alice', TOKEN, '127.0.0.3')).status).toBe(303);
    // Each further wrong token doubles the wait.
    await t.pool.query(`update outboxd.console_sign_in_failures set blocked_until = now() where subject = 'client:127.0.0.2'`);
    const again = await signIn('guess-again', wrong, from);
    expect(again.status).toBe(429);
    expect(Number(again.headers['retry-after'])).toBeGreaterThan(2 * SIGN_IN_THROTTLE.blockSeconds - 3);
    // The wait passes (as if its time had gone by): the right token works again; it clears no count.
    await t.pool.query(`update outboxd.console_sign_in_failures set blocked_until = now() - interval '1 second' where subject = 'client:127.0.0.2'`);
    expect((await signIn('alice', TOKEN, from)).status).toBe(303);
    expect((await t.pool.query(`select failures from outboxd.console_sign_in_failures where subject = 'client:127.0.0.2'`)).rows[0].failures).toBe(SIGN_IN_THROTTLE.limit + 1);
  });

  it('judges simultaneous guesses one at a time: one that finds another under way is refused, none compared past a wait', async () => {
    const from = '127.0.0.4';
    const subject = `client:${from}`;
    await t.pool.query(`insert into outboxd.console_sign_in_failures (subject, failures) values ($1, $2)`, [subject, SIGN_IN_THROTTLE.limit - 1]);
    // A check under way on this client (this test holds its row): every guess meanwhile is refused unread.
    const held = await t.pool.connect();
    try {
      await held.query('begin');
      await held.query('select 1 from outboxd.console_sign_in_failures where subject = $1 for update', [subject]);
      const answers = await Promise.all(Array.from({ length: 10 }, (_, i) => signIn(`burst-${i}`, wrong, from)));
      expect(answers.map((a) => a.status)).toEqual(Array(10).fill(429));
      expect(answers.every((a) => Number(a.headers['retry-after']) >= 1)).toBe(true);
      await held.query('commit');
    } finally {
      held.release();
    }
    expect((await t.pool.query(`select failures from outboxd.console_sign_in_failures where subject = $1`, [subject])).rows[0].failures).toBe(SIGN_IN_THROTTLE.limit - 1);
    // A burst once nobody holds it: never more compares than in a row.
    const answers = await Promise.all(Array.from({ length: 10 }, (_, i) => signIn(`burst-${i}`, wrong, from)));
    expect(answers.filter((a) => a.status === 401)).toEqual([]);
    expect((await t.pool.query(`select failures from outboxd.console_sign_in_failures where subject = $1`, [subject])).rows[0].failures).toBe(SIGN_IN_THROTTLE.limit);
  });

  it('a read-only sign-in resets nothing: guesses at the admin token keep counting', async () => {
    const from = '127.0.0.5';
    for (let round = 0; round < 2; round++) {
      for (let i = 1; i < SIGN_IN_THROTTLE.limit; i++) await signIn(`reader-${round}`, wrong, from);
      expect((await signIn(`reader-${round}`, READONLY, from)).status).toBe(round === 0 ? 303 : 429);
    }
  });

  it('on the admin API too: per client, 429 throttled with Retry-After, the right token refused while it waits', async () => {
    const from = '127.0.0.6';
    const list = (token: string) => send('GET', '/admin/operations?limit=1', { from, headers: bearer(token) });
    for (let i = 1; i < SIGN_IN_THROTTLE.limit; i++) expect((await list(wrong)).status).toBe(403);
    const limited = await list(wrong);
    expect(limited.status).toBe(429);
    expect(JSON.parse(limited.body).error).toBe('throttled');
    expect(Number(limited.headers['retry-after'])).toBeGreaterThan(0);
    expect((await list(TOKEN)).status).toBe(429);
    expect((await send('GET', '/admin/operations?limit=1', { from: '127.0.0.7', headers: bearer(TOKEN) })).status).toBe(200);
    await t.pool.query(`update outboxd.console_sign_in_failures set blocked_until = now() - interval '1 second' where subject = 'client:127.0.0.6'`);
    expect((await list(TOKEN)).status).toBe(200);
  });

  it("on the admin API, requests sent together with the right token are each answered, judged in turn (a script's parallel calls)", async () => {
    const from = '127.0.0.8';
    const answers = await Promise.all(Array.from({ length: 8 }, () => send('GET', '/admin/operations?limit=1', { from, headers: bearer(TOKEN) })));
    expect(answers.map((a) => a.status)).toEqual(Array(8).fill(200));
  });

  it('holds an operator name guessed at from many clients, without holding the clients for other names', async () => {
    for (let i = 1; i <= SIGN_IN_THROTTLE.limit; i++) await signIn('Bob', wrong, `127.0.1.${i}`);
    const res = await signIn('bob', TOKEN, '127.0.1.99');
    expect(res.status).toBe(429);
    expect(res.body).toContain('Too many wrong tokens');
    expect((await signIn('carol', TOKEN, '127.0.1.1')).status).toBe(303);
  });

  it('is logged and counted in /metrics', async () => {
    expect(await replica.metric('outboxd_token_refusals_total{reason="throttled",where="console"}')).toBeGreaterThanOrEqual(3);
    expect(await replica.metric('outboxd_token_refusals_total{reason="wrong_token",where="console"}')).toBeGreaterThanOrEqual(2 * SIGN_IN_THROTTLE.limit);
    expect(await replica.metric('outboxd_token_refusals_total{reason="throttled",where="admin_api"}')).toBeGreaterThanOrEqual(1);
    expect(replica.logs.some((l) => String(l.msg).startsWith('console sign-in refused: too many wrong tokens'))).toBe(true);
  });
});

describe('console sessions', () => {
  /** Seconds until the operator's session ends. */
  const expiresIn = async (operator: string) => {
    const { rows } = await t.pool.query(`select extract(epoch from expires_at - now())::float8 as s from outboxd.console_sessions where operator = $1`, [operator]);
    return rows[0].s as number;
  };

  it('end after idling CONSOLE_IDLE_MINUTES; every page view moves the end on, never past 8 hours from sign-in', async () => {
    const s = await session('idle-ida', TOKEN);
    expect(await expiresIn('idle-ida')).toBeGreaterThan(4 * 60);
    expect(await expiresIn('idle-ida')).toBeLessThanOrEqual(5 * 60);
    // Nearly idle for long enough: a page view gives it its five minutes again.
    await t.pool.query(`update outboxd.console_sessions set expires_at = now() + interval '5 seconds' where operator = 'idle-ida'`);
    expect((await send('GET', '/console/review', { headers: { Cookie: s.cookie } })).status).toBe(200);
    expect(await expiresIn('idle-ida')).toBeGreaterThan(4 * 60);
    // Idle past its end: gone.
    await t.pool.query(`update outboxd.console_sessions set expires_at = now() - interval '1 second' where operator = 'idle-ida'`);
    expect((await send('GET', '/console/review', { headers: { Cookie: s.cookie } })).status).toBe(303);
    // Busy all day: it ends 8 hours after sign-in all the same.
    const busy = await session('busy-bea', TOKEN);
    await t.pool.query(`update outboxd.console_sessions set created_at = now() - interval '8 hours' + interval '1 minute' where operator = 'busy-bea'`);
    expect((await send('GET', '/console/review', { headers: { Cookie: busy.cookie } })).status).toBe(200);
    expect(await expiresIn('busy-bea')).toBeLessThanOrEqual(60);
    await t.pool.query(`update outboxd.console_sessions set created_at = now() - interval '8 hours' where operator = 'busy-bea'`);
    expect((await send('GET', '/console/review', { headers: { Cookie: busy.cookie } })).status).toBe(303);
  });

  it('"sign out everywhere" ends every session, every operator\'s, and is audited', async () => {
    const mine = await session('olga', TOKEN);
    const theirs = await session('pete', TOKEN);
    const reader = await session('rita', READONLY);
    const res = await post('/console/sign-out-everywhere', mine);
    expect(res.status).toBe(303);
    expect(res.headers.location).toBe('/console/sign-in?signed_out=1');
    for (const s of [mine, theirs, reader]) expect((await send('GET', '/console/', { headers: { Cookie: s.cookie } })).status).toBe(303);
    expect((await audit()).filter((a) => a.action === 'sign-out-everywhere')).toEqual([{ actor: 'console:olga', action: 'sign-out-everywhere', operation_id: null }]);
  });
});
