// The console's pages other than the operation's own (operation.ts): sign-in, overview, review queue,
// lists, search, requeue of stuck operations, drift report, errors.
import type { RequeueResult } from '../../admin/requeue.ts';
import type { ListedOperation } from '../../engine/operation.ts';
import type { DriftReport } from '../../reconcile/drift.ts';
import { ago, html, nothing, span, type Fragment, type Safe } from '../html.ts';
import type { Charts, ListFilter, Listed, Overview, Page, SearchResult } from '../queries.ts';
import { DEPTH_CAP } from '../../sql/outbox.ts';
import { timeChart } from './charts.ts';
import { amount, kindTag, opLink, operationsTable, statusPill } from './parts.ts';
import { notice } from './layout.ts';

/** What a read-only session sees where the forms would be. */
export const readOnlyNote = html`<p class="muted small read-only-note">You signed in with the read-only token: you see everything, and change nothing.</p>`;

export function signInPage(opts: { error?: string | undefined; name?: string; next?: string | undefined }): Safe {
  return html`<section class="signin" aria-labelledby="signin-title">
  <h1 id="signin-title">Sign in</h1>
  <p class="lede">The console shows payment operations and can settle them. Sign in with the replica's admin token; your name goes into the audit trail of every action you take.</p>
  ${opts.error ? notice('refused', opts.error) : nothing}
  <form method="post" action="/console/sign-in" class="stack">
    ${opts.next ? html`<input type="hidden" name="next" value="${opts.next}">` : nothing}
    <label for="operator">Your name <span class="help">as the audit trail shows it (console:<em>name</em>)</span></label>
    <input id="operator" name="operator" type="text" required maxlength="64" autocomplete="username" value="${opts.name ?? ''}" autofocus>
    <label for="token">Admin token <span class="help">ADMIN_TOKEN of this deployment</span></label>
    <input id="token" name="token" type="password" required autocomplete="current-password">
    <button type="submit" class="primary">Sign in</button>
  </form>
  <p class="muted small">The session ends after a while without a page view, 8 hours after sign-in at the latest, or when you sign out or the token changes.</p>
</section>`;
}

const SETTLED = new Set(['succeeded', 'failed']);

/** Saturated when a dispatch call anywhere in the fleet came up short of tokens within this many seconds. */
const SATURATED_WITHIN_S = 60;

function budgetCard(b: Overview['budget']): Safe {
  if (b.limit === undefined) return card('Stripe budget', 'not limited', 'neutral', 'STRIPE_RATE_LIMIT is off (the emulator needs none)');
  const shortAgo = Math.min(...b.buckets.map((x) => x.short_seconds_ago ?? Infinity));
  const saturated = shortAgo <= SATURATED_WITHIN_S;
  const limits = `${b.limit} requests/s${b.searchLimit !== undefined ? `, search ${b.searchLimit}/s` : ''}, all replicas`;
  return card(
    'Stripe budget',
    saturated ? 'in full use' : 'room to spare',
    saturated ? 'warn' : 'good',
    saturated ? `${limits}: a call waited for a token ${Math.round(shortAgo)} s ago` : `${limits}: no call waited for a token in the last minute`,
  );
}

const count = (n: number) => (Number.isInteger(n) ? n.toLocaleString('en') : n.toFixed(1));
const age = (s: number) => (s < 10 ? `${Math.round(s * 10) / 10} s` : span(s));
const millis = (ms: number) => (ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10_000 ? 1 : 0)} s`);

/** The last hours a minute at a time: what settled, how long it took, what waited, what Stripe was asked. */
function chartsSection(c: Charts, budget: Overview['budget']): Safe {
  const hours = Math.round(c.succeeded.length / 60);
  const perMinute = budget.limit === undefined ? undefined : budget.limit * 60;
  return html`<section aria-labelledby="charts-title" class="charts-section">
  <h2 id="charts-title">The last ${hours} hours <span class="sub">by minute, UTC</span></h2>
  <div class="charts">
    ${timeChart({ title: 'Settlements per minute', from: c.from, format: count, empty: 'nothing settled',
      bars: [{ name: 'succeeded', cls: 's-good', values: c.succeeded }, { name: 'failed', cls: 's-bad', values: c.failed }] })}
    ${timeChart({ title: 'Confirm → settled', from: c.from, format: millis, empty: 'nothing settled',
      lines: [{ name: 'p50', cls: 's-p50', values: c.p50Ms }, { name: 'p95', cls: 's-p95', values: c.p95Ms }] })}
    ${timeChart({ title: 'Oldest unsettled operation', from: c.from, format: age, empty: 'nothing waited a minute',
      lines: [{ name: 'age', cls: 's-warn', values: c.oldestUnsettled }] })}
    ${timeChart({ title: 'Gateway calls per minute', from: c.from, format: count, empty: 'no call made',
      bars: [{ name: 'answered', cls: 's-info', values: c.gatewayCalls.map((n, i) => n - c.rateLimited[i]!) }, { name: '429', cls: 's-bad', values: c.rateLimited }],
      limit: perMinute === undefined ? undefined : { value: perMinute, label: `budget ${count(perMinute)}/min` } })}
  </div>
</section>`;
}

export function overviewPage(o: Overview, now: Date, charts: Charts): Safe {
  const kinds = [...new Set(o.counts.map((c) => c.kind))];
  const count = (kind: string, status: string) => o.counts.find((c) => c.kind === kind && c.status === status)?.n ?? 0;
  const columns = ['pending', 'unknown', 'succeeded', 'failed'];
  const oldest = o.oldestUnsettledSeconds;
  return html`<h1>Overview</h1>
<section class="cards" aria-label="Health">
  ${card('Needs review', String(o.needsReview), o.needsReview > 0 ? 'bad' : 'good', o.needsReview > 0 ? html`<a href="/console/review">Open the review queue</a>` : 'nothing waits for a person')}
  ${card('Oldest unsettled', oldest === null ? 'none' : span(oldest), oldest !== null && oldest > 900 ? 'warn' : 'good', 'pending or unknown, review included')}
  ${card('Outbox depth', o.outboxRows >= DEPTH_CAP ? `${DEPTH_CAP}+` : String(o.outboxRows), o.outboxRows > 0 ? 'info' : 'good', 'rows waiting to become jobs')}
  ${queuesCard(o.queues)}
  ${budgetCard(o.budget)}
  ${hostCard(o.host)}
  ${card('Operations', `${o.total.exact ? '' : '≈ '}${o.total.n.toLocaleString('en')}`, 'neutral', o.total.exact ? 'all kinds' : 'all kinds, as PostgreSQL estimates')}
</section>
${chartsSection(charts, o.budget)}
<div class="columns">
<section aria-labelledby="counts-title">
  <h2 id="counts-title">By kind and status</h2>
  ${kinds.length === 0
    ? html`<p class="empty">No operation is unsettled, and none settled in the last 24 hours.</p>`
    : html`<div class="table-wrap"><table class="data counts">
    <thead><tr><th scope="col">Kind</th>${columns.map((c) => html`<th scope="col" class="num">${statusPill(c)}${SETTLED.has(c) ? html`<span class="sub">last 24 h</span>` : html`<span class="sub">now</span>`}</th>`)}</tr></thead>
    <tbody>${kinds.map(
      (k) => html`<tr><th scope="row">${kindTag(k)}</th>${columns.map((c) => {
        const n = count(k, c);
        const href = `/console/operations?kind=${encodeURIComponent(k)}&status=${c}`;
        return html`<td class="num">${n > 0 ? html`<a href="${href}">${n.toLocaleString('en')}</a>` : html`<span class="muted">0</span>`}</td>`;
      })}</tr>`,
    )}</tbody></table></div>`}
</section>
<section aria-labelledby="review-title">
  <h2 id="review-title">Waiting longest for review</h2>
  ${o.review.length === 0
    ? html`<p class="empty">The review queue is empty.</p>`
    : html`<ul class="brief">${o.review.map(
        (op) => html`<li>${opLink(op.id)} ${kindTag(op.kind)} ${amount(op)} <span class="muted">${ago(op.flagged_at ?? op.updated_at, now)}</span><div class="reason">${op.review_reason}</div></li>`,
      )}</ul>
      ${o.needsReview > o.review.length ? html`<p><a href="/console/review">All ${o.needsReview} in the review queue</a></p>` : nothing}`}
</section>
</div>
<section aria-labelledby="recent-title">
  <h2 id="recent-title">Recent settlements</h2>
  ${recentTable(o.recent, now)}
</section>`;
}

/** A transaction open this long on the host database keeps every row deleted since from being vacuumed. */
const LONG_TRANSACTION_S = 600;

/** The host database as it bears on outboxd's tables: its oldest transaction (the xmin horizon) and the
 * dead rows that wait for vacuum, most first. */
function hostCard(host: Overview['host']): Safe {
  if (!host) return card('Host database', '—', 'neutral', 'pg_stat_activity could not be read');
  const dead = [...host.tables].sort((a, b) => b.dead - a.dead).slice(0, 3).map((t) => `${t.table} ${t.dead.toLocaleString('en')}`).join(' · ');
  const long = host.oldest_xmin_seconds > LONG_TRANSACTION_S;
  return card(
    'Host database',
    host.oldest_xmin_seconds > 0 ? span(host.oldest_xmin_seconds) : 'no open snapshot',
    long ? 'warn' : 'good',
    `oldest transaction holding the xmin horizon${long ? ': vacuum cannot keep up behind it' : ''}; dead rows: ${dead || 'none'}`,
  );
}

/** Every kind's queue in one card: the jobs waiting in all of them, each kind's share, and what runs. */
function queuesCard(queues: Overview['queues']): Safe {
  if (!queues) return card('Jobs queued', '—', 'neutral', 'the queues could not be read');
  const sum = (f: (q: NonNullable<Overview['queues']>[number]) => number) => queues.reduce((n, q) => n + f(q), 0);
  const each = queues.map((q) => `${q.kind} ${q.queued}`).join(' · ');
  return card('Jobs queued', String(sum((q) => q.queued)), 'neutral', `${each ? `${each}; ` : ''}${sum((q) => q.active)} active, ${sum((q) => q.failed)} failed retained`);
}

function card(label: string, value: string, tone: string, note: Fragment): Safe {
  return html`<div class="card tone-${tone}"><div class="card-label">${label}</div><div class="card-value">${value}</div><div class="card-note">${note}</div></div>`;
}

function recentTable(rows: ListedOperation[], now: Date): Safe {
  if (rows.length === 0) return html`<p class="empty">Nothing has settled yet.</p>`;
  return html`<div class="table-wrap"><table class="data">
  <thead><tr><th scope="col">Operation</th><th scope="col">Kind</th><th scope="col">Status</th><th scope="col" class="num">Amount</th><th scope="col">Stripe</th><th scope="col">Settled</th><th scope="col">Settled by</th></tr></thead>
  <tbody>${rows.map(
    (op) => html`<tr><td>${opLink(op.id)}</td><td>${kindTag(op.kind)}</td><td>${statusPill(op.status)}</td><td class="num">${amount(op)}</td>
    <td class="mono">${op.external_id ?? '—'}</td><td class="nowrap">${ago(op.settled_at, now)}</td><td class="muted">${settledBy(op.last_outcome)}</td></tr>`,
  )}</tbody></table></div>`;
}

/** How an operation was settled, from the outcome it recorded last. */
function settledBy(lastOutcome: string | null): string {
  if (lastOutcome === 'resolved_by_admin') return 'a resolution';
  if (lastOutcome?.startsWith('webhook:')) return 'a Stripe webhook';
  return 'a worker';
}

export function reviewPage(rows: (Listed & { flagged_at: Date | null })[], limit: number, now: Date): Safe {
  return html`<h1>Review queue <span class="count-big">${rows.length}${rows.length === limit ? '+' : ''}</span></h1>
<p class="lede">Operations held for a person, longest waiting first. Open one to see its whole story, then resolve it with Stripe's evidence or requeue it (same idempotency key). The runbook says what each reason asks of you.</p>
${rows.length === 0
  ? html`<p class="empty">Nothing waits for review.</p>`
  : html`<div class="table-wrap"><table class="data review">
  <thead><tr><th scope="col">Operation</th><th scope="col">Reason</th><th scope="col">Waiting</th><th scope="col">Age</th><th scope="col">Kind</th><th scope="col">Status</th><th scope="col" class="num">Amount</th><th scope="col">Evidence</th></tr></thead>
  <tbody>${rows.map(
    (op) => html`<tr>
    <td>${opLink(op.id)}</td>
    <td class="reason">${op.review_reason}</td>
    <td class="nowrap">${ago(op.flagged_at ?? op.updated_at, now)}</td>
    <td class="nowrap">${ago(op.created_at, now)}</td>
    <td>${kindTag(op.kind)}</td>
    <td>${statusPill(op.status)}</td>
    <td class="num">${amount(op)}</td>
    <td class="evidence"><a href="/console/operations/${op.id}#timeline">timeline</a>${op.order_id === null ? nothing : html` · <a href="/console/search?q=${encodeURIComponent(op.order_id)}">order</a>`}${op.external_id ? html` · <span class="mono">${op.external_id}</span>` : nothing}</td>
  </tr>`,
  )}</tbody></table></div>`}`;
}

export function listPage(page: Page, filter: ListFilter, kinds: string[], statuses: readonly string[], size: number, now: Date, dashboard: string | undefined): Safe {
  const base = new URLSearchParams();
  if (filter.kind) base.set('kind', filter.kind);
  if (filter.status) base.set('status', filter.status);
  if (filter.needsReview) base.set('review', '1');
  if (size !== DEFAULT_PAGE) base.set('size', String(size));
  const link = (key: 'before' | 'after', cursor: string) => {
    const q = new URLSearchParams(base);
    q.set(key, cursor);
    return `/console/operations?${q}`;
  };
  const newest = `/console/operations${base.size ? `?${base}` : ''}`;
  return html`<h1>Operations</h1>
<form class="filters" method="get" action="/console/operations" aria-label="Filters">
  <div><label for="f-status">Status</label>
  <select id="f-status" name="status"><option value="">any</option>${statuses.map((s) => html`<option value="${s}"${s === filter.status ? html` selected` : nothing}>${s}</option>`)}</select></div>
  <div><label for="f-kind">Kind</label>
  <select id="f-kind" name="kind"><option value="">any</option>${kinds.map((k) => html`<option value="${k}"${k === filter.kind ? html` selected` : nothing}>${k}</option>`)}</select></div>
  <div class="check"><input id="f-review" type="checkbox" name="review" value="1"${filter.needsReview ? html` checked` : nothing}><label for="f-review">needs review</label></div>
  ${size !== DEFAULT_PAGE ? html`<input type="hidden" name="size" value="${size}">` : nothing}
  <button type="submit">Apply</button>
  ${filter.kind || filter.status || filter.needsReview ? html`<a href="/console/operations">Clear</a>` : nothing}
</form>
${operationsTable(page.rows, { empty: 'No operation matches.', now, dashboard, caption: 'Newest first' })}
<nav class="pager" aria-label="Pages">
  ${page.newer ? html`<a href="${newest}">« Newest</a> <a href="${link('after', page.newer)}" rel="prev">‹ Newer</a>` : html`<span class="muted">Newest page</span>`}
  ${page.older ? html`<a href="${link('before', page.older)}" rel="next">Older ›</a>` : html`<span class="muted">No older operations</span>`}
</nav>`;
}

export const DEFAULT_PAGE = 50;

export function searchPage(result: SearchResult, now: Date, dashboard: string | undefined): Safe {
  return html`<h1>Search</h1>
${result.query
  ? html`<p class="lede">“${result.query}” read as ${result.readAs.join(', ')}: ${result.matches.length === 0 ? 'nothing found.' : `${result.matches.length} operation${result.matches.length === 1 ? '' : 's'}.`}</p>
  ${operationsTable(result.matches, { empty: 'No operation has this id, order id or Stripe id.', now, dashboard })}`
  : html`<p class="lede">Type an operation id (whole, or its short id: a prefix of 8 or more hex digits), an order id, or a Stripe id (pi_…, re_…, pyr_…) in the search box.</p>`}`;
}

export function stuckPage(opts: {
  olderThanMinutes: number;
  dryRun: RequeueResult[] | undefined;
  done: RequeueResult[] | undefined;
  /** Undefined: a read-only session, shown no form that changes anything. */
  csrfToken: string | undefined;
}): Safe {
  return html`<h1>Requeue stuck operations</h1>
<p class="lede">Unsettled operations untouched for a while that no job drives (no live job, no lease, nothing in the outbox) get a new job for the <strong>same</strong> operation: the same idempotency key, so never a second charge. First a dry run shows what would be requeued; nothing changes until you confirm.</p>
${opts.done ? resultsTable('Requeued', opts.done) : nothing}
<form method="get" action="/console/requeue-stuck" class="inline">
  <label for="older">Untouched for at least</label>
  <input id="older" name="older_than_minutes" type="number" min="0" max="43200" value="${opts.olderThanMinutes}" inputmode="numeric"> <span>minutes</span>
  <button type="submit">Dry run</button>
</form>
${opts.dryRun ? dryRunForm(opts.dryRun, opts.olderThanMinutes, opts.csrfToken) : nothing}`;
}

function dryRunForm(results: RequeueResult[], minutes: number, csrf: string | undefined): Safe {
  const would = results.filter((r) => r.result === 'would_requeue');
  const other = results.filter((r) => r.result !== 'would_requeue');
  return html`<section aria-labelledby="dry-title" class="panel">
  <h2 id="dry-title">Dry run: ${would.length} would be requeued${other.length ? html`, ${other.length} skipped` : nothing}</h2>
  ${would.length === 0
    ? html`<p class="empty">Nothing untouched for ${minutes} minutes lacks a job.</p>`
    : csrf === undefined
    ? html`<ul class="brief">${would.map((r) => html`<li>${opLink(r.operationId)}</li>`)}</ul>${readOnlyNote}`
    : html`<form method="post" action="/console/requeue-stuck">
    <input type="hidden" name="csrf" value="${csrf}">
    <fieldset><legend>Operations to requeue (uncheck any to leave alone)</legend>
    <ul class="checks">${would.map(
      (r) => html`<li><input type="checkbox" id="op-${r.operationId}" name="op" value="${r.operationId}" checked> <label for="op-${r.operationId}" class="mono">${r.operationId}</label> <a href="/console/operations/${r.operationId}">open</a></li>`,
    )}</ul></fieldset>
    <button type="submit" class="primary">Requeue the checked operations</button>
  </form>`}
  ${other.length ? resultsTable('Skipped', other) : nothing}
</section>`;
}

function resultsTable(title: string, results: RequeueResult[]): Safe {
  return html`<div class="table-wrap"><table class="data">
  <caption>${title}</caption>
  <thead><tr><th scope="col">Operation</th><th scope="col">Result</th><th scope="col">Detail</th></tr></thead>
  <tbody>${results.map(
    (r) => html`<tr><td>${opLink(r.operationId)}</td><td>${statusPill(r.result)}</td><td>${'reason' in r ? r.reason : 'jobId' in r ? `job ${r.jobId}` : ''}</td></tr>`,
  )}</tbody></table></div>`;
}

export const DRIFT_WINDOWS: [hours: number, label: string][] = [
  [1, 'the last hour'],
  [24, 'the last 24 hours'],
  [168, 'the last 7 days'],
  [720, 'the last 30 days'],
];

/** Findings a drift page shows: a report of a disaster can hold one per operation of the month, and the
 * page is one string in the replica's memory. The CLI gives them all. */
const DRIFT_SHOWN = 500;

export function driftPage(opts: { hours: number; report: DriftReport | undefined }): Safe {
  const r = opts.report;
  const hidden = r ? r.drift.length - DRIFT_SHOWN : 0;
  return html`<h1>Drift report</h1>
<p class="lede">Stripe's charges against the operations: money that moved without a succeeded operation to show for it, or a succeeded operation without its money. It lists Stripe's charges of the period (API calls, so it runs on request).</p>
<form method="get" action="/console/drift" class="inline">
  <label for="hours">Charges created in</label>
  <select id="hours" name="hours">${DRIFT_WINDOWS.map(([h, label]) => html`<option value="${h}"${h === opts.hours ? html` selected` : nothing}>${label}</option>`)}</select>
  <input type="hidden" name="run" value="1">
  <button type="submit">Run the report</button>
</form>
${r
  ? html`<section class="panel" aria-labelledby="drift-title">
  <h2 id="drift-title">${r.drift.length === 0 ? 'No drift' : `${r.drift.length} finding${r.drift.length === 1 ? '' : 's'}`}</h2>
  <p class="muted">Since ${r.since}: ${Number(r.charges ?? 0)} charges in Stripe, ${r.operations} operations compared.</p>
  ${r.drift.length === 0
    ? html`<p class="good-text">Stripe and the operations agree.</p>`
    : html`<div class="table-wrap"><table class="data">
    <thead><tr><th scope="col">Finding</th><th scope="col">Operation</th><th scope="col">Stripe objects</th><th scope="col">Detail</th></tr></thead>
    <tbody>${r.drift.slice(0, DRIFT_SHOWN).map(
      (d) => html`<tr><td>${statusPill(d.kind)}</td><td>${d.operationId ? opLink(d.operationId) : html`<span class="muted">none</span>`}</td><td class="mono">${d.chargeIds.join(', ')}</td><td>${d.detail}</td></tr>`,
    )}</tbody></table></div>
    ${hidden > 0 ? html`<p class="muted">The first ${DRIFT_SHOWN} are shown; <code>outboxd reconcile --report --since ${opts.hours}h --json</code> lists all of them, ${hidden} more.</p>` : nothing}`}
</section>`
  : nothing}`;
}

export function errorPage(status: number, message: string): Safe {
  const title = status === 404 ? 'Not found' : status === 403 ? 'Forbidden' : status === 401 ? 'Sign in first' : 'Something went wrong';
  return html`<h1>${title}</h1>${notice('error', message)}<p><a href="/console/">Back to the overview</a></p>`;
}

