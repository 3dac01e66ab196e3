// An operation's story, oldest first, from every kind of history outboxd keeps. Each source turns one
// kind of stored history into entries; another table of history is one more source read in queries.ts
// and listed in SOURCES.
import type { Operation } from '../engine/operation.ts';
import { duration } from './html.ts';
import { JOB_SEARCH_MS, type OperationRecord } from './queries.ts';

export type Tone = 'neutral' | 'good' | 'bad' | 'warn' | 'info';

export interface Entry {
  at: Date;
  /** created, relayed, claimed, call, flagged, acknowledged, settled, webhook, audit */
  kind: string;
  title: string;
  tone: Tone;
  /** Labelled facts, shown in order; empty values are left out. */
  facts: [label: string, value: string | number | null | undefined][];
  /** Free text a person reads whole (an error, a reason). */
  text?: string | null | undefined;
}

type Source = (op: Operation, record: OperationRecord, now: Date) => Entry[];

const TONE_OF_OUTCOME: Record<string, Tone> = {
  succeeded: 'good',
  failed: 'bad',
  ambiguous: 'warn',
  needs_review: 'bad',
  rate_limited: 'info',
  not_executed: 'info',
  processing: 'info',
};

/** A repeated event's count in its title, and when it last happened among its facts. */
const times = (e: { repeats: number }): string => (e.repeats > 1 ? ` (${e.repeats} times)` : '');
const lastSeen = (e: { repeats: number; last_at: Date | null }): [string, string | null] => ['last at', e.repeats > 1 && e.last_at ? e.last_at.toISOString() : null];

const created: Source = (op) => [
  { at: op.created_at, kind: 'created', title: `${op.kind} operation created`, tone: 'neutral', facts: [['order', op.order_id]] },
];

/** The rows the dispatcher, the sweep, resolutions and webhooks wrote as they acted. A call is one row,
 * written with its outcome (releases before wrote a `sent` row too, paired with it here by fence and
 * attempt). A call with no outcome was in flight when its worker stopped or lost its lease: the claim
 * that took the lease over counted it (`unanswered`), and a call in flight now is the lease's. */
const history: Source = (op, record, now) => {
  const entries: Entry[] = [];
  const sent = new Map<string, (typeof record.events)[number]>();
  const outcomes = new Map<string, (typeof record.events)[number]>();
  // Calls counted (attempts) that no row accounts for: answered by an outcome, counted by a takeover, or
  // shown as sent with none (a release before one row per call).
  let unaccounted = op.attempts;
  for (const e of record.events) {
    if (e.type === 'sent') sent.set(`${e.fence}:${e.details.attempt}`, e);
    if (e.type === 'outcome') outcomes.set(`${e.fence}:${e.details.attempt}`, e);
    if (e.type === 'claimed') unaccounted -= Number(e.details.unanswered ?? 0);
  }
  for (const e of record.events) {
    if (e.type === 'outcome') unaccounted -= e.repeats;
    if (e.type === 'sent' && !outcomes.has(`${e.fence}:${e.details.attempt}`)) unaccounted -= 1;
  }
  const leaseLive = op.lease_owner !== null && op.lease_expires_at !== null && op.lease_expires_at > now;
  const settledUnder = new Set(record.events.filter((e) => e.type === 'settled').map((e) => e.fence));
  const resolution = (e: (typeof record.events)[number]) =>
    settledUnder.has(e.fence) ? 'claimed by a resolution, to check the evidence'
      : leaseLive && e.fence === op.fence ? 'claimed by a resolution, checking the evidence now'
      : 'claimed by a resolution that settled nothing (its evidence check refused, or failed)';
  const call = (at: Date, d: Record<string, string | number | null | undefined>, fence: number | null, outcome: (typeof record.events)[number]): Entry => {
    const o = outcome.details as Record<string, string | number | null | undefined>;
    return {
      at,
      kind: 'call',
      title: `${d.call} → ${o.outcome}${times(outcome)}`,
      tone: TONE_OF_OUTCOME[String(o.outcome)] ?? 'neutral',
      facts: [
        ['attempt', d.attempt],
        ['fence', fence],
        ['by', outcome.actor],
        ['duration', duration(o.duration_ms as number | null)],
        ['Stripe request', o.request_id],
        ['Stripe object', o.external_id],
        ['status', o.from === o.to ? `${o.to}` : `${o.from} → ${o.to}`],
        lastSeen(outcome),
      ],
      text: o.error as string | null,
    };
  };
  for (const e of record.events) {
    const d = e.details as Record<string, string | number | null | undefined>;
    switch (e.type) {
      case 'relayed':
        entries.push({ at: e.at, kind: 'relayed', title: 'relayed from the outbox to a job', tone: 'neutral', facts: [] });
        break;
      case 'claimed': {
        const unanswered = Number(d.unanswered ?? 0);
        entries.push({
          at: e.at,
          kind: 'claimed',
          title: d.previous_owner
            ? 'claimed, taking over an expired lease'
            : e.actor?.startsWith('resolve:') ? resolution(e) : 'claimed',
          tone: d.previous_owner ? 'warn' : 'neutral',
          facts: [['fence', e.fence], ['owner', e.actor], ['took over from', d.previous_owner], ['calls with no outcome', unanswered || null]],
          text: unanswered > 0
            ? `${unanswered === 1 ? 'a call' : `${unanswered} calls`} by ${d.previous_owner} recorded no outcome: it stopped or lost its lease during the call, and whether it reached Stripe is unknown`
            : null,
        });
        break;
      }
      case 'sent': {
        const outcome = outcomes.get(`${e.fence}:${d.attempt}`);
        const inFlight = !outcome && leaseLive && e.fence === op.fence;
        if (outcome) {
          entries.push(call(e.at, d, e.fence, outcome));
          break;
        }
        entries.push({
          at: e.at,
          kind: 'call',
          title: inFlight ? `${d.call} in flight` : `${d.call} sent, no outcome recorded`,
          tone: inFlight ? 'info' : 'warn',
          facts: [['attempt', d.attempt], ['fence', e.fence]],
          text: inFlight ? 'the lease is held: the call may still be running' : 'the worker stopped or lost its lease during the call: whether it reached Stripe is unknown',
        });
        break;
      }
      case 'outcome':
        // Shown with its `sent` row where a release before one row per call wrote one; at the time it was sent.
        if (!sent.has(`${e.fence}:${d.attempt}`)) entries.push(call(new Date(e.at.getTime() - Number(d.duration_ms ?? 0)), d, e.fence, e));
        break;
      case 'flagged':
        entries.push({ at: e.at, kind: 'flagged', title: `held for review${times(e)}`, tone: 'bad', facts: [['fence', e.fence], lastSeen(e)], text: String(d.reason ?? '') });
        break;
      case 'acknowledged':
        entries.push({ at: e.at, kind: 'acknowledged', title: `review reason acknowledged by ${e.actor}`, tone: 'info', facts: [['reason', d.reason]], text: String(d.note ?? '') });
        break;
      case 'settled':
        entries.push({
          at: e.at,
          kind: 'settled',
          title: `settled ${d.status} by ${e.actor === 'resolved_by_admin' ? 'a resolution' : e.actor?.startsWith('webhook:') ? 'a Stripe webhook' : e.actor}`,
          tone: d.status === 'succeeded' ? 'good' : 'bad',
          facts: [['source', e.actor], ['fence', e.fence], ['Stripe object', d.external_id]],
          text: d.reason ? String(d.reason) : null,
        });
        break;
      default:
        entries.push({ at: e.at, kind: e.type, title: e.type, tone: 'neutral', facts: [['fence', e.fence], ['by', e.actor]], text: JSON.stringify(e.details) });
    }
  }
  // Under a live lease, the last call counted and not answered is in flight now; any other was cut off
  // with no claim taking its lease over (something settled or resolved the operation meanwhile).
  if (unaccounted > 0) {
    const inFlight = leaseLive ? 1 : 0;
    const at = op.updated_at;
    if (inFlight) entries.push({ at, kind: 'call', title: 'call in flight', tone: 'info', facts: [['attempt', op.attempts], ['fence', op.fence], ['owner', op.lease_owner]], text: 'the lease is held: the call may still be running' });
    const lost = unaccounted - inFlight;
    if (lost > 0) entries.push({ at, kind: 'call', title: `${lost === 1 ? 'a call' : `${lost} calls`} with no outcome recorded`, tone: 'warn', facts: [], text: 'whether it reached Stripe is unknown' });
  }
  return entries;
};

const webhooks: Source = (_op, record) =>
  record.webhooks.map((w) => {
    // The inbox keeps the object it retrieved: a PaymentIntent for a charge, a Refund for a refund.
    type Retrieved = { id?: string; status?: string } | null | undefined;
    const { payment_intent: pi, refund } = w.payload as { payment_intent?: Retrieved; refund?: Retrieved };
    const object = pi ?? refund;
    return {
      at: w.received_at,
      kind: 'webhook',
      title: `Stripe event ${w.type} → ${w.result}`,
      tone: w.result === 'settled' ? 'good' : w.result === 'mismatch' || w.result === 'contradiction' ? 'bad' : 'info',
      facts: [['event', w.id], ['Stripe object', object?.id], ['its status', object?.status]],
    };
  });

const audit: Source = (_op, record) =>
  record.audit.map((a) => {
    const d = a.details as Record<string, unknown>;
    const outcome = typeof d.outcome === 'string' ? ` as ${d.outcome}` : '';
    return {
      at: a.at,
      kind: 'audit',
      title: `${a.action}${outcome} by ${a.actor}`,
      tone: 'info',
      facts: [['job', typeof d.jobId === 'string' ? d.jobId : null], ['was', typeof d.previousStatus === 'string' ? d.previousStatus : null]],
      text: typeof d.reason === 'string' ? d.reason : typeof d.refused === 'string' ? `refused: ${d.refused}` : null,
    };
  });

/** Each settlement event's way to the application's onSettled handlers: while it waits for the unnamed
 * ones (its row, gone once one returned), each named subscriber's queue (`settled.<name>`), the dead letter,
 * and the queue `settled` of an earlier release. */
const settlements: Source = (op, record) => [
  ...record.waitingEvents.map((w): Entry => ({
    at: w.created_at,
    kind: 'settlement',
    title: w.last_error === null ? 'settlement event waiting for onSettled' : `settlement event waiting for onSettled, which failed ${w.attempts} time${w.attempts === 1 ? '' : 's'}`,
    tone: w.last_error === null ? 'info' : 'bad',
    facts: [['event', w.id], ['deliveries begun', w.attempts], ['next delivery from', w.not_before.toISOString()]],
    text: w.last_error,
  })),
  ...(record.settlements === undefined
    ? [
        {
          at: op.settled_at ?? op.updated_at,
          kind: 'settlement',
          title: 'settlement event jobs not searched',
          tone: 'warn',
          facts: [],
          text: `pg-boss's jobs could not be searched for this operation within ${JOB_SEARCH_MS / 1000} s (its subscribers' queues keep many): their deliveries are not shown`,
        } satisfies Entry,
      ]
    : []),
  ...(record.settlements ?? []).flatMap((j): Entry[] => {
    const dead = j.name === 'settled_dead';
    const to = j.name.startsWith('settled.') ? `subscriber ${j.name.slice('settled.'.length)}` : 'onSettled';
    const facts: Entry['facts'] = [['event job', j.id], ['settled by', j.source], ['handler retries', j.retry_count]];
    const queued: Entry = { at: j.created_on, kind: 'settlement', title: dead ? 'settlement event dead-lettered (handlers kept failing)' : `settlement event queued for ${to}`, tone: dead ? 'bad' : 'info', facts };
    if (dead || j.state !== 'completed' || !j.completed_on) return [queued];
    return [queued, { at: j.completed_on, kind: 'settlement', title: `settlement event delivered to ${to}`, tone: 'good', facts }];
  }),
];

const SOURCES: Source[] = [created, history, webhooks, audit, settlements];

export function timeline(op: Operation, record: OperationRecord, now = new Date()): Entry[] {
  return SOURCES.flatMap((source) => source(op, record, now)).sort((a, b) => a.at.getTime() - b.at.getTime());
}
