// A stateful Stripe emulator for PaymentIntents and their refunds, driven by the real `stripe` SDK over HTTP. It keeps
// what makes payments hard to get right: an idempotency layer that stores the first result of a key
// (500s included) and replays it byte for byte, 409 while a key executes, key expiry on a controllable
// clock, a search index that lags, and faults injected before or after the charge commits.
//
// EmulatorServer speaks HTTP over an EmulatorState (state.ts): StripeEmulator keeps it in memory and is
// the synchronous handle tests, chaos and the demo drive; the runtime serves a PgState, one ledger per
// data directory shared by every outboxd process on it (docs/emulator.md).
import { createHash, randomBytes } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import Stripe from 'stripe';
import { parseForm, type FormValue } from './form.ts';
import { matches, parseSearchQuery } from './search.ts';
import {
  ENDPOINTS,
  MemoryState,
  RATE_LIMIT_CODES,
  REFUND_STATUSES,
  heldByRefunds,
  type EmulatedEvent,
  type EmulatorState,
  type Endpoint,
  type Fault,
  type FaultRule,
  type LedgerEntry,
  type PaymentIntent,
  type RateLimitCode,
  type Refund,
  type RefundEntry,
  type RefundStatus,
  type StoredResponse,
  type WebhookTarget,
} from './state.ts';

export type { EmulatedEvent, Endpoint, Fault, FaultRule, LedgerEntry, PaymentIntent, Refund, RefundEntry, RefundStatus, WebhookTarget } from './state.ts';

export interface ServerOptions {
  /** How long a key's first result is kept (Stripe: at least 24 h). */
  idempotencyRetentionMs?: number;
  /** pm_card_processing PaymentIntents, and pending refunds, succeed this long after creation; unset:
   * only when settled. */
  processingSettleMs?: number;
  /** How many request log entries are kept (the oldest go first); unset: all. */
  requestLogLimit?: number;
}

export interface EmulatorOptions extends Omit<ServerOptions, 'requestLogLimit'> {
  /** How long after a write it becomes searchable. */
  searchLagMs?: number;
  /** Where to POST signed payment_intent.* and refund.* events (at least once: retried on failure). */
  webhooks?: WebhookTarget;
  /** The account's rate limit: requests/s across all requests, beyond which it answers 429 rate_limit. */
  rateLimit?: number;
}

export interface WebhookDelivery {
  eventId: string;
  type: string;
  attempt: number;
  status: number | 'error';
}

export interface RequestLogEntry {
  requestId: string;
  method: string;
  path: string;
  endpoint: Endpoint | 'list' | 'other';
  idempotencyKey: string | null;
  operationId: string | null;
  status: number | 'reset' | 'truncated' | 'hung';
  replayed: boolean;
  at: number;
}

/** Stripe's test payment methods, and what a confirmed off-session charge with each does. */
const DECLINES: Record<string, { code: string; decline_code?: string; message: string }> = {
  pm_card_chargeDeclined: { code: 'card_declined', decline_code: 'generic_decline', message: 'Your card was declined.' },
  pm_card_chargeDeclinedInsufficientFunds: {
    code: 'card_declined',
    decline_code: 'insufficient_funds',
    message: 'Your card has insufficient funds.',
  },
  pm_card_authenticationRequired: {
    code: 'authentication_required',
    message: 'Your card was declined. This transaction requires authentication.',
  },
};
const PROCESSING = 'pm_card_processing';
/** Stripe's test cards that succeed; any other payment method is unknown, as at Stripe. */
const SUCCEEDING = [
  'pm_card_visa', 'pm_card_visa_debit', 'pm_card_mastercard', 'pm_card_mastercard_debit', 'pm_card_mastercard_prepaid',
  'pm_card_amex', 'pm_card_discover', 'pm_card_diners', 'pm_card_jcb', 'pm_card_unionpay',
];
const PAYMENT_METHODS = new Set([...SUCCEEDING, ...Object.keys(DECLINES), PROCESSING]);

const EVENT_FOR_STATUS: Record<string, string> = {
  succeeded: 'payment_intent.succeeded',
  requires_payment_method: 'payment_intent.payment_failed',
  canceled: 'payment_intent.canceled',
  processing: 'payment_intent.processing',
};
export const SETTLE_STATUSES = ['succeeded', 'canceled', 'requires_payment_method'] as const;
export type SettleStatus = (typeof SETTLE_STATUSES)[number];
const FAULT_KINDS = new Set<Fault['kind']>(['error_before_commit', 'error_after_commit', 'lose_response_after_commit', 'rate_limit', 'latency', 'refund_status']);
const REFUND_REASONS = new Set(['duplicate', 'fraudulent', 'requested_by_customer']);

const DAY_MS = 24 * 60 * 60 * 1000;
const id = (prefix: string) => `${prefix}_${randomBytes(12).toString('hex')}`;

/** The HTTP side: Stripe's API under /v1 and the control API under /_emulator, over any state. */
export class EmulatorServer<S extends EmulatorState = EmulatorState> {
  protected readonly log: RequestLogEntry[] = [];
  protected readonly deliveries: WebhookDelivery[] = [];
  protected readonly state: S;
  private readonly opts: ServerOptions;
  private readonly retentionMs: number;
  private readonly sockets = new Set<Socket>();
  private server: Server | undefined;

  constructor(state: S, opts: ServerOptions = {}) {
    this.state = state;
    this.opts = opts;
    this.retentionMs = opts.idempotencyRetentionMs ?? DAY_MS;
  }

  async listen(port = 0, host = '127.0.0.1'): Promise<{ url: string; port: number }> {
    const server = createServer((req, res) => {
      this.route(req, res).catch((err: Error) => {
        if (!res.headersSent) this.sendRaw(res, 500, { error: { type: 'api_error', message: err.message } });
      });
    });
    server.on('connection', (s) => {
      this.sockets.add(s);
      s.on('close', () => this.sockets.delete(s));
    });
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(port, host, resolve);
    });
    this.server = server;
    const bound = (server.address() as { port: number }).port;
    return { url: `http://${host}:${bound}`, port: bound };
  }

  async close(): Promise<void> {
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }

  // ─── HTTP ────────────────────────────────────────────────────────────────────────────────────────

  private async route(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const url = new URL(req.url ?? '/', 'http://emulator');
    const body = await readBody(req);
    if (url.pathname.startsWith('/_emulator/')) return this.control(req.method!, url.pathname, body, res);

    const requestId = id('req');
    res.setHeader('Request-Id', requestId);
    res.setHeader('Stripe-Version', String(req.headers['stripe-version'] ?? '2025-01-01'));
    const entry: RequestLogEntry = {
      requestId,
      method: req.method!,
      path: url.pathname,
      endpoint: 'other',
      idempotencyKey: header(req, 'idempotency-key'),
      operationId: null,
      status: 0,
      replayed: false,
      at: await this.clock(),
    };
    this.log.push(entry);
    if (this.opts.requestLogLimit !== undefined && this.log.length > this.opts.requestLogLimit) this.log.shift();

    const apiKey = apiKeyOf(header(req, 'authorization'));
    if (!apiKey) {
      return this.respond(res, entry, 401, error('invalid_request_error', 'Invalid API Key provided.'));
    }
    // The account's limiter answers before anything else runs, the idempotency layer included.
    if (!(await this.state.admitRequest())) return this.respond(res, entry, 429, tooManyRequests('rate_limit'));
    const retrieve = /^\/v1\/payment_intents\/(pi_[A-Za-z0-9]+)$/.exec(url.pathname);
    const refund = /^\/v1\/refunds\/(re_[A-Za-z0-9]+)$/.exec(url.pathname);
    if (req.method === 'POST' && url.pathname === '/v1/payment_intents') {
      entry.endpoint = 'create';
      return this.create(apiKey, parseForm(body), res, entry);
    }
    if (req.method === 'GET' && url.pathname === '/v1/payment_intents/search') {
      entry.endpoint = 'search';
      return this.search(url, res, entry);
    }
    if (req.method === 'GET' && url.pathname === '/v1/payment_intents') {
      entry.endpoint = 'list';
      return this.list(url, res, entry);
    }
    if (req.method === 'GET' && retrieve) {
      entry.endpoint = 'retrieve';
      return this.retrieve(retrieve[1]!, res, entry);
    }
    if (req.method === 'POST' && url.pathname === '/v1/refunds') {
      entry.endpoint = 'create_refund';
      return this.createRefund(apiKey, parseForm(body), res, entry);
    }
    if (req.method === 'GET' && url.pathname === '/v1/refunds') {
      entry.endpoint = 'list_refunds';
      return this.listRefunds(url, res, entry);
    }
    if (req.method === 'GET' && refund) {
      entry.endpoint = 'retrieve_refund';
      return this.retrieveRefund(refund[1]!, res, entry);
    }
    return this.respond(res, entry, 404, error('invalid_request_error', `Unrecognized request URL (${req.method}: ${url.pathname}).`));
  }

  private async create(apiKey: string, params: Record<string, FormValue>, res: ServerResponse, entry: RequestLogEntry) {
    const metadata = isRecord(params.metadata) ? (params.metadata as Record<string, string>) : {};
    entry.operationId = metadata.operation_id ?? null;
    const key = entry.idempotencyKey;
    if (key !== null && key.length > 255) {
      return this.respond(res, entry, 400, error('invalid_request_error', 'Idempotency-Key must be at most 255 characters.'));
    }
    const faults = await this.state.takeFaults('create', entry.operationId, str(params.customer));
    if (await this.preflight(faults, res, entry)) return;
    // A request that fails validation executes nothing and stores nothing under its key.
    const invalid = validateCreate(params);
    if (invalid) return this.respond(res, entry, 400, error('invalid_request_error', invalid.message, { param: invalid.param, ...(invalid.code ? { code: invalid.code } : {}) }));

    const claimed = await this.claimKey(apiKey, JSON.stringify(params), res, entry, faults);
    if (!claimed) return;
    const { storeKey } = claimed;

    let committed = false;
    try {
      await this.latency(faults);
      // Commit: the charge exists from here on, whatever happens to the response.
      const now = await this.clock();
      const pi = newPaymentIntent(params, metadata, now);
      const afterCommit = faults.find((f) => f.kind === 'error_after_commit');
      const decline = DECLINES[pi.payment_method ?? ''];
      const response: StoredResponse = afterCommit
        ? { status: afterCommit.status, body: json(error('api_error', 'An unknown error occurred on our side.')) }
        : decline
          ? { status: 402, body: json(error('card_error', decline.message, { code: decline.code, ...(decline.decline_code ? { decline_code: decline.decline_code } : {}), payment_intent: pi })) }
          : { status: 200, body: json(pi) };
      await this.state.commit({ paymentIntent: pi, idempotencyKey: key, createdAtMs: now }, storeKey === null ? null : { storeKey, response });
      committed = true;
      await this.emit(pi);
      return this.deliver(res, entry, response, faults);
    } finally {
      if (!committed && storeKey !== null) await this.state.releaseKey(storeKey);
    }
  }

  /**
   * The idempotency layer in front of a create: the same key with other parameters is a 400, a key whose
   * first request still executes a 409, a key already done replays its first result. Undefined when
   * the request was answered here; otherwise the key to store the result under (null: no key).
   */
  private async claimKey(apiKey: string, request: string, res: ServerResponse, entry: RequestLogEntry, faults: Fault[]): Promise<{ storeKey: string | null } | undefined> {
    const key = entry.idempotencyKey;
    const storeKey = key === null ? null : JSON.stringify([apiKey, key]);
    if (storeKey === null) return { storeKey };
    const paramsHash = createHash('sha256').update(request).digest('hex');
    const claim = await this.state.claimKey(storeKey, paramsHash, await this.clock(), this.retentionMs);
    if (claim.kind === 'mismatch') {
      this.respond(res, entry, 400, error('idempotency_error',
        `Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '${key}' if you meant to execute a different request.`));
      return undefined;
    }
    if (claim.kind === 'executing') {
      this.respond(res, entry, 409, error('invalid_request_error',
        'There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): ' + key + '. Please try again later.',
        { code: 'idempotency_key_in_use' }));
      return undefined;
    }
    if (claim.kind === 'done') {
      entry.replayed = true;
      res.setHeader('Idempotent-Replayed', 'true');
      this.deliver(res, entry, claim.response, faults);
      return undefined;
    }
    return { storeKey };
  }

  /** POST /v1/refunds: a refund of a succeeded PaymentIntent, at most what it holds unrefunded. */
  private async createRefund(apiKey: string, params: Record<string, FormValue>, res: ServerResponse, entry: RequestLogEntry) {
    const metadata = isRecord(params.metadata) ? (params.metadata as Record<string, string>) : {};
    entry.operationId = metadata.operation_id ?? null;
    const key = entry.idempotencyKey;
    if (key !== null && key.length > 255) {
      return this.respond(res, entry, 400, error('invalid_request_error', 'Idempotency-Key must be at most 255 characters.'));
    }
    const piId = str(params.payment_intent);
    const pi = piId ? (await this.state.intent(piId))?.paymentIntent : undefined;
    const faults = await this.state.takeFaults('create_refund', entry.operationId, pi?.customer ?? null);
    if (await this.preflight(faults, res, entry)) return;
    const invalid = validateRefund(params, pi);
    if (invalid) return this.respond(res, entry, 400, error('invalid_request_error', invalid.message, { param: invalid.param, ...(invalid.code ? { code: invalid.code } : {}) }));

    // The key's parameters are the endpoint's too: a charge's key sent to refunds is a mismatch.
    const claimed = await this.claimKey(apiKey, JSON.stringify(['refunds', params]), res, entry, faults);
    if (!claimed) return;
    const { storeKey } = claimed;

    let committed = false;
    try {
      await this.latency(faults);
      const now = await this.clock();
      const held = heldByRefunds(await this.state.refunds(), pi!.id);
      const status = faults.find((f) => f.kind === 'refund_status')?.status ?? 'succeeded';
      const refund = newRefund(params, pi!, metadata, status, pi!.amount_received - held, now);
      const afterCommit = faults.find((f) => f.kind === 'error_after_commit');
      const response: StoredResponse = afterCommit
        ? { status: afterCommit.status, body: json(error('api_error', 'An unknown error occurred on our side.')) }
        : { status: 200, body: json(refund) };
      // Commit, only if it fits: the refund exists from here on, whatever happens to the response.
      const result = await this.state.commitRefund({ refund, idempotencyKey: key, createdAtMs: now }, storeKey === null ? null : { storeKey, response });
      if (!result.committed) {
        return result.remaining === 0
          ? this.respond(res, entry, 400, error('invalid_request_error', `PaymentIntent ${pi!.id} has already been refunded.`, { code: 'charge_already_refunded' }))
          : this.respond(res, entry, 400, error('invalid_request_error', `Refund amount (${refund.amount}) is greater than unrefunded amount on charge (${result.remaining})`, { code: 'amount_too_large', param: 'amount' }));
      }
      committed = true;
      await this.emitRefund('refund.created', refund);
      return this.deliver(res, entry, response, faults);
    } finally {
      if (!committed && storeKey !== null) await this.state.releaseKey(storeKey);
    }
  }

  private async retrieveRefund(refundId: string, res: ServerResponse, entry: RequestLogEntry) {
    const found = await this.state.refund(refundId);
    const customer = found ? ((await this.state.intent(found.refund.payment_intent))?.paymentIntent.customer ?? null) : null;
    const object = found && { operationId: found.refund.metadata.operation_id ?? null, customer, current: () => this.currentRefund(found) };
    return this.retrieveOne('retrieve_refund', object, res, entry, { message: `No such refund: '${refundId}'`, param: 'id' });
  }

  /** A GET of one object: its faults and latency, then the object as it is now, or Stripe's 404. */
  private async retrieveOne(
    endpoint: 'retrieve' | 'retrieve_refund',
    found: { operationId: string | null; customer: string | null; current: () => Promise<object> } | undefined,
    res: ServerResponse,
    entry: RequestLogEntry,
    missing: { message: string; param: string },
  ) {
    entry.operationId = found?.operationId ?? null;
    const faults = await this.state.takeFaults(endpoint, entry.operationId, found?.customer ?? null);
    if (await this.preflight(faults, res, entry)) return;
    await this.latency(faults);
    if (!found) return this.respond(res, entry, 404, error('invalid_request_error', missing.message, { code: 'resource_missing', param: missing.param }));
    return this.deliver(res, entry, { status: 200, body: json(await found.current()) }, faults);
  }

  /** GET /v1/refunds: newest first; `payment_intent`, `created[gte]`, `limit`, `starting_after` (a list: read-after-write). */
  private async listRefunds(url: URL, res: ServerResponse, entry: RequestLogEntry) {
    const paymentIntent = url.searchParams.get('payment_intent');
    const customer = paymentIntent ? ((await this.state.intent(paymentIntent))?.paymentIntent.customer ?? null) : null;
    const faults = await this.state.takeFaults('list_refunds', null, customer);
    if (await this.preflight(faults, res, entry)) return;
    await this.latency(faults);
    const all: Refund[] = [];
    for (const e of await this.state.refunds()) {
      if (paymentIntent === null || e.refund.payment_intent === paymentIntent) all.push(await this.currentRefund(e));
    }
    return this.deliver(res, entry, { status: 200, body: json(listPage(all, url, '/v1/refunds')) }, faults);
  }

  private async retrieve(piId: string, res: ServerResponse, entry: RequestLogEntry) {
    const found = await this.state.intent(piId);
    const object = found && { operationId: found.paymentIntent.metadata.operation_id ?? null, customer: found.paymentIntent.customer ?? null, current: () => this.current(found) };
    return this.retrieveOne('retrieve', object, res, entry, { message: `No such payment_intent: '${piId}'`, param: 'intent' });
  }

  private async search(url: URL, res: ServerResponse, entry: RequestLogEntry) {
    const query = url.searchParams.get('query') ?? '';
    let clauses;
    try {
      clauses = parseSearchQuery(query);
    } catch (err) {
      return this.respond(res, entry, 400, error('invalid_request_error', (err as Error).message, { param: 'query' }));
    }
    entry.operationId = clauses.find((c) => c.metadataKey === 'operation_id')?.value ?? null;
    const faults = await this.state.takeFaults('search', entry.operationId, clauses.find((c) => c.field === 'customer')?.value ?? null);
    if (await this.preflight(faults, res, entry)) return;
    await this.latency(faults);
    const limit = Math.min(Math.max(Number(url.searchParams.get('limit') ?? 10) || 10, 1), 100);
    const offset = decodePage(url.searchParams.get('page'));
    // Indexing lags writes by lagMs; while frozen (an outage) nothing newer than the freeze is indexed.
    const { lagMs, frozenAtMs } = await this.state.searchSettings();
    const indexedUntil = (frozenAtMs ?? (await this.clock())) - lagMs;
    const hits = (await this.currentAll((await this.state.intents()).filter((e) => e.createdAtMs <= indexedUntil)))
      .filter((pi) => matches(pi as unknown as Record<string, unknown>, clauses))
      .sort((a, b) => b.created - a.created || (a.id < b.id ? -1 : 1));
    const data = hits.slice(offset, offset + limit);
    const hasMore = offset + limit < hits.length;
    return this.deliver(res, entry, {
      status: 200,
      body: json({ object: 'search_result', data, has_more: hasMore, next_page: hasMore ? encodePage(offset + limit) : null, url: '/v1/payment_intents/search', total_count: hits.length }),
    }, faults);
  }

  /** GET /v1/payment_intents: newest first, `created[gte]`, `limit`, `starting_after` (a list, not a search: read-after-write). */
  private async list(url: URL, res: ServerResponse, entry: RequestLogEntry) {
    const all = await this.currentAll(await this.state.intents());
    return this.deliver(res, entry, { status: 200, body: json(listPage(all, url, '/v1/payment_intents')) }, []);
  }

  // ─── faults ──────────────────────────────────────────────────────────────────────────────────────

  /** Faults that answer before anything executes. True when the request was answered. */
  private async preflight(faults: Fault[], res: ServerResponse, entry: RequestLogEntry): Promise<boolean> {
    const limited = faults.find((f) => f.kind === 'rate_limit');
    if (limited) {
      this.respond(res, entry, 429, tooManyRequests(limited.code ?? 'rate_limit'));
      return true;
    }
    const before = faults.find((f) => f.kind === 'error_before_commit');
    if (before) {
      await this.latency(faults);
      this.respond(res, entry, before.status, error('api_error', 'An unknown error occurred on our side.'));
      return true;
    }
    return false;
  }

  private async latency(faults: Fault[]): Promise<void> {
    const l = faults.find((f) => f.kind === 'latency');
    if (l) await sleep(l.ms);
  }

  private deliver(res: ServerResponse, entry: RequestLogEntry, response: StoredResponse, faults: Fault[]) {
    const lose = faults.find((f) => f.kind === 'lose_response_after_commit');
    if (!lose) return this.send(res, entry, response.status, response.body);
    switch (lose.mode) {
      case 'reset':
        entry.status = 'reset';
        res.socket?.resetAndDestroy();
        return;
      case 'truncate':
        entry.status = 'truncated';
        res.writeHead(response.status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(response.body) });
        res.write(response.body.slice(0, Math.floor(response.body.length / 2)));
        setTimeout(() => res.socket?.destroy(), 5);
        return;
      case 'hang':
        entry.status = 'hung'; // never answered; the client's timeout ends it
        return;
    }
  }

  // ─── state ───────────────────────────────────────────────────────────────────────────────────────

  /** The emulator clock: the wall clock moved by advanceClock. */
  private async clock(): Promise<number> {
    return Date.now() + (await this.state.clockOffsetMs());
  }

  /** Moves a PaymentIntent to a final status, as Stripe does when `processing` finishes. */
  protected async settleIntent(paymentIntentId: string, status: SettleStatus): Promise<PaymentIntent> {
    if (!SETTLE_STATUSES.includes(status)) throw new Error(`status must be one of ${SETTLE_STATUSES.join(', ')}`);
    const pi = await this.state.setStatus(paymentIntentId, status);
    if (!pi) throw new Error(`no payment intent ${paymentIntentId}`);
    await this.emit(pi);
    return pi;
  }

  /** The PaymentIntent as of now: a processing one may have finished (processingSettleMs). */
  private async current(entry: LedgerEntry): Promise<PaymentIntent> {
    const settleMs = this.opts.processingSettleMs;
    if (entry.paymentIntent.status === 'processing' && settleMs !== undefined && (await this.clock()) - entry.createdAtMs >= settleMs) {
      return this.settleIntent(entry.paymentIntent.id, 'succeeded');
    }
    return entry.paymentIntent;
  }

  /** Moves a refund to a status, as Stripe does when a pending refund finishes (or fails). */
  protected async settleRefundEntry(refundId: string, status: RefundStatus): Promise<Refund> {
    if (!REFUND_STATUSES.includes(status)) throw new Error(`status must be one of ${REFUND_STATUSES.join(', ')}`);
    const refund = await this.state.setRefundStatus(refundId, status);
    if (!refund) throw new Error(`no refund ${refundId}`);
    await this.emitRefund(status === 'failed' ? 'refund.failed' : 'refund.updated', refund);
    return refund;
  }

  /** The refund as of now: a pending one may have finished (processingSettleMs). */
  private async currentRefund(entry: RefundEntry): Promise<Refund> {
    const settleMs = this.opts.processingSettleMs;
    if (entry.refund.status === 'pending' && settleMs !== undefined && (await this.clock()) - entry.createdAtMs >= settleMs) {
      return this.settleRefundEntry(entry.refund.id, 'succeeded');
    }
    return entry.refund;
  }

  private async currentAll(entries: LedgerEntry[]): Promise<PaymentIntent[]> {
    const out: PaymentIntent[] = [];
    for (const e of entries) out.push(await this.current(e));
    return out;
  }

  // ─── webhooks ────────────────────────────────────────────────────────────────────────────────────

  private async emit(pi: PaymentIntent): Promise<void> {
    const type = EVENT_FOR_STATUS[pi.status];
    const target = await this.state.webhooks();
    if (!type || !target) return;
    const event = newEvent(type, pi, await this.clock());
    await this.state.addEvent(event);
    this.scheduleDelivery(event, target);
  }

  private async emitRefund(type: string, refund: Refund): Promise<void> {
    const target = await this.state.webhooks();
    if (!target) return;
    const event = newEvent(type, refund, await this.clock());
    await this.state.addEvent(event);
    this.scheduleDelivery(event, target);
  }

  protected scheduleDelivery(event: EmulatedEvent, target: WebhookTarget): void {
    setTimeout(() => void this.deliverEvent(event, 1, true), target.delayMs ?? 0);
  }

  /** Sends an event again, as Stripe may: the receiver must acknowledge it without acting twice. */
  async redeliver(eventId: string): Promise<number | 'error'> {
    const event = await this.state.event(eventId);
    if (!event) throw new Error(`no event ${eventId}`);
    return this.deliverEvent(event, 1, false);
  }

  private async deliverEvent(event: EmulatedEvent, attempt: number, retry: boolean): Promise<number | 'error'> {
    const target = await this.state.webhooks();
    if (!target) return 'error';
    const payload = JSON.stringify(event);
    const signature = Stripe.webhooks.generateTestHeaderString({ payload, secret: target.secret });
    let status: number | 'error';
    try {
      const res = await fetch(target.url, { method: 'POST', headers: { 'Content-Type': 'application/json', 'Stripe-Signature': signature }, body: payload });
      status = res.status;
      await res.arrayBuffer();
    } catch {
      status = 'error';
    }
    this.deliveries.push({ eventId: event.id, type: event.type, attempt, status });
    if (this.opts.requestLogLimit !== undefined && this.deliveries.length > this.opts.requestLogLimit) this.deliveries.shift();
    const ok = typeof status === 'number' && status >= 200 && status < 300;
    if (!ok && retry && attempt < 3) setTimeout(() => void this.deliverEvent(event, attempt + 1, true), 200 * attempt);
    return status;
  }

  private respond(res: ServerResponse, entry: RequestLogEntry, status: number, body: object) {
    this.send(res, entry, status, json(body));
  }

  private send(res: ServerResponse, entry: RequestLogEntry, status: number, body: string) {
    entry.status = status;
    res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) });
    res.end(body);
  }

  // ─── control API: the emulator over HTTP, for other processes (chaos, demo, a person); docs/emulator.md

  private async control(method: string, path: string, body: string, res: ServerResponse): Promise<void> {
    const ok = (value: unknown = { ok: true }) => this.sendRaw(res, 200, value ?? { ok: true });
    const route = `${method} ${path}`;
    try {
      const input = body ? JSON.parse(body) : {};
      if (!isRecord(input)) throw new Error('the body must be a JSON object');
      if (route === 'GET /_emulator/ledger') {
        const entries = await this.state.intents();
        const current = await this.currentAll(entries);
        return ok(entries.map((e, i) => ({ ...e, paymentIntent: current[i] })));
      }
      if (route === 'GET /_emulator/refunds') {
        const entries = await this.state.refunds();
        const current: Refund[] = [];
        for (const e of entries) current.push(await this.currentRefund(e));
        return ok(entries.map((e, i) => ({ ...e, refund: current[i] })));
      }
      if (route === 'GET /_emulator/requests') return ok([...this.log]);
      if (route === 'POST /_emulator/faults') return ok({ id: await this.state.addFault(faultRule(input)) });
      if (route === 'DELETE /_emulator/faults') return ok(await this.state.clearFaults());
      if (route === 'POST /_emulator/clock/advance') return ok(await this.state.advanceClock(nonNegative(input.ms, 'ms')));
      if (route === 'POST /_emulator/keys/prune') {
        const olderThanMs = input.olderThanMs === undefined ? 0 : nonNegative(input.olderThanMs, 'olderThanMs');
        return ok({ pruned: await this.state.pruneKeys(olderThanMs, await this.clock()) });
      }
      if (route === 'POST /_emulator/search') {
        if (input.frozen !== undefined && typeof input.frozen !== 'boolean') throw new Error('frozen must be true or false');
        return ok(await this.state.configureSearch({
          ...(input.lagMs !== undefined ? { lagMs: nonNegative(input.lagMs, 'lagMs') } : {}),
          ...(input.frozen !== undefined ? { frozenAtMs: input.frozen ? await this.clock() : null } : {}),
        }));
      }
      if (route === 'POST /_emulator/reset') {
        this.log.length = 0;
        this.deliveries.length = 0;
        return ok(await this.state.reset());
      }
      if (route === 'POST /_emulator/webhooks') return ok(await this.state.configureWebhooks(webhookTarget(input)));
      if (route === 'POST /_emulator/rate-limit') return ok(await this.state.configureRateLimit(requestsPerSecond(input.requestsPerSecond)));
      if (route === 'GET /_emulator/events') return ok(await this.state.events());
      const settle = /^POST \/_emulator\/payment_intents\/(pi_\w+)\/settle$/.exec(route);
      if (settle) return ok(await this.settleIntent(settle[1]!, input.status as SettleStatus));
      const settleRefund = /^POST \/_emulator\/refunds\/(re_\w+)\/settle$/.exec(route);
      if (settleRefund) return ok(await this.settleRefundEntry(settleRefund[1]!, input.status as RefundStatus));
      return this.sendRaw(res, 404, { error: `no control route ${route}` });
    } catch (err) {
      return this.sendRaw(res, 400, { error: (err as Error).message });
    }
  }

  private sendRaw(res: ServerResponse, status: number, value: unknown) {
    const body = JSON.stringify(value);
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(body);
  }
}

/**
 * The emulator in memory, with a synchronous handle for tests, chaos and the demo: faults, the clock,
 * keys, settlement and the ledger are changed and read directly, between two requests.
 */
export class StripeEmulator extends EmulatorServer<MemoryState> {
  private readonly options: EmulatorOptions;

  constructor(options: EmulatorOptions = {}) {
    super(
      new MemoryState({
        ...(options.searchLagMs !== undefined ? { searchLagMs: options.searchLagMs } : {}),
        ...(options.webhooks ? { webhooks: options.webhooks } : {}),
        ...(options.rateLimit !== undefined ? { rateLimit: options.rateLimit } : {}),
      }),
      options,
    );
    this.options = options;
  }

  now(): number {
    return Date.now() + this.state.clockOffsetMs();
  }

  /** Moves the emulator's clock (key expiry, search lag, processing delay) forward. */
  advanceClock(ms: number): void {
    this.state.advanceClock(ms);
  }

  addFault(rule: FaultRule): string {
    return this.state.addFault(rule);
  }

  clearFaults(): void {
    this.state.clearFaults();
  }

  /** Forgets stored idempotency results at least `olderThanMs` old (all of them by default). */
  pruneKeys(olderThanMs = 0): number {
    return this.state.pruneKeys(olderThanMs, this.now());
  }

  settle(paymentIntentId: string, status: SettleStatus): PaymentIntent {
    const pi = this.state.setStatus(paymentIntentId, status);
    if (!pi) throw new Error(`no payment intent ${paymentIntentId}`);
    const type = EVENT_FOR_STATUS[pi.status];
    const target = this.state.webhooks();
    if (type && target) {
      const event = newEvent(type, pi, this.now());
      this.state.addEvent(event);
      this.scheduleDelivery(event, target);
    }
    return pi;
  }

  configureWebhooks(target: WebhookTarget | undefined): void {
    this.state.configureWebhooks(target);
  }

  /** The account's rate limit in requests/s across all requests; null: none. */
  setRateLimit(requestsPerSecond: number | null): void {
    this.state.configureRateLimit(requestsPerSecond);
  }

  /** Every event emitted, oldest first. */
  emittedEvents(): EmulatedEvent[] {
    return this.state.events();
  }

  webhookDeliveries(): WebhookDelivery[] {
    return [...this.deliveries];
  }

  configureSearch(opts: { lagMs?: number; frozen?: boolean }): void {
    this.state.configureSearch({
      ...(opts.lagMs !== undefined ? { lagMs: opts.lagMs } : {}),
      ...(opts.frozen !== undefined ? { frozenAtMs: opts.frozen ? this.now() : null } : {}),
    });
  }

  /** Back to a new emulator's state and options (the listener stays). */
  reset(): void {
    this.state.reset();
    this.log.length = 0;
    this.deliveries.length = 0;
  }

  /** Moves a refund to a status (a pending one finishes, or fails), with its event if webhooks are on. */
  settleRefund(refundId: string, status: RefundStatus): Refund {
    if (!REFUND_STATUSES.includes(status)) throw new Error(`status must be one of ${REFUND_STATUSES.join(', ')}`);
    const refund = this.state.setRefundStatus(refundId, status);
    if (!refund) throw new Error(`no refund ${refundId}`);
    const target = this.state.webhooks();
    if (target) {
      const event = newEvent(status === 'failed' ? 'refund.failed' : 'refund.updated', refund, this.now());
      this.state.addEvent(event);
      this.scheduleDelivery(event, target);
    }
    return refund;
  }

  /** Every refund ever created, oldest first, with the key it was created under. */
  refundLedger(): RefundEntry[] {
    const settleMs = this.options.processingSettleMs;
    return this.state.refunds().map((e) => {
      const due = e.refund.status === 'pending' && settleMs !== undefined && this.now() - e.createdAtMs >= settleMs;
      return { ...e, refund: due ? this.settleRefund(e.refund.id, 'succeeded') : e.refund };
    });
  }

  /** Every PaymentIntent ever created, oldest first, with the key it was created under. */
  ledger(): LedgerEntry[] {
    const settleMs = this.options.processingSettleMs;
    return this.state.intents().map((e) => {
      const due = e.paymentIntent.status === 'processing' && settleMs !== undefined && this.now() - e.createdAtMs >= settleMs;
      return { ...e, paymentIntent: due ? this.settle(e.paymentIntent.id, 'succeeded') : e.paymentIntent };
    });
  }

  requests(): RequestLogEntry[] {
    return [...this.log];
  }
}

function newPaymentIntent(params: Record<string, FormValue>, metadata: Record<string, string>, now: number): PaymentIntent {
  const pm = str(params.payment_method);
  const confirmed = params.confirm === 'true';
  const decline = DECLINES[pm ?? ''];
  const status = !confirmed ? 'requires_confirmation' : decline ? 'requires_payment_method' : pm === PROCESSING ? 'processing' : 'succeeded';
  return {
    id: id('pi'),
    object: 'payment_intent',
    amount: Number(params.amount),
    amount_received: status === 'succeeded' ? Number(params.amount) : 0,
    currency: String(params.currency).toLowerCase(),
    customer: str(params.customer),
    payment_method: pm,
    status,
    confirmation_method: 'automatic',
    capture_method: 'automatic',
    created: Math.floor(now / 1000),
    livemode: false,
    metadata,
    last_payment_error: decline ? { type: 'card_error', ...decline } : null,
  };
}

function newRefund(params: Record<string, FormValue>, pi: PaymentIntent, metadata: Record<string, string>, status: RefundStatus, remaining: number, now: number): Refund {
  return {
    id: id('re'),
    object: 'refund',
    // Without an amount, Stripe refunds what remains.
    amount: params.amount === undefined ? remaining : Number(params.amount),
    currency: pi.currency,
    payment_intent: pi.id,
    status,
    reason: str(params.reason),
    created: Math.floor(now / 1000),
    metadata,
    charge: null,
    balance_transaction: null,
  };
}

function newEvent(type: string, object: PaymentIntent | Refund, now: number): EmulatedEvent {
  return {
    id: id('evt'),
    object: 'event',
    type,
    created: Math.floor(now / 1000),
    livemode: false,
    api_version: '2025-01-01',
    data: { object: structuredClone(object) },
  };
}

function validateRefund(p: Record<string, FormValue>, pi: PaymentIntent | undefined): { param: string; message: string; code?: string } | undefined {
  if (typeof p.payment_intent !== 'string') return { param: 'payment_intent', message: 'You must provide a payment_intent to refund.' };
  if (!pi) return { param: 'payment_intent', message: `No such payment_intent: '${p.payment_intent}'`, code: 'resource_missing' };
  if (p.amount !== undefined) {
    const amount = Number(p.amount);
    if (typeof p.amount !== 'string' || !Number.isSafeInteger(amount) || amount < 1) return { param: 'amount', message: 'Invalid positive integer' };
  }
  if (p.reason !== undefined && !(typeof p.reason === 'string' && REFUND_REASONS.has(p.reason))) {
    return { param: 'reason', message: `Invalid reason: must be one of ${[...REFUND_REASONS].join(', ')}` };
  }
  if (pi.status !== 'succeeded') {
    return { param: 'payment_intent', message: `This PaymentIntent (${pi.id}) does not have a successful charge to refund.`, code: 'charge_not_refundable' };
  }
  return undefined;
}

function validateCreate(p: Record<string, FormValue>): { param: string; message: string; code?: string } | undefined {
  const amount = Number(p.amount);
  if (typeof p.amount !== 'string' || !Number.isSafeInteger(amount) || amount < 1)
    return { param: 'amount', message: 'Invalid positive integer' };
  if (amount > 99_999_999) return { param: 'amount', message: 'Amount must be no more than 99999999' };
  if (typeof p.currency !== 'string' || !/^[a-zA-Z]{3}$/.test(p.currency)) return { param: 'currency', message: 'Invalid currency' };
  if (p.payment_method !== undefined && !(typeof p.payment_method === 'string' && PAYMENT_METHODS.has(p.payment_method)))
    return { param: 'payment_method', message: `No such PaymentMethod: '${String(p.payment_method)}'`, code: 'resource_missing' };
  if (p.confirm === 'true' && typeof p.payment_method !== 'string')
    return { param: 'payment_method', message: 'You must provide a payment_method to confirm this PaymentIntent.' };
  return undefined;
}

/** The secret key of a request: `Authorization: Bearer sk_test_…`, or Basic with the key as user (`curl -u sk_test_…:`). */
function apiKeyOf(authorization: string | null): string | undefined {
  const [scheme, credentials] = (authorization ?? '').split(' ', 2);
  const key = /^basic$/i.test(scheme ?? '') ? Buffer.from(credentials ?? '', 'base64').toString().split(':')[0] : /^bearer$/i.test(scheme ?? '') ? credentials : undefined;
  return key && /^sk_test_\S+$/.test(key) ? key : undefined;
}

function faultRule(input: Record<string, unknown>): FaultRule {
  const fault = input.fault as Fault | undefined;
  if (!isRecord(fault) || !FAULT_KINDS.has(fault.kind)) throw new Error(`fault.kind must be one of ${[...FAULT_KINDS].join(', ')}`);
  if (fault.kind === 'rate_limit' && fault.code !== undefined && !RATE_LIMIT_CODES.includes(fault.code)) {
    throw new Error(`fault.code must be one of ${RATE_LIMIT_CODES.join(', ')}`);
  }
  if (input.count !== undefined && !(Number.isSafeInteger(input.count) && (input.count as number) > 0)) throw new Error('count must be a positive integer');
  if (input.endpoint !== undefined && !['any', ...ENDPOINTS].includes(input.endpoint as string)) {
    throw new Error(`endpoint must be one of ${[...ENDPOINTS, 'any'].join(', ')}`);
  }
  if (fault.kind === 'refund_status' && !REFUND_STATUSES.includes(fault.status)) {
    throw new Error(`fault.status must be one of ${REFUND_STATUSES.join(', ')}`);
  }
  return input as unknown as FaultRule;
}

function webhookTarget(input: Record<string, unknown>): WebhookTarget | undefined {
  if (input.url === undefined) return undefined;
  if (typeof input.url !== 'string' || typeof input.secret !== 'string') throw new Error('url and secret must be strings (an empty body turns webhooks off)');
  return { url: input.url, secret: input.secret, ...(input.delayMs !== undefined ? { delayMs: nonNegative(input.delayMs, 'delayMs') } : {}) };
}

function requestsPerSecond(v: unknown): number | null {
  if (v === undefined || v === null) return null;
  if (typeof v !== 'number' || !Number.isFinite(v) || v <= 0) throw new Error('requestsPerSecond must be a number > 0, or null (no limit)');
  return v;
}

/** Stripe's 429s: the account's limiter (rate_limit), or another request holding the object (lock_timeout). */
function tooManyRequests(code: RateLimitCode) {
  return code === 'lock_timeout'
    ? error('invalid_request_error', 'This object is being accessed by another API request right now; retry the request.', { code })
    : error('rate_limit_error', 'Too many requests hit the API too quickly.', { code });
}

function nonNegative(v: unknown, name: string): number {
  if (typeof v !== 'number' || !Number.isFinite(v) || v < 0) throw new Error(`${name} must be a number ≥ 0`);
  return v;
}

/** A Stripe list page: newest first, `created[gte]`, `limit` (1–100, default 10), `starting_after`. */
function listPage<T extends { id: string; created: number }>(items: T[], url: URL, path: string) {
  const limit = Math.min(Math.max(Number(url.searchParams.get('limit') ?? 10) || 10, 1), 100);
  const gte = Number(url.searchParams.get('created[gte]') ?? 0);
  const all = items.filter((x) => x.created >= gte).sort((a, b) => b.created - a.created || (a.id < b.id ? -1 : 1));
  const after = url.searchParams.get('starting_after');
  const start = after ? all.findIndex((x) => x.id === after) + 1 : 0;
  return { object: 'list', data: all.slice(start, start + limit), has_more: start + limit < all.length, url: path };
}

function error(type: string, message: string, extra: Record<string, unknown> = {}) {
  return { error: { type, message, ...extra } };
}

const json = (v: unknown) => JSON.stringify(v);
const str = (v: FormValue | undefined): string | null => (typeof v === 'string' ? v : null);
const isRecord = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
const header = (req: IncomingMessage, name: string): string | null => {
  const v = req.headers[name];
  return typeof v === 'string' ? v : null;
};
const encodePage = (offset: number) => Buffer.from(`offset:${offset}`).toString('base64url');
const decodePage = (page: string | null) => {
  const m = page ? /^offset:(\d+)$/.exec(Buffer.from(page, 'base64url').toString()) : null;
  return m ? Number(m[1]) : 0;
};
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function readBody(req: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of req) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}
