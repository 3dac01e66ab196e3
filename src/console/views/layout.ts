// The frame of every console page: header with navigation and search, the operator and sign-out, a
// skip link, and the one stylesheet and script (no inline script or style: the CSP forbids both).
import { html, nothing, type Fragment, type Safe } from '../html.ts';
import type { Session } from '../session.ts';

export interface Assets {
  css: string;
  js: string;
}

export type Section = 'overview' | 'review' | 'operations' | 'stuck' | 'drift' | 'search' | 'none';

export interface Frame {
  title: string;
  assets: Assets;
  /** Signed in: navigation, search and sign-out are shown. */
  session?: Session | undefined;
  section?: Section;
  /** What the search box holds. */
  query?: string;
  /** Operations held for review, shown beside the nav link. */
  reviewCount?: number;
}

const NAV: [Section, string, string, string][] = [
  ['overview', '/console/', 'Overview', 'o'],
  ['review', '/console/review', 'Review queue', 'r'],
  ['operations', '/console/operations', 'Operations', 'l'],
  ['stuck', '/console/requeue-stuck', 'Requeue stuck', 's'],
  ['drift', '/console/drift', 'Drift report', 'd'],
];

export function layout(frame: Frame, body: Fragment): Safe {
  const s = frame.session;
  return html`<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>${frame.title} · outboxd console</title>
<link rel="stylesheet" href="${frame.assets.css}">
<script src="${frame.assets.js}" defer></script>
</head>
<body>
<a class="skip" href="#main">Skip to content</a>
<header class="top">
  <a class="brand" href="/console/"><span class="logo" aria-hidden="true">◆</span> outboxd <span class="brand-sub">console</span></a>
  ${s
    ? html`<nav aria-label="Sections"><ul>
      ${NAV.map(
        ([key, href, label, shortcut]) =>
          html`<li><a href="${href}" data-key="${shortcut}"${key === frame.section ? html` aria-current="page"` : nothing}>${label}${key === 'review' && frame.reviewCount ? html` <span class="count" aria-label="${frame.reviewCount} waiting">${frame.reviewCount}</span>` : nothing}</a></li>`,
      )}
    </ul></nav>
    <form class="search" role="search" action="/console/search" method="get">
      <label for="q" class="visually-hidden">Search operations</label>
      <input id="q" name="q" type="search" value="${frame.query ?? ''}" placeholder="Operation id, order id, pi_… or re_…" autocomplete="off" spellcheck="false">
      <kbd class="hint" aria-hidden="true">/</kbd>
    </form>
    <div class="who">
      <span class="operator" title="Actions are audited as console:${s.operator}">${s.operator}</span>
      ${s.access === 'read' ? html`<span class="pill read-only" title="Signed in with ADMIN_READONLY_TOKEN">read-only</span>` : nothing}
      <form action="/console/sign-out" method="post">
        <input type="hidden" name="csrf" value="${s.csrfToken}">
        <button type="submit" class="link">Sign out</button>
      </form>
      ${s.access === 'act'
        ? html`<form action="/console/sign-out-everywhere" method="post">
        <input type="hidden" name="csrf" value="${s.csrfToken}">
        <button type="submit" class="link" title="Ends every console session, every operator's">Sign out everywhere</button>
      </form>`
        : nothing}
    </div>`
    : nothing}
</header>
<main id="main" tabindex="-1">
${body}
</main>
${s
  ? html`<footer class="keys" aria-label="Keyboard shortcuts"><kbd>/</kbd> search · <kbd>g</kbd> then <kbd>o</kbd> overview, <kbd>r</kbd> review, <kbd>l</kbd> operations, <kbd>s</kbd> stuck, <kbd>d</kbd> drift · <kbd>j</kbd>/<kbd>k</kbd> move through a table's rows, <kbd>Enter</kbd> opens</footer>`
  : nothing}
</body>
</html>`;
}

/** A notice at the top of a page: what an action did, or why it was refused. */
export function notice(kind: 'done' | 'refused' | 'error', text: Fragment): Safe {
  const label = kind === 'done' ? 'Done' : kind === 'refused' ? 'Refused' : 'Error';
  return html`<div class="notice notice-${kind}" role="${kind === 'done' ? 'status' : 'alert'}"><strong>${label}.</strong> ${text}</div>`;
}
