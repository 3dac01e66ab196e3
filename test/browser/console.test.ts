// The operator console in a real browser (Debian's chromium through playwright-core) against a real
// worker process: its own admin listener, the Stripe emulator, a test database. Sign-in; the review
// queue to an operation; a resolution refused twice (the search horizon, another operation's charge),
// then accepted; requeue; requeue of stuck operations after a dry run; lists with keyset pages; search;
// the drift report; forged and session-less requests that change nothing and show nothing.
// Each page is saved to test/screenshots/ (gitignored).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { inTransaction } from '../../src/db/pool.ts';
import { shortOperationId } from '../../src/engine/operation.ts';
import { requestCharge } from '../../src/kinds/charge/request.ts';
import { requestCapture } from '../../src/kinds/hold/request.ts';
import { EMULATOR_KEY } from '../../src/runtime/open.ts';
import { endSession, parseOperatorName, sessionOf, startSession } from '../../src/console/session.ts';
import type { IncomingMessage } from 'node:http';
import { startReplica, waitUntil, type Replica } from '../../harness/replica.ts';
import { launchBrowser, type Browser } from '../support/browser.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm, operation, orderInput } from '../support/fixtures.ts';

const TOKEN = 'console-test-admin-token-0123';
let t: TestDb;
let e: RunningEmulator;
let replica: Replica;
let b: Browser;
let base: string;
let mainBase: string;

/** Operations the flows below work on. */
const ops = { paid: '', declined: '', misuse: '', misuse2: '', misusePi: '', hold: '', held: '' };

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  replica = await startReplica({
    DATABASE_URL: t.url,
    STRIPE_API_BASE: e.url,
    ADMIN_TOKEN: TOKEN,
    ADMIN_HTTP_PORT: '0',
    HTTP_HOST: '127.0.0.1',
    WORKER_CONCURRENCY: '2',
    // The sweep (every 5 minutes by default) would settle the operations held for review here, through
    // the charge their key's earlier request made, whenever this file's run spans a 5-minute mark.
    RECONCILE_CRON: '0 0 1 1 *',
  });
  const ready = replica.logs.find((l) => l.msg === 'worker ready') as { adminHttpPort: number };
  base = `http://127.0.0.1:${ready.adminHttpPort}`;
  mainBase = `http://127.0.0.1:${replica.port}`;
  b = await launchBrowser();
});
afterAll(async () => {
  await b?.close();
  if (replica) {
    replica.kill('SIGTERM');
    await replica.exited;
  }
  await Promise.all([t?.close(), e?.close()]);
});

/** A charge whose idempotency key was already used with other parameters (a deploy with a key bug):
 * the worker's create gets 400 idempotency_error and the operation is held for review at once. The
 * earlier request did charge: a PaymentIntent for this operation's amount that succeeded. */
async function keyMisuse(): Promise<{ op: string; pi: string }> {
  const stripe = e.client({ secretKey: EMULATOR_KEY }); // the worker's key: the emulator keys idempotency per account
  let pi = '';
  const op = await inTransaction(t.pool, async (tx) => {
    const { operationId } = await requestCharge(tx, orderInput());
    const earlier = await stripe.paymentIntents.create(
      { amount: 2599, currency: 'eur', customer: 'cus_other_deploy', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: operationId } },
      { idempotencyKey: `payment-op:${operationId}` },
    );
    pi = earlier.id;
    return operationId;
  });
  return { op, pi };
}

const audit = async (op: string) => (await t.pool.query(`select actor, action from outboxd.admin_audit where operation_id = $1 order by id`, [op])).rows;

/** Held for review by the dead-letter handler, its lease given back: nothing drives it any more. */
async function settledIntoReview(op: string, flags = 1): Promise<void> {
  // The same flag again counts on its row (repeats).
  const flagged = async () => Number((await t.pool.query(`select coalesce(sum(repeats), 0) as n from outboxd.operation_events where operation_id = $1 and type = 'flagged'`, [op])).rows[0].n);
  await waitUntil(async () => (await flagged()) >= flags && (await operation(t, op)).lease_owner === null, 20_000, `operation ${op} held for review`);
}

describe('the console in a browser', () => {
  it('has its data: a paid, a declined and two operations held for review', async () => {
    ops.paid = await confirm(t, { orderId: 'ord_console_paid' });
    ops.declined = await confirm(t, { paymentMethod: 'pm_card_chargeDeclined' });
    const misuse = await keyMisuse();
    ops.misuse = misuse.op;
    ops.misusePi = misuse.pi;
    ops.misuse2 = (await keyMisuse()).op;
    await waitUntil(async () => (await operation(t, ops.paid)).status === 'succeeded' && (await operation(t, ops.declined)).status === 'failed', 20_000, 'settled');
    await settledIntoReview(ops.misuse);
    await settledIntoReview(ops.misuse2);
    // Authorizations on a connected account: one captured in part, one still held.
    ops.held = await confirm(t, { captureMethod: 'manual', stripeAccount: 'acct_1BrowserShop' });
    ops.hold = await confirm(t, { captureMethod: 'manual', stripeAccount: 'acct_1BrowserShop' });
    await waitUntil(async () => (await operation(t, ops.hold)).status === 'succeeded' && (await operation(t, ops.held)).status === 'succeeded', 20_000, 'the holds');
    const { operationId: captured } = await inTransaction(t.pool, (tx) => requestCapture(tx, { chargeOperationId: ops.hold, key: 'shipped', amount: 2000 }));
    await waitUntil(async () => (await operation(t, captured)).status === 'succeeded', 20_000, 'the capture');
  });

  it('shows nothing without a session: pages redirect to sign-in, actions answer 401 and change nothing', async () => {
    const pages = ['/console/', '/console/review', '/console/operations', `/console/operations/${ops.misuse}`, `/console/search?q=${ops.paid}`,
      '/console/requeue-stuck?older_than_minutes=0', '/console/drift?hours=24&run=1', '/console/anything'];
    for (const path of pages) {
      for (const cookie of [undefined, 'outboxd_console=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA']) {
        const res = await fetch(`${base}${path}`, { redirect: 'manual', headers: cookie ? { Cookie: cookie } : {} });
        expect(res.status, path).toBe(303);
        expect(res.headers.get('location')).toBe(`/console/sign-in?next=${encodeURIComponent(path)}`);
        expect(await res.text()).toBe('');
      }
    }
    const posts = [`/console/operations/${ops.misuse}/resolve`, `/console/operations/${ops.misuse2}/requeue`, '/console/requeue-stuck', '/console/sign-out'];
    for (const path of posts) {
      const res = await fetch(`${base}${path}`, { method: 'POST', headers: { 'Content-Type': 'application/x-www-form-urlencoded' }, body: `outcome=succeeded&external_id=${ops.misusePi}&op=${ops.misuse2}` });
      expect(res.status, path).toBe(401);
      const text = await res.text();
      for (const id of Object.values(ops)) expect(text).not.toContain(id);
    }
    expect((await operation(t, ops.misuse)).status).toBe('unknown');
    expect(await audit(ops.misuse)).toEqual([]);
    expect(await audit(ops.misuse2)).toEqual([]);
    // The console lives on the admin listener only.
    expect((await fetch(`${mainBase}/console/sign-in`)).status).toBe(404);
  });

  it('signs in: a wrong token is refused, then a session cookie that is HttpOnly, SameSite=Strict, scoped and expiring', async () => {
    const { page } = b;
    await page.goto(`${base}/console/review`);
    expect(new URL(page.url()).pathname).toBe('/console/sign-in');
    await page.getByLabel('Your name').fill('alice');
    await page.getByLabel('Admin token').fill('not-the-token-at-all');
    await page.getByRole('button', { name: 'Sign in' }).click();
    await expect.poll(() => page.getByRole('alert').textContent()).toContain('The admin token is not accepted.');
    expect(await page.getByLabel('Your name').inputValue()).toBe('alice');
    await b.shot('sign-in-refused');

    await page.getByLabel('Admin token').fill(TOKEN);
    await page.getByRole('button', { name: 'Sign in' }).click();
    await page.waitForURL(`${base}/console/review`); // back where the redirect came from
    const [cookie] = await b.context.cookies(`${base}/console/`);
    expect(cookie).toMatchObject({ name: 'outboxd_console', path: '/console', httpOnly: true, sameSite: 'Strict' });
    expect(cookie!.expires * 1000 - Date.now()).toBeGreaterThan(7.9 * 3600_000);
    expect(cookie!.expires * 1000 - Date.now()).toBeLessThanOrEqual(8 * 3600_000);
  });

  it('sends a strict CSP, refuses framing and caching on data pages', async () => {
    const res = await b.page.request.get(`${base}/console/`);
    expect(res.status()).toBe(200);
    const h = res.headers();
    expect(h['content-security-policy']).toContain("default-src 'none'");
    expect(h['content-security-policy']).toContain("frame-ancestors 'none'");
    expect(h['content-security-policy']).not.toContain('unsafe-inline');
    expect(h['x-frame-options']).toBe('DENY');
    expect(h['cache-control']).toBe('no-store');
    expect(h['x-content-type-options']).toBe('nosniff');
  });

  it('overview: counts, the review queue, recent settlements', async () => {
    const { page } = b;
    // Each look loads the page again: a page once drawn never changes, so polling it alone would only
    // wait on what the first load showed (and, on a loaded machine, say nothing of what it was).
    const card = async (title: string) => {
      await page.goto(`${base}/console/`);
      const found = page.locator('.card', { has: page.locator('.card-label', { hasText: new RegExp(`^${title}$`) }) });
      return found.locator('.card-value').textContent();
    };
    await expect.poll(() => card('Needs review')).toBe('2');
    await expect.poll(() => card('Stripe budget')).toBe('not limited');
    expect(await page.locator('section', { hasText: 'Recent settlements' }).textContent()).toContain(shortOperationId(ops.paid));
    await b.shot('overview');
  });

  it('overview charts: drawn from the data, within the CSP; no section overlaps another from 1024 to 1920 px', async () => {
    const page = await b.context.newPage();
    const refused: string[] = [];
    page.on('console', (m) => {
      if (/Content Security Policy|Refused/.test(m.text())) refused.push(m.text());
    });
    for (const width of [1024, 1280, 1440, 1920]) {
      await page.setViewportSize({ width, height: 900 });
      await page.goto(`${base}/console/`);
      const charts = page.locator('figure.chart');
      await expect.poll(() => charts.count()).toBe(4);
      const settled = charts.filter({ hasText: 'Settlements per minute' });
      expect(await settled.locator('rect.s-good').count()).toBeGreaterThan(0); // the paid charge
      expect(await settled.locator('rect.s-bad').count()).toBeGreaterThan(0); // the declined one
      expect(await charts.filter({ hasText: 'Confirm → settled' }).locator('path.line').count()).toBe(2);
      expect(await charts.filter({ hasText: 'Gateway calls per minute' }).locator('rect.s-info').count()).toBeGreaterThan(0);
      // In the page (a string: this file is not compiled with the DOM's types).
      const overlaps = (await page.evaluate(`(() => {
        const boxes = [...document.querySelectorAll('main h1, main > section, main .cards > .card, main .columns > section, main .charts > figure, main section > h2, main .table-wrap')]
          .map((el) => ({ el, r: el.getBoundingClientRect() }))
          .filter(({ r }) => r.width > 0 && r.height > 0);
        const found = [];
        for (const a of boxes) {
          for (const b of boxes) {
            if (a === b || a.el.contains(b.el) || b.el.contains(a.el)) continue;
            const x = Math.min(a.r.right, b.r.right) - Math.max(a.r.left, b.r.left);
            const y = Math.min(a.r.bottom, b.r.bottom) - Math.max(a.r.top, b.r.top);
            if (x > 0.5 && y > 0.5) found.push(a.el.tagName + '.' + a.el.className + ' ∩ ' + b.el.tagName + '.' + b.el.className);
          }
        }
        return found;
      })()`)) as string[];
      expect(overlaps, `at ${width} px`).toEqual([]);
      expect(await page.evaluate('document.documentElement.scrollWidth'), `at ${width} px`).toBeLessThanOrEqual(width);
      if (width === 1024 || width === 1440) await b.shot(`overview-${width}`, page);
    }
    expect(refused).toEqual([]);
    await page.close();
  });

  it("overview: the host database's oldest transaction (the xmin horizon) and its dead rows", async () => {
    const { page } = b;
    const holder = await t.pool.connect();
    try {
      await holder.query('begin isolation level repeatable read');
      await holder.query('select 1');
      const began = performance.now();
      await waitUntil(() => performance.now() - began > 2_000, 10_000, 'two seconds');
      await page.goto(`${base}/console/`);
      const host = page.locator('.card', { hasText: 'Host database' });
      expect(await host.locator('.card-value').textContent()).toMatch(/^\d+ s$/);
      expect(await host.locator('.card-note').textContent()).toMatch(/xmin horizon; dead rows: .*(payment_operations|pg-boss) \d/);
    } finally {
      await holder.query('rollback');
      holder.release();
    }
    await expect.poll(async () => (await page.goto(`${base}/console/`), await page.locator('.card', { hasText: 'Host database' }).locator('.card-value').textContent()), { timeout: 20_000 }).toBe('no open snapshot');
  });

  it('review queue → operation: every field and the timeline of claims, calls and the flag', async () => {
    const { page } = b;
    await page.goto(`${base}/console/`);
    await page.keyboard.press('g');
    await page.keyboard.press('r');
    await page.waitForURL(`${base}/console/review`);
    const row = page.locator('table.review tbody tr', { hasText: shortOperationId(ops.misuse) });
    expect(await row.textContent()).toContain('idempotency key misuse');
    await b.shot('review-queue');
    // Keyboard: j focuses the first row's link, Enter opens it.
    await page.keyboard.press('j');
    const first = await page.evaluate('document.activeElement?.getAttribute("href")');
    expect(first).toMatch(/^\/console\/operations\//);
    await row.getByRole('link', { name: shortOperationId(ops.misuse) }).click();
    await page.waitForURL(`${base}/console/operations/${ops.misuse}`);
    const timeline = page.locator('ol.timeline');
    const text = await timeline.textContent();
    expect(text).toMatch(/create → needs_review[\s\S]*fence\s*1[\s\S]*by\s*\S+/);
    expect(text).toMatch(/Stripe request\s*req_/);
    expect(text).toContain('held for review');
    expect(await page.locator('dl.fields').textContent()).toContain(`payment-op:${ops.misuse}`);
    // The attempts on a line of time: the create sent, and its outcome (held for review).
    const attempts = page.locator('figure.chart-small');
    expect(await attempts.locator('circle.s-bad').count()).toBe(1);
    expect(await attempts.locator('line.s-p50').count()).toBeGreaterThanOrEqual(1);
    expect(await attempts.locator('title').allTextContents()).toContainEqual(expect.stringMatching(/UTC: needs_review$/));
    await b.shot('operation-in-review');
  });

  it('resolve: refused by the search horizon, refused with another operation\'s charge, then accepted', async () => {
    const { page } = b;
    await page.goto(`${base}/console/operations/${ops.misuse}`);
    await page.getByLabel('Why nothing was charged').fill('customer says no charge');
    await page.getByRole('button', { name: 'Resolve as failed' }).click();
    const alert = page.getByRole('alert');
    await expect.poll(() => alert.textContent()).toMatch(/Refused\..*the last attempt to charge was \d+ s ago.*try again in \d+ s/);
    expect(await page.getByLabel('Why nothing was charged').inputValue()).toBe('customer says no charge');
    await b.shot('operation-resolve-refused');

    const paidPi = (await operation(t, ops.paid)).external_id!;
    await page.getByLabel('PaymentIntent that charged').fill(paidPi);
    await page.getByRole('button', { name: 'Resolve as succeeded' }).click();
    await expect.poll(() => page.getByRole('alert').textContent()).toContain(`${paidPi} belongs to operation ${ops.paid}, not ${ops.misuse}`);
    expect((await operation(t, ops.misuse)).status).toBe('unknown');
    // Both attempts audited as refused, neither as a resolution.
    expect(await audit(ops.misuse)).toEqual([
      { actor: 'console:alice', action: 'resolve_refused' },
      { actor: 'console:alice', action: 'resolve_refused' },
    ]);

    await page.getByLabel('PaymentIntent that charged').fill(ops.misusePi);
    await page.getByRole('button', { name: 'Resolve as succeeded' }).click();
    await page.waitForURL(`${base}/console/operations/${ops.misuse}?done=resolved`);
    expect(await page.getByRole('status').textContent()).toContain('Resolved');
    expect(await operation(t, ops.misuse)).toMatchObject({ status: 'succeeded', external_id: ops.misusePi, needs_review: false });
    expect((await audit(ops.misuse)).at(-1)).toEqual({ actor: 'console:alice', action: 'resolve' });
    const text = await page.locator('ol.timeline').textContent();
    expect(text).toContain('settled succeeded');
    expect(text).toContain('resolve as succeeded by console:alice');
    await b.shot('operation-resolved');
  });

  it('a forged POST is refused with 403 and changes nothing: no CSRF token, a wrong one, or from another site; an oversized one with 413', async () => {
    const target = `${base}/console/operations/${ops.misuse2}/requeue`;
    const resolve = `${base}/console/operations/${ops.misuse2}/resolve`;
    const csrf = await b.page.goto(`${base}/console/operations/${ops.misuse2}`).then(() => b.page.locator('input[name=csrf]').first().inputValue());
    const jobsBefore = (await t.pool.query(`select count(*)::int as n from pgboss.job where data->>'operationId' = $1`, [ops.misuse2])).rows[0].n;
    const forged = [
      b.page.request.post(target, { form: {}, maxRedirects: 0 }),
      b.page.request.post(target, { form: { csrf: 'x'.repeat(43) }, maxRedirects: 0 }),
      b.page.request.post(resolve, { form: { outcome: 'succeeded', external_id: 'pi_forged' }, maxRedirects: 0 }),
      b.page.request.post(target, { form: { csrf }, headers: { 'Sec-Fetch-Site': 'cross-site' }, maxRedirects: 0 }),
    ];
    for (const res of await Promise.all(forged)) expect(res.status()).toBe(403);
    // A body over the forms' limit is refused before anything is read of it, with the connection closed.
    const huge = await b.page.request.post(target, { form: { csrf, pad: 'x'.repeat(200_000) }, maxRedirects: 0 });
    expect(huge.status()).toBe(413);
    expect(await audit(ops.misuse2)).toEqual([]);
    expect((await t.pool.query(`select count(*)::int as n from pgboss.job where data->>'operationId' = $1`, [ops.misuse2])).rows[0].n).toBe(jobsBefore);
    expect(await operation(t, ops.misuse2)).toMatchObject({ status: 'unknown', needs_review: true });
  });

  it('requeue: a new job for the same operation, audited under the operator', async () => {
    const { page } = b;
    await page.goto(`${base}/console/operations/${ops.misuse2}`);
    await page.getByRole('button', { name: 'Requeue' }).click();
    await page.waitForURL(`${base}/console/operations/${ops.misuse2}?done=requeued`);
    expect(await page.getByRole('status').textContent()).toContain('Requeued');
    expect(await audit(ops.misuse2)).toEqual([{ actor: 'console:alice', action: 'requeue' }]);
    // The worker drives it again with the same key: the same misuse, held again; never a second charge.
    await settledIntoReview(ops.misuse2, 2);
    expect(e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === ops.misuse2)).toHaveLength(1);
    await page.reload();
    await b.shot('operation-requeued');
  });

  it('requeue stuck: a dry run lists them, and only the confirmed ones are requeued', async () => {
    const { page } = b;
    const other = (await keyMisuse()).op;
    await settledIntoReview(other);
    await page.goto(`${base}/console/requeue-stuck`);
    await page.getByLabel('Untouched for at least').fill('0');
    await page.getByRole('button', { name: 'Dry run' }).click();
    await page.waitForURL(/older_than_minutes=0/);
    expect(await page.getByRole('heading', { level: 2 }).first().textContent()).toContain('2 would be requeued');
    expect(await audit(ops.misuse2)).toHaveLength(1); // a dry run changes nothing
    await b.shot('requeue-stuck-dry-run');
    await page.getByLabel(other).uncheck();
    await page.getByRole('button', { name: 'Requeue the checked operations' }).click();
    await expect.poll(() => page.locator('table caption', { hasText: 'Requeued' }).count()).toBe(1);
    expect(await page.locator('table', { hasText: 'Requeued' }).textContent()).toContain(shortOperationId(ops.misuse2));
    expect(await audit(ops.misuse2)).toEqual([{ actor: 'console:alice', action: 'requeue' }, { actor: 'console:alice', action: 'requeue' }]);
    expect(await audit(other)).toEqual([]);
    await b.shot('requeue-stuck-done');
  });

  it('lists operations newest first with filters and keyset pages that neither skip nor repeat', async () => {
    const more: string[] = [];
    for (let i = 0; i < 12; i++) more.push(await confirm(t));
    await waitUntil(async () => (await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where id = any($1) and status = 'succeeded'`, [more])).rows[0].n === more.length, 20_000, 'settled');
    const all = (await t.pool.query(`select id from outboxd.payment_operations order by created_at desc, id desc`)).rows.map((r) => r.id);
    const { page } = b;
    await page.goto(`${base}/console/operations?size=5`);
    const seen: string[] = [];
    const idsOnPage = () => page.locator('table.data tbody a.row-link').evaluateAll((as) => as.map((a) => a.getAttribute('title')!));
    for (let n = 0; ; n++) {
      seen.push(...(await idsOnPage()));
      if (n === 0) await b.shot('operations-list');
      const older = page.getByRole('link', { name: 'Older ›' });
      if ((await older.count()) === 0) break;
      await older.click();
      await page.waitForLoadState();
    }
    expect(seen).toEqual(all);
    // Back one page: the page before the last, exactly.
    await page.getByRole('link', { name: '‹ Newer' }).click();
    expect(await idsOnPage()).toEqual(all.slice(Math.floor((all.length - 1) / 5) * 5 - 5, Math.floor((all.length - 1) / 5) * 5));

    await page.goto(`${base}/console/operations`);
    await page.getByLabel('Status').selectOption('failed');
    await page.getByRole('button', { name: 'Apply' }).click();
    await page.waitForURL(/status=failed/);
    expect(await idsOnPage()).toEqual([ops.declined]);
    await page.goto(`${base}/console/operations?review=1`);
    expect((await idsOnPage()).sort()).toEqual((await t.pool.query(`select id from outboxd.payment_operations where needs_review`)).rows.map((r) => r.id).sort());
  });

  it('search: an operation id prefix, an order id and a Stripe id lead to the operation; an order\'s operations know each other', async () => {
    const { page } = b;
    const paid = await operation(t, ops.paid);
    for (const q of [shortOperationId(ops.paid), ops.paid.toUpperCase(), 'ord_console_paid', paid.external_id!]) {
      await page.goto(`${base}/console/`);
      await page.keyboard.press('/');
      await page.keyboard.type(q);
      await page.keyboard.press('Enter');
      await page.waitForURL(`${base}/console/operations/${ops.paid}`);
    }
    // The declined order paid with another card: two operations of one order, each showing the other.
    const declined = await operation(t, ops.declined);
    const retry = await confirm(t, { orderId: declined.order_id!, paymentMethod: 'pm_card_visa' });
    await page.goto(`${base}/console/search?q=${encodeURIComponent(declined.order_id!)}`);
    expect((await page.locator('table.data tbody a.row-link').evaluateAll((as) => as.map((a) => a.getAttribute('title')))).sort()).toEqual([ops.declined, retry].sort());
    await b.shot('search-order');
    await page.goto(`${base}/console/operations/${retry}`);
    expect(await page.locator('section', { hasText: 'Same order' }).textContent()).toContain(shortOperationId(ops.declined));

    await page.goto(`${base}/console/operations/00000000-0000-4000-8000-000000000000`);
    expect(await page.locator('main').textContent()).toContain('no payment operation 00000000-0000-4000-8000-000000000000');

    await page.goto(`${base}/console/search?q=${encodeURIComponent('<script>alert(1)</script>')}`);
    expect(await page.locator('main').textContent()).toContain('“<script>alert(1)</script>” read as order id: nothing found.');
    expect(await page.locator('main script').count()).toBe(0);
    await b.shot('search-nothing');
  });

  it('drift report: Stripe and the operations compared on request', async () => {
    const { page } = b;
    await page.goto(`${base}/console/drift`);
    await page.getByRole('button', { name: 'Run the report' }).click();
    await page.waitForURL(/run=1/);
    // The third key misuse charged and was never resolved: money without a succeeded operation.
    const text = await page.locator('main').textContent();
    expect(text).toContain('charged_not_succeeded');
    await b.shot('drift');
  });

  it('signs out: the session ends on the server, so the old cookie shows nothing', async () => {
    const { page } = b;
    const [cookie] = await b.context.cookies(`${base}/console/`);
    await page.goto(`${base}/console/`);
    await page.getByRole('button', { name: 'Sign out', exact: true }).click();
    await page.waitForURL(`${base}/console/sign-in?signed_out=1`);
    expect(await page.getByRole('status').textContent()).toContain('Signed out.');
    await b.shot('signed-out');
    const res = await fetch(`${base}/console/`, { redirect: 'manual', headers: { Cookie: `${cookie!.name}=${cookie!.value}` } });
    expect(res.status).toBe(303);
    expect((await t.pool.query(`select count(*)::int as n from outboxd.console_sessions`)).rows[0].n).toBe(0);
  });

  it('at a laptop\'s width the operation page still reads; an authorization shows what it holds, until when, on which account', async () => {
    const laptop = await b.context.newPage();
    await laptop.setViewportSize({ width: 1280, height: 800 });
    await laptop.goto(`${base}/console/sign-in`);
    await laptop.getByLabel('Your name').fill('bob');
    await laptop.getByLabel('Admin token').fill(TOKEN);
    await laptop.getByRole('button', { name: 'Sign in' }).click();
    await laptop.waitForURL(`${base}/console/`);
    await laptop.goto(`${base}/console/operations/${ops.misuse}`);
    const width = await laptop.evaluate('document.documentElement.scrollWidth');
    expect(width).toBeLessThanOrEqual(1280); // nothing overflows sideways
    await b.shot('operation-laptop', laptop);
    // An authorization: its connected account, the capture that changed it, and beside it one still held.
    await laptop.goto(`${base}/console/operations/${ops.hold}`);
    const fieldOf = (label: string) => laptop.locator('.fields > div', { has: laptop.locator('dt', { hasText: new RegExp(`^${label}$`) }) }).locator('dd');
    expect(await fieldOf('Authorization').textContent()).toMatch(/^held, then changed by capture [0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4} 20\.00 EUR/);
    expect(await fieldOf('Connected account').textContent()).toBe('acct_1BrowserShop');
    expect(await laptop.locator('section', { hasText: 'Same order' }).textContent()).toMatch(/capture\s*succeeded\s*20\.00 EUR/);
    await b.shot('operation-hold', laptop);
    await laptop.goto(`${base}/console/operations/${ops.held}`);
    expect(await fieldOf('Authorization').textContent()).toMatch(/^holds 25\.99 EUR until .+ \(\d+ d \d+ h left to capture\)$/);
    await laptop.close();
  });
});

describe('console sessions', () => {
  const request = (cookie: string) => ({ headers: { cookie: cookie.split(';')[0] } }) as IncomingMessage;

  const ACT: [string, 'act'] = [TOKEN, 'act'];
  const IDLE = { idleSeconds: 1800 };

  it('end at sign-out, at expiry, and when ADMIN_TOKEN changes; only a hash of the secret is stored', async () => {
    const { cookie } = await startSession(t.pool, ACT, 'carol', false, IDLE);
    expect(cookie).toMatch(/^outboxd_console=[\w-]{43}; Path=\/console; Max-Age=28800; HttpOnly; SameSite=Strict$/);
    const session = await sessionOf(t.pool, [ACT], request(cookie), IDLE);
    expect(session?.operator).toBe('carol');
    expect(session?.access).toBe('act');
    const secret = cookie.split(';')[0]!.split('=')[1]!;
    expect((await t.pool.query(`select count(*)::int as n from outboxd.console_sessions where id = $1 or csrf_token = $1`, [secret])).rows[0].n).toBe(0);

    expect(await sessionOf(t.pool, [['a-rotated-admin-token-0123', 'act']], request(cookie), IDLE)).toBeUndefined();
    await t.pool.query(`update outboxd.console_sessions set expires_at = now() - interval '1 second' where id = $1`, [session!.id]);
    expect(await sessionOf(t.pool, [ACT], request(cookie), IDLE)).toBeUndefined();

    const again = await startSession(t.pool, ACT, 'carol', true, IDLE);
    expect(again.cookie).toMatch(/; Secure$/);
    const live = (await sessionOf(t.pool, [ACT], request(again.cookie), IDLE))!;
    await endSession(t.pool, live);
    expect(await sessionOf(t.pool, [ACT], request(again.cookie), IDLE)).toBeUndefined();
  });

  it('takes a printable name of one line', () => {
    expect(parseOperatorName('  Alice   Smith ')).toBe('Alice Smith');
    for (const bad of ['', '   ', 'a'.repeat(65), 'eve\u0000', 'eve\u202e', 'line\u0085two']) expect(parseOperatorName(bad), JSON.stringify(bad)).toBeUndefined();
  });
});
