// An operation's page: every field, its timeline, the operations of the same order, and what a person
// may do with it (resolve with evidence, requeue).
import { KEY_WINDOW_SECONDS } from '../../engine/executor.ts';
import { namingOf } from '../../kinds/index.ts';
import { isSettled, type ListedOperation, type Operation } from '../../engine/operation.ts';
import { accountOf } from '../../stripe/gateway.ts';
import { ago, html, nothing, span, utc, when, type Fragment, type Safe } from '../html.ts';
import type { OperationRecord } from '../queries.ts';
import type { Entry } from '../timeline.ts';
import { attemptsChart } from './charts.ts';
import { notice } from './layout.ts';
import { readOnlyNote } from './pages.ts';
import { amount, kindTag, opLink, reviewBadge, statusPill, stripeLink } from './parts.ts';

export interface ActionState {
  /** What the last action did or why it was refused. */
  notice?: { kind: 'done' | 'refused' | 'error'; text: string } | undefined;
  /** The resolve form as the operator filled it, kept when it was refused. */
  externalId?: string;
  reason?: string;
  /** The acknowledge form's, likewise. */
  note?: string;
}

/** Columns shown with their own label, in this order; any other column is listed after them. */
const KNOWN = new Set([
  'id', 'kind', 'order_id', 'amount', 'currency', 'customer_id', 'payment_method', 'metadata', 'status', 'external_id',
  'attempts', 'first_attempted_at', 'last_attempted_at', 'last_outcome', 'last_error', 'review_reason', 'needs_review',
  'settled_at', 'fence', 'lease_owner', 'lease_expires_at', 'created_at', 'updated_at', 'parent_operation_id',
  'processing_since', 'next_check_at',
]);

export function operationPage(
  op: Operation,
  record: OperationRecord,
  entries: Entry[],
  state: ActionState,
  /** csrfToken undefined: a read-only session, shown no form that changes anything. */
  opts: { csrfToken: string | undefined; now: Date; dashboard: string | undefined },
): Safe {
  const { now } = opts;
  return html`<div class="op-head">
  <h1><span class="muted">Operation</span> <span class="mono">${op.id}</span></h1>
  <div class="op-tags">${kindTag(op.kind)} ${statusPill(op.status)} ${reviewBadge(op)} <span class="op-amount">${amount(op)}</span></div>
</div>
${state.notice ? notice(state.notice.kind, state.notice.text) : nothing}
${op.review_reason ? html`<div class="held" role="note"><strong>Held for review.</strong> ${op.review_reason}</div>` : nothing}
${waitingNote(op, now)}
<div class="op-grid">
  <div class="op-main">
    <section aria-labelledby="fields-title" class="panel">
      <h2 id="fields-title">Fields</h2>
      <dl class="fields">
        ${field('Order', op.order_id === null ? 'none (an application effect)' : html`<a class="mono" href="/console/search?q=${encodeURIComponent(op.order_id)}">${op.order_id}</a>`)}
        ${field('Kind', op.kind)}
        ${op.parent_operation_id ? field('Of charge', opLink(op.parent_operation_id)) : nothing}
        ${ofStripe(op) && accountOf(op) ? field('Connected account', stripeLink(accountOf(op), opts.dashboard)) : nothing}
        ${isHold(op) ? field('Authorization', hold(op, record.related, now), true) : nothing}
        ${field('Amount', html`${amount(op)} <span class="muted">(${op.amount} ${op.currency} in minor units)</span>`)}
        ${field('Customer', op.customer_id ? stripeLink(op.customer_id, opts.dashboard) : '—')}
        ${field('Payment method', html`<span class="mono">${op.payment_method}</span>`)}
        ${field('Status', html`${statusPill(op.status)} ${op.settled_at ? html`settled ${when(op.settled_at, now)}` : nothing}`)}
        ${field('Stripe object', stripeLink(op.external_id, opts.dashboard))}
        ${field('Idempotency key', keyOf(op.kind) ? html`<span class="mono">${keyOf(op.kind)!(op.id)}</span>` : html`<span class="muted">none: policy ${op.policy ?? '—'}</span>`)}
        ${field('Gateway calls', String(op.attempts))}
        ${field('First create sent', when(op.first_attempted_at, now))}
        ${keyOf(op.kind) ? field('Key window', keyWindow(op, now), true) : nothing}
        ${field('Last create sent', when(op.last_attempted_at, now))}
        ${field('Last outcome', op.last_outcome ?? '—')}
        ${op.processing_since ? field('Processing since', when(op.processing_since, now)) : nothing}
        ${op.next_check_at && !isSettled(op.status) ? field('Next check', due(op.next_check_at, now)) : nothing}
        ${field('Last error', op.last_error ? html`<span class="error-text">${op.last_error}</span>` : '—', true)}
        ${field('Review reason', op.review_reason ?? '—', true)}
        ${field('Fence', String(op.fence))}
        ${field('Lease', op.lease_owner ? html`<span class="mono">${op.lease_owner}</span> until ${when(op.lease_expires_at, now)}` : 'free')}
        ${field('Created', when(op.created_at, now))}
        ${field('Updated', when(op.updated_at, now))}
        ${field('Metadata', metadata(op.metadata), true)}
        ${Object.entries(op)
          .filter(([k]) => !KNOWN.has(k))
          .map(([k, v]) => field(k, v instanceof Date ? when(v, now) : v === null ? '—' : typeof v === 'object' ? JSON.stringify(v) : String(v)))}
      </dl>
    </section>
    <section aria-labelledby="timeline-title" class="panel" id="timeline">
      <h2 id="timeline-title">Timeline</h2>
      ${attemptsChart(op, record.events, now)}
      ${timelineList(entries, now)}
      ${record.events.length === 0 && op.attempts > 0 ? html`<p class="muted small">This operation ran before outboxd kept a timeline: its claims and calls are not recorded.</p>` : nothing}
    </section>
  </div>
  <aside class="op-side">
    ${isSettled(op.status)
      ? html`<section class="panel" aria-labelledby="actions-title"><h2 id="actions-title">Actions</h2><p class="muted">A settled operation is never changed, and never causes another call to Stripe.</p>${
          op.review_reason && opts.csrfToken !== undefined ? acknowledgeForm(op, state, opts.csrfToken) : nothing
        }</section>`
      : opts.csrfToken === undefined
      ? html`<section class="panel" aria-labelledby="actions-title"><h2 id="actions-title">Actions</h2>${readOnlyNote}</section>`
      : actions(op, state, opts.csrfToken)}
    <section class="panel" aria-labelledby="related-title">
      <h2 id="related-title">Same order</h2>
      ${record.related.length === 0
        ? html`<p class="muted">No other operation of order <span class="mono">${op.order_id}</span>.</p>`
        : html`<ul class="brief">${record.related.map(
            (r) => html`<li>${opLink(r.id)} ${kindTag(r.kind)} ${statusPill(r.status)} ${amount(r)} <span class="muted">${ago(r.created_at, now)}</span></li>`,
          )}</ul>`}
      <p class="muted small">A charge's refunds, captures and cancels belong to its order, as its earlier charges do.</p>
    </section>
  </aside>
</div>`;
}

/** A payment that takes days (SEPA Debit, ACH) is waiting on Stripe, not stuck: since when, and when
 * its job looks again (src/engine/processing.ts). */
function waitingNote(op: Operation, now: Date): Fragment {
  if (isSettled(op.status) || op.last_outcome !== 'processing' || !op.processing_since) return nothing;
  const next = op.next_check_at ? html`next check ${due(op.next_check_at, now)}` : html`no check scheduled: it is checked by the reconcile sweep`;
  return html`<div class="waiting" role="note"><strong>Waiting on Stripe: processing</strong> since ${when(op.processing_since, now)}; ${next}. A webhook settles it sooner; it is held for review only after PROCESSING_REVIEW_DAYS.</div>`;
}

/** A time to come, with how long until it (past: due now). */
function due(at: Date, now: Date): Safe {
  const left = (at.getTime() - now.getTime()) / 1000;
  return html`<time datetime="${at.toISOString()}">${utc(at)}</time> <span class="age">(${left > 0 ? html`in ${span(left)}` : 'due now'})</span>`;
}

function field(label: string, value: Fragment, wide = false): Safe {
  return html`<div${wide ? html` class="wide"` : nothing}><dt>${label}</dt><dd>${value}</dd></div>`;
}

function metadata(m: Record<string, string> | null): Fragment {
  const entries = Object.entries(m ?? {});
  if (entries.length === 0) return html`<span class="muted">none</span>`;
  return html`<ul class="kv">${entries.map(([k, v]) => html`<li><span class="mono">${k}</span> = <span class="mono">${v}</span></li>`)}</ul>`;
}

/** Each Stripe kind's idempotency key; an application's kinds have none of ours. */
const keyOf = (kind: string): ((operationId: string) => string) | undefined => namingOf(kind)?.idempotencyKey;

function resolveSucceededField(op: Operation, value: string): Safe {
  const naming = namingOf(op.kind);
  const expected = naming?.externalId;
  const label = naming?.settledBy ?? 'Your reference for the effect';
  const help = expected ? `${expected.what}, carrying this operation's id, amount and currency` : 'checked by nobody but you: outboxd cannot ask your service';
  return html`<label for="external_id">${label} <span class="help">${help}</span></label>
    <input id="external_id" name="external_id" type="text" required maxlength="255" ${expected ? html`pattern="${expected.pattern.source.replace(/^\^|\$$/g, '')}"` : nothing} spellcheck="false" autocomplete="off" class="mono" value="${value}">`;
}

/** An operation of a kind Stripe carries out (a built-in one): an application's payload may name anything. */
const ofStripe = (op: Operation): boolean => namingOf(op.kind) !== undefined;

/** A charge requested with capture_method manual: Stripe holds its funds once it succeeded. */
const isHold = (op: Operation): boolean => ofStripe(op) && (op.payload as { capture_method?: string } | null)?.capture_method === 'manual';

/** What an authorization holds and for how long (its charge's capture_before, as Stripe said), or what
 * changed it since (its succeeded capture, cancel or refund, among the order's operations). */
function hold(op: Operation, related: ListedOperation[], now: Date): Fragment {
  if (op.status !== 'succeeded') return html`<span class="muted">nothing held yet: captured later (capture_method manual)</span>`;
  const changes = related.filter((r) => r.parent_operation_id === op.id && r.status === 'succeeded');
  if (changes.length > 0) return html`held, then changed by ${changes.map((c) => html`${kindTag(c.kind)} ${opLink(c.id)} ${amount(c)} `)}`;
  const { amount_capturable, capture_before } = (op.result ?? {}) as { amount_capturable?: number; capture_before?: string | null };
  const held = html`holds ${amount({ amount: amount_capturable ?? op.amount, currency: op.currency })}`;
  if (!capture_before) return html`${held}; Stripe said no expiry`;
  const ends = new Date(capture_before);
  if (ends <= now) return html`${held} until ${utc(ends)}: <strong>expired</strong> unless captured before (see its captures and cancels under Same order)`;
  return html`${held} until ${utc(ends)} (${span((ends.getTime() - now.getTime()) / 1000)} left to capture)`;
}

function keyWindow(op: Operation, now: Date): Fragment {
  if (!op.first_attempted_at) return html`<span class="muted">not started (no create sent)</span>`;
  const ends = new Date(op.first_attempted_at.getTime() + KEY_WINDOW_SECONDS * 1000);
  // A settled operation sends nothing again (invariant 5): its window, open or not, no longer matters.
  if (isSettled(op.status)) return html`<span class="muted">settled: nothing is sent again (first sent at ${utc(op.first_attempted_at)})</span>`;
  if (ends <= now) return html`passed at ${utc(ends)}: never created again, only reconciled through search`;
  return html`open until ${utc(ends)} (${span((ends.getTime() - now.getTime()) / 1000)} left): resent with the same key`;
}

function timelineList(entries: Entry[], now: Date): Safe {
  return html`<ol class="timeline">${entries.map(
    (e) => html`<li class="tl tl-${e.tone}">
    <div class="tl-when">${when(e.at, now)}</div>
    <div class="tl-body">
      <div class="tl-title"><span class="tl-kind">${e.kind}</span> ${e.title}</div>
      ${e.facts.some(([, v]) => v !== null && v !== undefined && v !== '')
        ? html`<dl class="tl-facts">${e.facts
            .filter(([, v]) => v !== null && v !== undefined && v !== '')
            .map(([k, v]) => html`<div><dt>${k}</dt><dd class="mono">${v}</dd></div>`)}</dl>`
        : nothing}
      ${e.text ? html`<p class="tl-text">${e.text}</p>` : nothing}
    </div>
  </li>`,
  )}</ol>`;
}

/** A settled operation held for review (a discrepancy with Stripe): its reason goes once a person says
 * what they did about it in Stripe. */
function acknowledgeForm(op: Operation, state: ActionState, csrf: string): Safe {
  return html`<form method="post" action="/console/operations/${op.id}/acknowledge" class="stack">
    <input type="hidden" name="csrf" value="${csrf}">
    <input type="hidden" name="review_reason" value="${op.review_reason ?? ''}">
    <h3>Acknowledge</h3>
    <p class="muted small">Its status stays ${op.status}. Deal with what the reason reports in Stripe first (refund a second charge, say), then say what you did.</p>
    <label for="note">What was done about it</label>
    <textarea id="note" name="note" required maxlength="1000" rows="3">${state.note ?? ''}</textarea>
    <button type="submit">Acknowledge</button>
  </form>`;
}

function actions(op: Operation, state: ActionState, csrf: string): Safe {
  const base = `/console/operations/${op.id}`;
  return html`<section class="panel actions" aria-labelledby="actions-title">
  <h2 id="actions-title">Actions</h2>
  <p class="muted small">Each action is checked again on the server and written to the audit trail under your name.</p>
  <form method="post" action="${base}/resolve" class="stack">
    <input type="hidden" name="csrf" value="${csrf}">
    <input type="hidden" name="review_reason" value="${op.review_reason ?? ''}">
    <input type="hidden" name="outcome" value="succeeded">
    <h3>Resolve as succeeded</h3>
    ${resolveSucceededField(op, state.externalId ?? op.external_id ?? '')}
    <button type="submit" class="good">Resolve as succeeded</button>
  </form>
  <form method="post" action="${base}/resolve" class="stack">
    <input type="hidden" name="csrf" value="${csrf}">
    <input type="hidden" name="review_reason" value="${op.review_reason ?? ''}">
    <input type="hidden" name="outcome" value="failed">
    <h3>Resolve as failed</h3>
    <label for="reason">Why nothing was charged <span class="help">refused while Stripe shows a charge that has not failed, or while search may lag</span></label>
    <textarea id="reason" name="reason" required maxlength="1000" rows="3">${state.reason ?? ''}</textarea>
    <button type="submit" class="bad">Resolve as failed</button>
  </form>
  <form method="post" action="${base}/requeue" class="stack">
    <input type="hidden" name="csrf" value="${csrf}">
    <h3>Requeue</h3>
    <p class="muted small">A new job for this same operation: the same idempotency key, so never a second charge. Skipped while a job, a lease or the outbox still drives it.</p>
    <button type="submit">Requeue</button>
  </form>
</section>`;
}
