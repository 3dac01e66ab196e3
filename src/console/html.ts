// HTML for the console, escaped in exactly one place: the `html` tag escapes every interpolated value
// unless it is itself the output of `html` (a Safe fragment). Views are template functions built from
// it, so no view ever concatenates markup by hand, and a value from the database, Stripe or a request
// can only ever reach the page as text.

const ESCAPES: Record<string, string> = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };

export function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]!);
}

const brand = Symbol('safe html');

/** Markup that is already safe. Only this module can make one (`html`, `nothing`): the brand is not exported. */
export class Safe {
  readonly markup: string;
  constructor(token: typeof brand, markup: string) {
    if (token !== brand) throw new TypeError('Safe markup is made by html`…` only');
    this.markup = markup;
  }
  toString(): string {
    return this.markup;
  }
}

/** What a view may interpolate: text (escaped), numbers, fragments, lists of them; nothing renders as nothing. */
export type Fragment = Safe | string | number | bigint | null | undefined | false | Fragment[];

function render(value: Fragment): string {
  if (value === null || value === undefined || value === false) return '';
  if (value instanceof Safe) return value.markup;
  if (Array.isArray(value)) return value.map(render).join('');
  return escapeHtml(String(value));
}

export function html(strings: TemplateStringsArray, ...values: Fragment[]): Safe {
  let out = strings[0]!;
  for (let i = 0; i < values.length; i++) out += render(values[i]!) + strings[i + 1]!;
  return new Safe(brand, out);
}

export const nothing = new Safe(brand, '');

// ─── formatting: every value a person reads, in one style ───────────────────────────────────────────

const fractionDigits = new Map<string, number>();
/** Minor-unit digits of a currency (ISO 4217 as Intl knows it: eur 2, jpy 0, kwd 3). */
function digitsOf(currency: string): number {
  let d = fractionDigits.get(currency);
  if (d === undefined) {
    try {
      d = new Intl.NumberFormat('en', { style: 'currency', currency }).resolvedOptions().maximumFractionDigits ?? 2;
    } catch {
      d = 2;
    }
    fractionDigits.set(currency, d);
  }
  return d;
}

/** 2599 eur → "25.99 EUR": the amount as a person reads it, the code unambiguous. */
export function money(minor: number, currency: string): string {
  const digits = digitsOf(currency.toUpperCase());
  const major = (minor / 10 ** digits).toLocaleString('en', { minimumFractionDigits: digits, maximumFractionDigits: digits });
  return `${major} ${currency.toUpperCase()}`;
}

/** A time as UTC, to the second, the same everywhere: 2026-12-02 14:51:03. */
export function utc(at: Date): string {
  return at.toISOString().replace('T', ' ').slice(0, 19);
}

/** A span of seconds, short: 42 s, 7 min, 3 h 12 min, 4 d 2 h. */
export function span(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h} h ${m % 60} min`;
  return `${Math.floor(h / 24)} d ${h % 24} h`;
}

/** `<time>` with the UTC time shown and the age beside it. */
export function when(at: Date | null | undefined, now = new Date()): Safe {
  if (!at) return html`<span class="muted">—</span>`;
  return html`<time datetime="${at.toISOString()}">${utc(at)}</time> <span class="age">(${span((now.getTime() - at.getTime()) / 1000)} ago)</span>`;
}

/** A table's time: the age, with the UTC time in its title. */
export function ago(at: Date | null | undefined, now = new Date()): Safe {
  if (!at) return html`<span class="muted">—</span>`;
  return html`<time datetime="${at.toISOString()}" title="${utc(at)} UTC">${span((now.getTime() - at.getTime()) / 1000)} ago</time>`;
}

/** Milliseconds as a person reads a call's duration: 84 ms, 2.3 s. */
export function duration(ms: number | null | undefined): string {
  if (ms === null || ms === undefined) return '—';
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(1)} s`;
}
