// Pieces every page uses: status, links to an operation, amounts, tables of operations.
import { shortOperationId, type ListedOperation, type Operation } from '../../engine/operation.ts';
import { ago, html, money, nothing, type Fragment, type Safe } from '../html.ts';

export const opHref = (id: string): string => `/console/operations/${encodeURIComponent(id)}`;

export function statusPill(status: string): Safe {
  return html`<span class="pill status-${/^[a-z_]+$/.test(status) ? status : 'other'}">${status}</span>`;
}

export function reviewBadge(op: Pick<Operation, 'needs_review'>): Safe {
  return op.needs_review ? html`<span class="pill review" title="Held for a person">review</span>` : nothing;
}

export function kindTag(kind: string): Safe {
  return html`<span class="kind">${kind}</span>`;
}

export function amount(op: Pick<Operation, 'amount' | 'currency'>): Safe {
  if (op.amount === null || op.currency === null) return html`<span class="amount muted">—</span>`;
  return html`<span class="amount" title="${op.amount} ${op.currency} (minor units)">${money(Number(op.amount), op.currency)}</span>`;
}

/** An operation's id, short, linking to its page; the full id in the title. */
export function opLink(id: string, cls = 'row-link'): Safe {
  return html`<a class="${cls} mono" href="${opHref(id)}" title="${id}">${shortOperationId(id)}</a>`;
}

/** Where each kind of Stripe object has its page in the dashboard, by its id's prefix. */
const DASHBOARD_PATHS: [prefix: string, path: string][] = [
  ['pi_', 'payments'],
  ['re_', 'refunds'],
  ['pyr_', 'refunds'],
  ['cus_', 'customers'],
  ['acct_', 'connect/accounts'],
];

/** The dashboard's page of a Stripe object: `dashboard` is the account's dashboard (with `/test` in test mode). */
export function dashboardUrl(dashboard: string, id: string): string | undefined {
  const path = DASHBOARD_PATHS.find(([prefix]) => id.startsWith(prefix))?.[1];
  return path ? `${dashboard}/${path}/${encodeURIComponent(id)}` : undefined;
}

/** A Stripe object's id, linking to its page in the dashboard (a new tab) when a real account is configured. */
export function stripeLink(id: string | null, dashboard: string | undefined): Fragment {
  if (!id) return html`<span class="muted">—</span>`;
  const href = dashboard ? dashboardUrl(dashboard, id) : undefined;
  return href
    ? html`<a class="mono" href="${href}" rel="noopener noreferrer" target="_blank" title="Open in Stripe's dashboard (a new tab)">${id}</a>`
    : html`<span class="mono">${id}</span>`;
}

/** Operations as a table: the columns an operator scans a list by. */
export function operationsTable(rows: ListedOperation[], opts: { caption?: string; empty: string; now?: Date; dashboard?: string | undefined }): Safe {
  if (rows.length === 0) return html`<p class="empty">${opts.empty}</p>`;
  const now = opts.now ?? new Date();
  return html`<div class="table-wrap"><table class="data">
  ${opts.caption ? html`<caption>${opts.caption}</caption>` : nothing}
  <thead><tr>
    <th scope="col">Operation</th><th scope="col">Kind</th><th scope="col">Status</th><th scope="col" class="num">Amount</th>
    <th scope="col">Order</th><th scope="col">Stripe</th><th scope="col" class="num">Attempts</th><th scope="col">Created</th><th scope="col">Last error or review reason</th>
  </tr></thead>
  <tbody>
  ${rows.map(
    (op) => html`<tr>
    <td>${opLink(op.id)}</td>
    <td>${kindTag(op.kind)}</td>
    <td>${statusPill(op.status)} ${reviewBadge(op)}</td>
    <td class="num">${amount(op)}</td>
    <td class="mono clip" title="${op.order_id}">${op.order_id}</td>
    <td>${stripeLink(op.external_id, opts.dashboard)}</td>
    <td class="num">${op.attempts}</td>
    <td class="nowrap">${ago(op.created_at, now)}</td>
    <td class="reason">${op.review_reason ?? op.last_error ?? ''}</td>
  </tr>`,
  )}
  </tbody></table></div>`;
}
