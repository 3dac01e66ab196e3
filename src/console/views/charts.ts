// Charts as server-rendered SVG: no script and no inline style (the CSP allows neither), colours from
// the stylesheet by class. Each chart is one minute a column over a window of time, with its numbers
// in a <title> per column, so hovering (or a screen reader) gives the value the shape shows.
import { html, nothing, type Safe } from '../html.ts';

/** One series: a value per minute (null: nothing to show there). */
export interface Series {
  name: string;
  /** A class of the stylesheet's (`s-good`, `s-bad`, `s-p50`, …). */
  cls: string;
  values: (number | null)[];
}

export interface TimeChart {
  title: string;
  /** The first minute of the window. */
  from: Date;
  /** Stacked columns, bottom first. */
  bars?: Series[];
  lines?: Series[];
  /** A level to draw across, with its label (a budget). */
  limit?: { value: number; label: string } | undefined;
  /** How a value reads on the axis and in the titles. */
  format: (value: number) => string;
  /** Said when every value is zero or missing. */
  empty: string;
}

const W = 560;
const H = 150;
const PAD = { left: 46, right: 8, top: 8, bottom: 20 };
const plotW = W - PAD.left - PAD.right;
const plotH = H - PAD.top - PAD.bottom;
const round = (n: number) => Math.round(n * 10) / 10;

/** 1, 2 or 5 times a power of ten, at least `n`: a top for the axis that reads well. */
export function niceCeiling(n: number): number {
  if (!(n > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(n));
  return [1, 2, 5, 10].map((m) => m * p).find((c) => c >= n)!;
}

const hhmm = (d: Date) => d.toISOString().slice(11, 16);

export function timeChart(c: TimeChart): Safe {
  const bars = c.bars ?? [];
  const lines = c.lines ?? [];
  const minutes = Math.max(...[...bars, ...lines].map((s) => s.values.length), 1);
  const stacked = Array.from({ length: minutes }, (_, i) => bars.reduce((sum, s) => sum + (s.values[i] ?? 0), 0));
  const peak = Math.max(0, ...stacked, ...lines.flatMap((s) => s.values.map((v) => v ?? 0)), c.limit?.value ?? 0);
  const any = peak > 0 && (stacked.some((v) => v > 0) || lines.some((s) => s.values.some((v) => (v ?? 0) > 0)));
  const top = niceCeiling(peak);
  const step = plotW / minutes;
  const x = (i: number) => PAD.left + i * step;
  const y = (v: number) => PAD.top + plotH - (v / top) * plotH;
  const at = (i: number) => new Date(c.from.getTime() + i * 60_000);
  // A tick every half hour (or so that there are at most six).
  const every = Math.max(30, Math.ceil(minutes / 6 / 30) * 30);
  const ticks = Array.from({ length: minutes }, (_, i) => i).filter((i) => at(i).getUTCMinutes() % 30 === 0 && (at(i).getTime() / 60_000) % every === 0);

  const columns = Array.from({ length: minutes }, (_, i) => {
    let base = 0;
    const parts = bars.map((s) => {
      const v = s.values[i] ?? 0;
      const rect = v > 0 ? html`<rect class="${s.cls}" x="${round(x(i))}" y="${round(y(base + v))}" width="${round(Math.max(step - 0.6, 0.8))}" height="${round(y(base) - y(base + v))}"></rect>` : nothing;
      base += v;
      return rect;
    });
    const said = [...bars, ...lines].map((s) => `${s.name} ${s.values[i] == null ? '—' : c.format(s.values[i]!)}`).join(', ');
    return html`<g class="col"><title>${hhmm(at(i))} UTC: ${said}</title><rect class="hit" x="${round(x(i))}" y="${PAD.top}" width="${round(step)}" height="${plotH}"></rect>${parts}</g>`;
  });
  // A line through the minutes that have a value; a minute with none on either side is a dot.
  const paths = lines.map((s) => {
    const point = (i: number) => `${round(x(i) + step / 2)},${round(y(s.values[i]!))}`;
    const d = s.values.map((v, i) => (v == null ? '' : `${s.values[i - 1] == null ? 'M' : 'L'}${point(i)}`)).filter(Boolean).join(' ');
    const dots = s.values.flatMap((v, i) =>
      v != null && s.values[i - 1] == null && s.values[i + 1] == null ? [html`<circle class="${s.cls}" cx="${round(x(i) + step / 2)}" cy="${round(y(v))}" r="2.5"></circle>`] : [],
    );
    return d ? html`<path class="line ${s.cls}" d="${d}"></path>${dots}` : nothing;
  });
  const legend = [...bars, ...lines];
  return html`<figure class="chart">
  <figcaption>${c.title}${legend.length > 1 || c.limit ? html` <span class="legend">${legend.map((s) => html`<span class="key ${s.cls}">${s.name}</span>`)}${c.limit ? html`<span class="key s-limit">${c.limit.label}</span>` : nothing}</span>` : nothing}</figcaption>
  <svg viewBox="0 0 ${W} ${H}" role="img" aria-label="${c.title}, the last ${Math.round(minutes / 60)} hours by minute">
    ${[0, 0.5, 1].map((f) => html`<line class="grid" x1="${PAD.left}" x2="${W - PAD.right}" y1="${round(y(top * f))}" y2="${round(y(top * f))}"></line><text class="axis" x="${PAD.left - 4}" y="${round(y(top * f) + 3)}" text-anchor="end">${c.format(top * f)}</text>`)}
    ${ticks.map((i) => html`<text class="axis" x="${round(x(i))}" y="${H - 5}" text-anchor="middle">${hhmm(at(i))}</text>`)}
    ${columns}
    ${paths}
    ${c.limit ? html`<line class="limit" x1="${PAD.left}" x2="${W - PAD.right}" y1="${round(y(c.limit.value))}" y2="${round(y(c.limit.value))}"></line>` : nothing}
    ${any ? nothing : html`<text class="empty-note" x="${PAD.left + plotW / 2}" y="${PAD.top + plotH / 2}" text-anchor="middle">${c.empty}</text>`}
  </svg>
</figure>`;
}

/** The tone of a recorded outcome, as the stylesheet colours it. */
const OUTCOME_CLASS: Record<string, string> = { succeeded: 's-good', failed: 's-bad', rate_limited: 's-info', unknown: 's-warn', needs_review: 's-bad' };

/**
 * An operation's attempts on one line of time, from its creation to its settlement (or now): a mark per
 * call sent, a dot per outcome recorded, coloured by what it said.
 */
export function attemptsChart(
  op: { created_at: Date; settled_at: Date | null },
  events: { at: Date; type: string; details: Record<string, unknown> }[],
  now: Date,
): Safe {
  // One row per call, written with its outcome: sent its duration before.
  const marks = events
    .filter((e) => e.type === 'outcome')
    .flatMap((e) => [{ ...e, type: 'sent', at: new Date(e.at.getTime() - (Number(e.details.duration_ms) || 0)) }, e])
    .sort((a, b) => a.at.getTime() - b.at.getTime());
  if (marks.length === 0) return nothing;
  const w = 560;
  const h = 46;
  const start = op.created_at.getTime();
  const end = Math.max((op.settled_at ?? now).getTime(), ...marks.map((e) => e.at.getTime()), start + 1);
  const x = (d: Date) => round(12 + ((d.getTime() - start) / (end - start)) * (w - 24));
  const stamp = (d: Date) => d.toISOString().slice(11, 23);
  return html`<figure class="chart chart-small">
  <figcaption>Attempts <span class="legend"><span class="key s-good">succeeded</span><span class="key s-warn">unknown</span><span class="key s-bad">failed</span><span class="key s-info">429</span></span></figcaption>
  <svg viewBox="0 0 ${w} ${h}" role="img" aria-label="Calls sent and their outcomes over the operation's life">
    <line class="grid" x1="12" x2="${w - 12}" y1="26" y2="26"></line>
    <text class="axis" x="12" y="42">${stamp(op.created_at)} created</text>
    <text class="axis" x="${w - 12}" y="42" text-anchor="end">${op.settled_at ? `${stamp(op.settled_at)} settled` : `${stamp(now)} now`}</text>
    ${marks.map((e) =>
      e.type === 'sent'
        ? html`<g class="col"><title>${stamp(e.at)} UTC: ${String(e.details.call ?? 'call')} sent</title><line class="line s-p50" x1="${x(e.at)}" x2="${x(e.at)}" y1="14" y2="38"></line></g>`
        : html`<g class="col"><title>${stamp(e.at)} UTC: ${String(e.details.outcome ?? 'outcome')}</title><circle class="${OUTCOME_CLASS[String(e.details.outcome)] ?? 's-neutral'}" cx="${x(e.at)}" cy="26" r="5"></circle></g>`,
    )}
  </svg>
</figure>`;
}
