// The operator console under /console/, served beside the admin API (same listener, same rule: only
// with ADMIN_TOKEN or ADMIN_READONLY_TOKEN set, on ADMIN_HTTP_PORT when that is set). Server-rendered HTML; a small script only
// adds keyboard shortcuts. Without a session nothing but the sign-in page and the static assets is
// served: every data page redirects to sign-in, every action answers 401. Every action also needs the
// session's CSRF token and a same-site request, and is audited as `console:<operator>`.
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { ServerResponse } from 'node:http';
import { NO_EVIDENCE, type AdminDeps } from '../http/admin.ts';
import { accessTokens, checkToken, tokenSubjects } from '../http/tokens.ts';
import { recordAudit } from '../admin/audit.ts';
import { inTransaction } from '../db/pool.ts';
import { HttpError, readBody, type Request, type Route } from '../http/server.ts';
import { requeueOperation, requeueStuck } from '../admin/requeue.ts';
import { acknowledgeOperation } from '../admin/acknowledge.ts';
import { ResolutionRefused, resolveOperation, type Resolution } from '../admin/resolve.ts';
import { ValidationError } from '../types/errors.ts';
import { isOperationId, OperationNotFoundError, shortOperationId } from '../engine/operation.ts';
import { driftReport } from '../reconcile/drift.ts';
import { span, type Fragment } from './html.ts';
import { layout, notice, type Assets, type Frame, type Section } from './views/layout.ts';
import { operationPage, type ActionState } from './views/operation.ts';
import {
  DEFAULT_PAGE,
  DRIFT_WINDOWS,
  driftPage,
  errorPage,
  listPage as listView,
  overviewPage,
  reviewPage,
  searchPage,
  signInPage,
  stuckPage,
} from './views/pages.ts';
import { listPage, operationKinds, operationRecord, overview, overviewCharts, overviewFigures, parseCursor, reviewQueue, search, sharedFor, STATUSES } from './queries.ts';
import {
  clearedCookie,
  crossSite,
  csrfMatches,
  endAllSessions,
  endSession,
  isHttps,
  parseOperatorName,
  sessionOf,
  startSession,
  type Session,
} from './session.ts';
import { timeline } from './timeline.ts';

/** No script or style but our own files, no framing, no form posting anywhere else. */
const CSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";
const SECURITY_HEADERS: Record<string, string> = {
  'Content-Security-Policy': CSP,
  'X-Frame-Options': 'DENY',
  'X-Content-Type-Options': 'nosniff',
  'Referrer-Policy': 'no-referrer',
  'Cross-Origin-Opener-Policy': 'same-origin',
  'Cross-Origin-Resource-Policy': 'same-origin',
};

interface Asset {
  path: string;
  type: string;
  body: Buffer;
}

/** The stylesheet and script, named by their content's hash so they can be cached for good. */
function loadAssets(): { assets: Assets; byPath: Map<string, Asset> } {
  const load = (file: string, ext: string, type: string): Asset => {
    const body = readFileSync(new URL(`./assets/${file}`, import.meta.url));
    const hash = createHash('sha256').update(body).digest('hex').slice(0, 12);
    return { path: `/console/assets/console-${hash}.${ext}`, type, body };
  };
  const css = load('console.css', 'css', 'text/css; charset=utf-8');
  const js = load('console.js', 'js', 'text/javascript; charset=utf-8');
  return { assets: { css: css.path, js: js.path }, byPath: new Map([css, js].map((a) => [a.path, a])) };
}

const FORM_LIMIT = 128 * 1024;
/** The notices a redirect may ask for: fixed texts, so nothing in a URL is ever echoed as a message. */
const DONE: Record<string, string> = {
  resolved: 'Resolved. The audit trail records it under your name.',
  requeued: 'Requeued: a new job drives this operation, with the same idempotency key.',
  acknowledged: 'Acknowledged: no longer held for review. The audit trail records it under your name.',
};

export function consoleRoutes(deps: AdminDeps): Route[] {
  const tokens = accessTokens(deps.config);
  if (tokens.length === 0) return [];
  const { pool, boss, gateway, log, config } = deps;
  const times = { idleSeconds: config.admin.consoleIdleSeconds };
  const { assets, byPath } = loadAssets();
  const resolveOptions = { leaseTtlMs: config.worker.leaseTtlMs, searchFreshnessSeconds: config.searchFreshnessSeconds };
  // Links to Stripe's dashboard only when the gateway is Stripe itself.
  const key = config.stripe.secretKey;
  const dashboard = key && !config.stripe.apiBase ? `https://dashboard.stripe.com${/^[sr]k_test_/.test(key) ? '/test' : ''}` : undefined;
  const actorOf = (s: Session) => `console:${s.operator}`;
  /** The forms' token for a session that may act; none for a read-only one (its pages show no form). */
  const formToken = (s: Session) => (s.access === 'act' ? s.csrfToken : undefined);

  function send(res: ServerResponse, status: number, body: string, headers: Record<string, string> = {}): void {
    res.writeHead(status, {
      ...SECURITY_HEADERS,
      'Content-Type': 'text/html; charset=utf-8',
      'Cache-Control': 'no-store',
      'Content-Length': String(Buffer.byteLength(body)),
      ...headers,
    });
    res.end(body);
  }

  function redirect(res: ServerResponse, location: string, headers: Record<string, string> = {}): void {
    res.writeHead(303, { ...SECURITY_HEADERS, Location: location, 'Cache-Control': 'no-store', 'Content-Length': '0', ...headers });
    res.end();
  }

  async function frame(session: Session | undefined, title: string, section: Section, query?: string): Promise<Frame> {
    const reviewCount = session ? (await pool.query(pool.sql.reviewCount())).rows[0].n : 0;
    return { title, assets, session, section, reviewCount, ...(query !== undefined ? { query } : {}) };
  }

  async function page(res: ServerResponse, status: number, session: Session | undefined, title: string, section: Section, body: Fragment, query?: string) {
    send(res, status, layout(await frame(session, title, section, query), body).markup);
  }

  /** An error as a page: its text for a signed-in operator (as the admin API shows it), nothing otherwise.
   * A client gone, or a body over the limit (answered by closing the connection), is the server's to answer. */
  async function failed(r: Request, session: Session | undefined, err: unknown): Promise<void> {
    if (r.req.socket?.destroyed !== false || (err instanceof HttpError && err.status === 413)) throw err;
    const status = err instanceof HttpError ? err.status
      : err instanceof OperationNotFoundError ? 404
      : err instanceof ValidationError ? 422
      : 500;
    if (status >= 500) log.error({ err, path: r.url.pathname }, 'console page failed');
    if (r.res.headersSent) return void r.res.destroy();
    const message = session || status < 500 ? (err as Error).message : 'internal error';
    await page(r.res, status, session, 'Error', 'none', errorPage(status, message)).catch(() => send(r.res, status, message));
  }

  /** A page that shows operation data: a session or the sign-in page. */
  const view =
    (handler: (r: Request, session: Session) => Promise<void>) =>
    async (r: Request): Promise<void> => {
      const session = await sessionOf(pool, tokens, r.req, times);
      if (!session) return redirect(r.res, `/console/sign-in?next=${encodeURIComponent(r.url.pathname + r.url.search)}`);
      try {
        await handler(r, session);
      } catch (err) {
        await failed(r, session, err);
      }
    };

  /** A form that changes something: a session that may act (`read` only for signing out), a same-site
   * request and the session's CSRF token. */
  const action =
    (handler: (r: Request, session: Session, form: URLSearchParams) => Promise<void>, needs: 'act' | 'read' = 'act') =>
    async (r: Request): Promise<void> => {
      const session = await sessionOf(pool, tokens, r.req, times);
      if (!session) return page(r.res, 401, undefined, 'Sign in', 'none', errorPage(401, 'No session: sign in, then try again.'));
      try {
        if (crossSite(r.req)) throw new HttpError(403, 'forbidden', 'a request from another site may not change anything here');
        if (needs === 'act' && session.access === 'read') {
          log.warn({ operator: session.operator, path: r.url.pathname }, 'console action refused: read-only session');
          throw new HttpError(403, 'read_only', 'you signed in with the read-only token: it may look at everything and change nothing');
        }
        const form = await readForm(r);
        if (!csrfMatches(session, form.get('csrf'))) {
          log.warn({ operator: session.operator, path: r.url.pathname }, 'console action refused: CSRF token missing or wrong');
          throw new HttpError(403, 'forbidden', "the form's security token is missing or stale: reload the page and try again");
        }
        await handler(r, session, form);
      } catch (err) {
        await failed(r, session, err);
      }
    };

  async function readForm(r: Request): Promise<URLSearchParams> {
    if (!String(r.req.headers['content-type'] ?? '').startsWith('application/x-www-form-urlencoded')) {
      throw new HttpError(415, 'unsupported', 'a form (application/x-www-form-urlencoded) is expected');
    }
    return new URLSearchParams((await readBody(r.req, FORM_LIMIT)).toString('utf8'));
  }

  // ─── sign-in and sign-out ──────────────────────────────────────────────────────────────────────────

  /** Where to go after signing in: a console page, never elsewhere. */
  const safeNext = (next: string | null) => (next && /^\/console\/[\w\-./?=&%~+]*$/.test(next) && !next.includes('//') ? next : undefined);

  async function signInForm({ url, req, res }: Request): Promise<void> {
    if (await sessionOf(pool, tokens, req, times)) return redirect(res, '/console/');
    const signedOut = url.searchParams.get('signed_out') === '1';
    const body = signInPage({ next: safeNext(url.searchParams.get('next')) });
    await page(res, 200, undefined, 'Sign in', 'none', signedOut ? [notice('done', 'Signed out.'), body] : body);
  }

  async function signIn(r: Request): Promise<void> {
    try {
      if (crossSite(r.req)) throw new HttpError(403, 'forbidden', 'sign in from the console itself');
      const form = await readForm(r);
      const next = safeNext(form.get('next'));
      const name = parseOperatorName(form.get('operator') ?? '');
      const token = form.get('token') ?? '';
      if (!name) {
        return page(r.res, 422, undefined, 'Sign in', 'none', signInPage({ error: 'Give your name: 1 to 64 printable characters.', next }));
      }
      // While the client or the name waits, no token is looked at: the right one is refused too.
      const check = await checkToken(pool, tokenSubjects(r.req, name), token, tokens);
      if ('refused' in check) {
        deps.metrics?.tokenRefusals.inc({ reason: check.refused, where: 'console' });
        const client = r.req.socket.remoteAddress;
        if (check.refused === 'throttled') log.warn({ operator: name, client, waitSeconds: check.wait }, 'console sign-in refused: too many wrong tokens, waiting');
        else log.warn({ operator: name, client, waitSeconds: check.wait }, 'console sign-in refused: wrong admin token');
        if (check.wait > 0) {
          const error = `Too many wrong tokens from here or for this name: try again in ${span(check.wait)}.`;
          const body = layout(await frame(undefined, 'Sign in', 'none'), signInPage({ error, name, next })).markup;
          return send(r.res, 429, body, { 'Retry-After': String(check.wait) });
        }
        return page(r.res, 401, undefined, 'Sign in', 'none', signInPage({ error: 'The admin token is not accepted.', name, next }));
      }
      const access = check.access;
      const signedInWith = tokens.find(([, a]) => a === access)!;
      const { cookie } = await startSession(pool, signedInWith, name, isHttps(r.req), times);
      log.info({ operator: name, access }, 'console sign-in');
      redirect(r.res, next ?? '/console/', { 'Set-Cookie': cookie });
    } catch (err) {
      await failed(r, undefined, err);
    }
  }

  /** Ends every console session, this one included; audited, as every action is. */
  async function signOutEverywhere({ req, res }: Request, session: Session): Promise<void> {
    const ended = await inTransaction(pool, async (tx) => {
      const n = await endAllSessions(tx);
      await recordAudit(tx, { actor: actorOf(session), action: 'sign-out-everywhere', operationId: null, details: { sessions: n } });
      return n;
    });
    log.info({ operator: session.operator, sessions: ended }, 'console: every session ended');
    redirect(res, '/console/sign-in?signed_out=1', { 'Set-Cookie': clearedCookie(isHttps(req)) });
  }

  async function signOut({ req, res }: Request, session: Session): Promise<void> {
    await endSession(pool, session);
    log.info({ operator: session.operator }, 'console sign-out');
    redirect(res, '/console/sign-in?signed_out=1', { 'Set-Cookie': clearedCookie(isHttps(req)) });
  }

  // ─── pages ───────────────────────────────────────────────────────────────────────────────────────

  // The charts read the last hours of the fleet's work, the figures a day of its settlements: each shared
  // by every view of this replica for a while. The rest of the overview (the review queue, the latest
  // settlements) is read for each view, so that what a person just did shows.
  const currentCharts = sharedFor(30_000, (now) => overviewCharts(pool, now));
  const currentFigures = sharedFor(10_000, () => overviewFigures(pool));

  async function overviewView({ res }: Request, session: Session): Promise<void> {
    const now = new Date();
    const [figures, drawn] = await Promise.all([overview(pool, boss, deps.config.stripe, currentFigures(now)), currentCharts(now)]);
    await page(res, 200, session, 'Overview', 'overview', overviewPage(figures, now, drawn));
  }

  const REVIEW_LIMIT = 500;
  async function reviewView({ res }: Request, session: Session): Promise<void> {
    await page(res, 200, session, 'Review queue', 'review', reviewPage(await reviewQueue(pool, REVIEW_LIMIT), REVIEW_LIMIT, new Date()));
  }

  async function listOperationsView({ url, res }: Request, session: Session): Promise<void> {
    const q = url.searchParams;
    const kinds = await operationKinds(pool);
    const status = q.get('status') || undefined;
    const kind = q.get('kind') || undefined;
    if (status && !STATUSES.includes(status)) throw new HttpError(422, 'invalid_input', `status must be one of ${STATUSES.join(', ')}`);
    if (kind && !/^[a-z][a-z0-9_.-]{0,63}$/.test(kind)) throw new HttpError(422, 'invalid_input', 'kind must be a kind name');
    const size = Math.min(Math.max(Math.floor(Number(q.get('size'))) || DEFAULT_PAGE, 5), 500);
    const filter = { status, kind, needsReview: q.get('review') === '1' };
    const cursor = parseCursor('before', q.get('before')) ?? parseCursor('after', q.get('after'));
    if ((q.has('before') || q.has('after')) && !cursor) throw new HttpError(422, 'invalid_input', 'the page cursor is malformed');
    let result = await listPage(pool, filter, size, cursor, kinds);
    // A short page of newer rows is the newest page: show it whole.
    if (cursor?.direction === 'after' && !result.newer && result.rows.length < size) result = await listPage(pool, filter, size, undefined, kinds);
    await page(res, 200, session, 'Operations', 'operations', listView(result, filter, kinds, STATUSES, size, new Date(), dashboard));
  }

  async function renderOperation(res: ServerResponse, session: Session, id: string, status: number, state: ActionState): Promise<void> {
    const { rows } = await pool.query(pool.sql.showOperation(id));
    if (!rows[0]) throw new OperationNotFoundError(id);
    const op = rows[0];
    const now = new Date();
    const record = await operationRecord(pool, op);
    const body = operationPage(op, record, timeline(op, record, now), state, { csrfToken: formToken(session), now, dashboard });
    await page(res, status, session, `Operation ${shortOperationId(op.id)}`, 'operations', body);
  }

  /** A full operation id; anything else is looked up by the search page. */
  function operationId(r: Request): string {
    const id = r.params[0]!.toLowerCase();
    if (!isOperationId(id)) throw new HttpError(404, 'not_found', `not an operation id: ${r.params[0]}; search for it instead`);
    return id;
  }

  async function operationView(r: Request, session: Session): Promise<void> {
    const id = r.params[0]!;
    if (!isOperationId(id)) return redirect(r.res, `/console/search?q=${encodeURIComponent(id)}`);
    const done = DONE[r.url.searchParams.get('done') ?? ''];
    await renderOperation(r.res, session, operationId(r), 200, done ? { notice: { kind: 'done', text: done } } : {});
  }

  async function resolveAction(r: Request, session: Session, form: URLSearchParams): Promise<void> {
    const id = operationId(r);
    const outcome = form.get('outcome');
    const externalId = (form.get('external_id') ?? '').trim();
    const reason = (form.get('reason') ?? '').trim();
    const kept = { externalId, reason };
    let resolution: Resolution;
    if (outcome === 'succeeded') {
      // What it must name depends on the kind (a pi_, a re_, or an application's own reference):
      // resolveOperation checks it and its refusal is shown like any other.
      if (!externalId || externalId.length > 255) {
        return renderOperation(r.res, session, id, 422, { ...kept, notice: { kind: 'refused', text: 'Name what carried it out: pi_… for a charge, re_… (or pyr_…) for a refund, your own reference for an effect of your application.' } });
      }
      resolution = { outcome, externalId };
    } else if (outcome === 'failed') {
      if (!reason || reason.length > 1000) {
        return renderOperation(r.res, session, id, 422, { ...kept, notice: { kind: 'refused', text: 'Say why nothing was charged (1 to 1000 characters).' } });
      }
      resolution = { outcome, reason };
    } else {
      throw new HttpError(422, 'invalid_input', 'outcome must be succeeded or failed');
    }
    if (!gateway) return renderOperation(r.res, session, id, 409, { ...kept, notice: { kind: 'refused', text: NO_EVIDENCE } });
    try {
      // The reason as the page showed it (none: empty): one added since is refused, and shown.
      const seen = form.get('review_reason');
      await resolveOperation(pool, gateway, id, resolution, actorOf(session), { ...resolveOptions, reviewReasonSeen: seen === null ? undefined : seen || null });
    } catch (err) {
      if (!(err instanceof ResolutionRefused || err instanceof ValidationError)) throw err;
      log.info({ operator: session.operator, operationId: id, outcome, refused: err.message }, 'console resolution refused');
      return renderOperation(r.res, session, id, 422, { ...kept, notice: { kind: 'refused', text: err.message } });
    }
    log.info({ operator: session.operator, operationId: id, outcome }, 'console resolution');
    redirect(r.res, `/console/operations/${id}?done=resolved`);
  }

  async function acknowledgeAction(r: Request, session: Session, form: URLSearchParams): Promise<void> {
    const id = operationId(r);
    const note = (form.get('note') ?? '').trim();
    try {
      // The reason as the page showed it: one added since is refused, and shown.
      await acknowledgeOperation(pool, id, note, actorOf(session), form.get('review_reason') ?? '');
    } catch (err) {
      if (!(err instanceof ResolutionRefused || err instanceof ValidationError)) throw err;
      return renderOperation(r.res, session, id, 422, { note, notice: { kind: 'refused', text: err instanceof ValidationError ? err.detail : err.message } });
    }
    log.info({ operator: session.operator, operationId: id }, 'console acknowledgement');
    redirect(r.res, `/console/operations/${id}?done=acknowledged`);
  }

  async function requeueAction(r: Request, session: Session): Promise<void> {
    const id = operationId(r);
    const result = await requeueOperation(pool, boss, id, { actor: actorOf(session) });
    if (result.result === 'requeued') return redirect(r.res, `/console/operations/${id}?done=requeued`);
    const why = 'reason' in result ? result.reason : result.result;
    await renderOperation(r.res, session, id, 409, { notice: { kind: 'refused', text: `Not requeued: ${why}.` } });
  }

  async function searchView({ url, res }: Request, session: Session): Promise<void> {
    const q = url.searchParams.get('q') ?? '';
    const result = await search(pool, q);
    if (result.matches.length === 1) return redirect(res, `/console/operations/${result.matches[0]!.id}`);
    await page(res, 200, session, 'Search', 'search', searchPage(result, new Date(), dashboard), result.query);
  }

  const MAX_MINUTES = 30 * 24 * 60;
  /** One requeue-stuck list at a time per replica: it looks for each operation's live job, up to 1,000
   * of them, a transaction each, and a read-only session may ask for it. */
  let stuckListing = false;
  async function stuckView({ url, res }: Request, session: Session): Promise<void> {
    const raw = url.searchParams.get('older_than_minutes');
    const minutes = raw === null ? 10 : Number(raw);
    if (!Number.isInteger(minutes) || minutes < 0 || minutes > MAX_MINUTES) throw new HttpError(422, 'invalid_input', `minutes must be a whole number from 0 to ${MAX_MINUTES}`);
    let dryRun;
    if (raw !== null) {
      if (stuckListing) throw new HttpError(429, 'busy', 'a list of stuck operations is being made on this replica: try again when it is done');
      stuckListing = true;
      try {
        dryRun = await requeueStuck(pool, boss, { actor: actorOf(session), olderThanSeconds: minutes * 60, dryRun: true });
      } finally {
        stuckListing = false;
      }
    }
    await page(res, 200, session, 'Requeue stuck', 'stuck', stuckPage({ olderThanMinutes: minutes, dryRun, done: undefined, csrfToken: formToken(session) }));
  }

  async function stuckAction({ res }: Request, session: Session, form: URLSearchParams): Promise<void> {
    const ids = form.getAll('op');
    if (ids.length > 1000 || !ids.every(isOperationId)) throw new HttpError(422, 'invalid_input', 'at most 1000 operation ids');
    const done = [];
    for (const id of ids) done.push(await requeueOperation(pool, boss, id.toLowerCase(), { actor: actorOf(session) }));
    log.info({ operator: session.operator, requeued: done.filter((d) => d.result === 'requeued').length, asked: ids.length }, 'console requeue of stuck operations');
    await page(res, 200, session, 'Requeue stuck', 'stuck', stuckPage({ olderThanMinutes: 10, dryRun: undefined, done, csrfToken: session.csrfToken }));
  }

  let driftRunning = false;
  async function driftView({ url, res }: Request, session: Session): Promise<void> {
    const hours = Number(url.searchParams.get('hours') ?? 24);
    if (!DRIFT_WINDOWS.some(([h]) => h === hours)) throw new HttpError(422, 'invalid_input', 'choose one of the periods offered');
    const run = url.searchParams.get('run') === '1';
    if (run && !gateway) throw new HttpError(409, 'no_evidence', NO_EVIDENCE);
    // One run at a time per replica: a run lists Stripe's charges of the period through the shared budget.
    if (run && driftRunning) throw new HttpError(429, 'busy', 'a drift report is running on this replica: try again when it is done');
    let report;
    if (run) {
      driftRunning = true;
      try {
        report = await driftReport(pool, gateway!, new Date(Date.now() - hours * 3_600_000));
      } finally {
        driftRunning = false;
      }
    }
    await page(res, 200, session, 'Drift report', 'drift', driftPage({ hours, report }));
  }

  function assetView({ url, res }: Request): void {
    const asset = byPath.get(url.pathname);
    if (!asset) throw new HttpError(404, 'not_found', 'no such asset');
    res.writeHead(200, {
      'Content-Type': asset.type,
      'Content-Length': String(asset.body.length),
      'Cache-Control': 'public, max-age=31536000, immutable',
      'X-Content-Type-Options': 'nosniff',
      'Cross-Origin-Resource-Policy': 'same-origin',
    });
    res.end(asset.body);
  }

  async function notFoundView(r: Request, session: Session): Promise<void> {
    await page(r.res, 404, session, 'Not found', 'none', errorPage(404, `no console page ${r.url.pathname}`));
  }

  const OP = /^\/console\/operations\/([^/]+)$/;
  return [
    ['GET', '/console', ({ res }) => redirect(res, '/console/')],
    ['GET', '/console/sign-in', signInForm],
    ['POST', '/console/sign-in', signIn],
    ['POST', '/console/sign-out', action(signOut, 'read')],
    ['POST', '/console/sign-out-everywhere', action(signOutEverywhere)],
    ['GET', /^\/console\/assets\/[\w.-]+$/, assetView],
    ['GET', '/console/', view(overviewView)],
    ['GET', '/console/review', view(reviewView)],
    ['GET', '/console/operations', view(listOperationsView)],
    ['GET', OP, view(operationView)],
    ['POST', /^\/console\/operations\/([^/]+)\/resolve$/, action(resolveAction)],
    ['POST', /^\/console\/operations\/([^/]+)\/requeue$/, action(requeueAction)],
    ['POST', /^\/console\/operations\/([^/]+)\/acknowledge$/, action(acknowledgeAction)],
    ['GET', '/console/search', view(searchView)],
    ['GET', '/console/requeue-stuck', view(stuckView)],
    ['POST', '/console/requeue-stuck', action(stuckAction)],
    ['GET', '/console/drift', view(driftView)],
    ['GET', /^\/console\/.*$/, view(notFoundView)],
  ];
}
