// What the console's pages read. Every list is a keyset page over (created_at, id), newest first, so a
// page costs the same on the first page as on the ten-thousandth and with a million operations
// (EXPLAIN in docs/runbook.md, "Console").
import { SETTLED_DEAD_QUEUE, SETTLED_EVENT, SETTLED_QUEUE } from '../outbox/settlements.ts';
import type { PgBoss } from 'pg-boss';
import { listAudit, type AuditRow } from '../admin/audit.ts';
import { inTransaction, type Pool } from '../db/pool.ts';
import { OPERATION_STATUSES } from '../types/status.ts';
import { queueFor } from '../outbox/outbox.ts';
import { isOperationId, type ListedOperation, type Operation } from '../engine/operation.ts';
import type { HostHealth } from '../telemetry/metrics.ts';

export type Listed = ListedOperation & { cursor_at: string };

export interface ListFilter {
  status?: string | undefined;
  kind?: string | undefined;
  needsReview?: boolean;
}

/** A position in a list: strictly before (older than) or after (newer than) an operation. */
export interface Cursor {
  direction: 'before' | 'after';
  at: string;
  id: string;
}

export interface Page {
  rows: Listed[];
  /** Cursors of the neighbouring pages, when they hold anything. */
  older: string | undefined;
  newer: string | undefined;
}

/** `2026-12-02T14:51:03.123456Z~<uuid>`: created_at to the microsecond, then the id. */
const CURSOR_TEXT = /^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z)~([0-9a-f-]{36})$/;

export function parseCursor(direction: 'before' | 'after', text: string | null): Cursor | undefined {
  const m = text ? CURSOR_TEXT.exec(text) : null;
  if (!m || !isOperationId(m[2]!)) return undefined;
  return { direction, at: m[1]!, id: m[2]! };
}

const cursorOf = (row: Listed) => `${row.cursor_at}~${row.id}`;

export const STATUSES: readonly string[] = OPERATION_STATUSES;

export async function operationKinds(pool: Pool): Promise<string[]> {
  return (await pool.query(pool.sql.operationKinds())).rows.map((r: { kind: string }) => r.kind);
}

/**
 * One page of `size` operations matching `filter`, newest first, from `cursor` on (the newest page
 * without one). One row more than the page is read on the cursor's side, to know whether a further
 * page exists; the other side has one if the cursor came from it.
 */
export async function listPage(pool: Pool, filter: ListFilter, size: number, cursor: Cursor | undefined, kinds: string[]): Promise<Page> {
  const kindList = filter.kind ? [filter.kind] : kinds;
  const statusList = filter.status ? [filter.status] : [...STATUSES];
  const newer = cursor?.direction === 'after';
  const at = cursor?.at ?? (newer ? '-infinity' : 'infinity');
  const id = cursor?.id ?? (newer ? '00000000-0000-0000-0000-000000000000' : 'ffffffff-ffff-ffff-ffff-ffffffffffff');
  const sql = pool.sql;
  const statement = filter.needsReview ? (newer ? sql.reviewNewer : sql.reviewOlder) : newer ? sql.operationsNewer : sql.operationsOlder;
  const { rows } = await pool.query(statement(kindList, statusList, at, id, size + 1));
  const more = rows.length > size;
  const page: Listed[] = rows.slice(0, size);
  if (newer) page.reverse();
  const first = page[0];
  const last = page[page.length - 1];
  return {
    rows: page,
    older: last && (newer ? cursor !== undefined : more) ? cursorOf(last) : undefined,
    newer: first && (newer ? more : cursor !== undefined) ? cursorOf(first) : undefined,
  };
}

export interface Overview {
  /** Unsettled operations now, settled ones of the last 24 hours. */
  counts: { kind: string; status: string; n: number }[];
  /** Every operation: counted when few, else as the planner estimates (a count would read them all). */
  total: { n: number; exact: boolean };
  needsReview: number;
  oldestUnsettledSeconds: number | null;
  outboxRows: number;
  /** pg-boss's counts of each kind's queue, for every kind with operations (as its last monitor pass
   * saw them); null when they could not be read. */
  queues: { kind: string; queued: number; active: number; failed: number }[] | null;
  review: (ListedOperation & { flagged_at: Date | null })[];
  recent: ListedOperation[];
  /** The fleet's Stripe budget: requests/s configured (undefined: none), and each bucket's state. */
  budget: { limit: number | undefined; searchLimit: number | undefined; buckets: { name: string; tokens: number; short_seconds_ago: number | null }[] };
  /** The host database's xmin horizon and dead rows (as /metrics reports them); null when unreadable. */
  host: HostHealth | null;
}

/** The overview's figures (consoleOverview): its counts read a day of settlements, which grows with the
 * fleet's throughput, so the console shares one read between its views for a while (sharedFor). */
export const overviewFigures = (pool: Pool): Promise<Record<string, any>> => pool.query(pool.sql.consoleOverview()).then((r) => r.rows[0]);

/** What `read` gives, shared by every caller for `ms` from when it was asked: a page left to reload, or
 * many operators at once, cost the database one read per `ms`. A read that failed is not kept. */
export function sharedFor<T>(ms: number, read: (now: Date) => Promise<T>): (now: Date) => Promise<T> {
  let kept: { at: number; read: Promise<T> } | undefined;
  return (now) => {
    if (!kept || now.getTime() - kept.at > ms) {
      const reading = read(now);
      kept = { at: now.getTime(), read: reading };
      reading.catch(() => kept?.read === reading && (kept = undefined));
    }
    return kept.read;
  };
}

export async function overview(
  pool: Pool,
  boss: PgBoss,
  limits: { rateLimit: number | undefined; searchRateLimit: number | undefined },
  figuresRead: Promise<Record<string, any>> = overviewFigures(pool),
): Promise<Overview> {
  const [f, review, recent, queues, buckets, host] = await Promise.all([
    figuresRead,
    reviewQueue(pool, 5),
    pool.query(pool.sql.recentSettlements(10)),
    queuesOfKinds(pool, boss).catch(() => null),
    pool.query(pool.sql.rateBudgetStates()),
    pool.query(pool.sql.hostHealth()).then((r) => r.rows[0] as HostHealth, () => null),
  ]);
  return {
    counts: f.counts,
    total: { n: f.total, exact: f.total_exact },
    needsReview: f.needs_review,
    oldestUnsettledSeconds: f.oldest_unsettled_seconds,
    outboxRows: f.outbox_rows,
    queues,
    review,
    recent: recent.rows,
    budget: { limit: limits.rateLimit, searchLimit: limits.searchRateLimit, buckets: buckets.rows },
    host,
  };
}

/** The overview's charts: a value a minute, oldest first, over the last `hours`. */
export interface Charts {
  from: Date;
  succeeded: number[];
  failed: number[];
  p50Ms: (number | null)[];
  p95Ms: (number | null)[];
  /** Seconds; 0 where nothing was unsettled. */
  oldestUnsettled: number[];
  gatewayCalls: number[];
  rateLimited: number[];
}

/** A call the budget refused (src/stripe/budgetedGateway.ts) as the executor records its error
 * (`<error class>[ <HTTP status>]: <message>`, src/engine/executor.ts): never sent, so no call. */
const NOT_SENT = 'RetryLater: not sent:%';

export const CHART_HOURS = 3;

export async function overviewCharts(pool: Pool, now: Date, hours = CHART_HOURS): Promise<Charts> {
  const minutes = hours * 60;
  const from = new Date(Math.floor(now.getTime() / 60_000) * 60_000 - (minutes - 1) * 60_000);
  const [settled, oldest, calls] = await Promise.all([
    pool.query(pool.sql.settlementsByMinute(from)),
    pool.query(pool.sql.oldestUnsettledByMinute(from)),
    pool.query(pool.sql.gatewayCallsByMinute(from, NOT_SENT)),
  ]);
  const series = <T>(fill: T) => Array.from({ length: minutes }, () => fill);
  const charts: Charts = {
    from,
    succeeded: series(0),
    failed: series(0),
    p50Ms: series(null),
    p95Ms: series(null),
    oldestUnsettled: series(0),
    gatewayCalls: series(0),
    rateLimited: series(0),
  };
  /** Each row's minute as an index into the series; rows outside the window (clocks apart) are left out. */
  const each = (rows: { minute: Date }[], put: (i: number, row: any) => void) => {
    for (const row of rows) {
      const i = Math.round((row.minute.getTime() - from.getTime()) / 60_000);
      if (i >= 0 && i < minutes) put(i, row);
    }
  };
  each(settled.rows, (i, r) => {
    charts.succeeded[i] = r.succeeded;
    charts.failed[i] = r.failed;
    charts.p50Ms[i] = r.p50_ms;
    charts.p95Ms[i] = r.p95_ms;
  });
  each(oldest.rows, (i, r) => (charts.oldestUnsettled[i] = r.age_seconds));
  each(calls.rows, (i, r) => {
    charts.gatewayCalls[i] = r.calls;
    charts.rateLimited[i] = r.rate_limited ?? 0;
  });
  return charts;
}

async function queuesOfKinds(pool: Pool, boss: PgBoss): Promise<Overview['queues']> {
  const kinds = await operationKinds(pool);
  const queues = await boss.getQueues(kinds.map(queueFor));
  return kinds.flatMap((kind) => {
    const q = queues.find((x) => x.name === queueFor(kind));
    return q ? [{ kind, queued: q.queuedCount, active: q.activeCount, failed: q.failedCount }] : [];
  });
}

export async function reviewQueue(pool: Pool, limit: number): Promise<(Listed & { flagged_at: Date | null })[]> {
  return (await pool.query(pool.sql.reviewQueue(limit))).rows;
}

export interface OperationRecord {
  /** repeats: how many times it happened (a repeated refusal is one row), last_at: the last time. */
  events: { id: number; at: Date; type: string; fence: number | null; actor: string | null; details: Record<string, unknown>; repeats: number; last_at: Date | null }[];
  webhooks: { id: string; type: string; received_at: Date; result: string; payload: Record<string, unknown> }[];
  audit: AuditRow[];
  /** Every other operation of the same order: a charge's refunds, a refund's charge, earlier charges. */
  related: ListedOperation[];
  /** Its settlement events on their way to the application as pg-boss jobs: the named subscribers'
   * (`settled.<name>`), the dead letter, and an earlier release's `settled`; undefined when they could not
   * be searched in JOB_SEARCH_MS. */
  settlements: { id: string; name: string; state: string; retry_count: number; created_on: Date; completed_on: Date | null; source: string | null; output: unknown }[] | undefined;
  /** Its settlement event while it waits for the unnamed onSettled handlers (settlement_outbox: gone once handled). */
  waitingEvents: { id: number; created_at: Date; attempts: number; not_before: Date; last_error: string | null }[];
}

/** A timeline longer than this is cut (a stuck operation retried for days): its newest part is what matters least. */
export const HISTORY_LIMIT = 1000;

/** How long an operation's page searches pg-boss's jobs for its settlement events. They are found by
 * their data (pg-boss indexes no such field), among every job each subscriber's queue keeps (its completed
 * ones for days): at a high rate, millions, whose scan would hold the page and a database core up to the
 * statement timeout, on every view. Past this, the page says they were not searched. */
export const JOB_SEARCH_MS = 2_000;

/** The operation's settlement events among pg-boss's jobs, or undefined when that took longer than JOB_SEARCH_MS. */
async function settlementJobsOf(pool: Pool, op: Operation): Promise<OperationRecord['settlements']> {
  const { rows } = await pool.query(pool.sql.settlementSubscriberQueues(SETTLED_EVENT));
  const queues = [SETTLED_QUEUE, SETTLED_DEAD_QUEUE, ...rows.map((r: { name: string }) => r.name)];
  try {
    return await inTransaction(pool, async (tx) => {
      await tx.query(`select set_config('statement_timeout', $1, true)`, [String(JOB_SEARCH_MS)]);
      return (await tx.query(tx.sql.settlementEventsOf(op.id, queues, HISTORY_LIMIT))).rows;
    });
  } catch (err) {
    // query_canceled: the statement timeout (or a lock it waited for past it).
    if ((err as { code?: string } | null)?.code === '57014') return undefined;
    throw err;
  }
}

export async function operationRecord(pool: Pool, op: Operation): Promise<OperationRecord> {
  const [events, webhooks, audit, related, settlements, waiting] = await Promise.all([
    pool.query(pool.sql.operationEvents(op.id, HISTORY_LIMIT)),
    pool.query(pool.sql.webhookEventsOf(op.id, HISTORY_LIMIT)),
    listAudit(pool, { operationId: op.id, limit: HISTORY_LIMIT }),
    op.order_id === null ? { rows: [] } : pool.query(pool.sql.operationsOfOrder(op.order_id, 50)),
    settlementJobsOf(pool, op),
    pool.query(pool.sql.settlementEventOf(op.id)),
  ]);
  return {
    events: events.rows,
    webhooks: webhooks.rows,
    audit,
    related: related.rows.filter((r: ListedOperation) => r.id !== op.id),
    settlements,
    waitingEvents: waiting.rows,
  };
}

export interface SearchResult {
  query: string;
  matches: ListedOperation[];
  /** How the query was read, for the page to say. */
  readAs: string[];
}

const SEARCH_LIMIT = 50;

/**
 * An operation id (whole, or a prefix of 8+ hex digits), an order id, or a Stripe id (pi_…, re_…, any
 * `xx_…` the external_id holds). Each reading that fits is tried; the page lists what they found.
 */
export async function search(pool: Pool, text: string): Promise<SearchResult> {
  const query = text.trim().slice(0, 255);
  const readAs: string[] = [];
  const found = new Map<string, ListedOperation>();
  const add = (rows: ListedOperation[]) => rows.forEach((r) => found.set(r.id, r));
  if (!query) return { query, matches: [], readAs };
  const hex = query.toLowerCase().replaceAll('-', '');
  if (isOperationId(query)) {
    readAs.push('operation id');
    add((await pool.query(pool.sql.showOperation(query.toLowerCase()))).rows);
  } else if (/^[0-9a-f]{8,32}$/.test(hex)) {
    readAs.push('operation id prefix');
    add((await pool.query(pool.sql.operationsByIdPrefix(hex, SEARCH_LIMIT))).rows);
  }
  if (/^[a-z]{2,5}_[A-Za-z0-9_]+$/.test(query)) {
    readAs.push('Stripe id');
    add((await pool.query(pool.sql.operationsByExternalId(query, SEARCH_LIMIT))).rows);
  }
  readAs.push('order id');
  add((await pool.query(pool.sql.operationsOfOrder(query, SEARCH_LIMIT))).rows);
  return { query, matches: [...found.values()], readAs };
}
