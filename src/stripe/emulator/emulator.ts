// A stateful Stripe emulator for PaymentIntents, driven by the real `stripe` SDK over HTTP. It keeps
// what makes payments hard to get right: an idempotency layer that stores the first result of a key
// (500s included) and replays it byte for byte, 409 while a key executes, key expiry on a controllable
// clock, a search index that lags, and faults injected before or after the charge commits.
import { createHash, randomBytes } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import Stripe from 'stripe';
import { parseForm, type FormValue } from './form.ts';
import { matches, parseSearchQuery } from './search.ts';

export type Fault =
  /** Refused before anything executes: no charge, nothing stored for the key. */
  | { kind: 'error_before_commit'; status: number }
  /** The charge is made, but the key stores (and replays) this error. */
  | { kind: 'error_after_commit'; status: number }
  /** The charge is made and stored; this response never arrives whole. */
  | { kind: 'lose_response_after_commit'; mode: 'reset' | 'truncate' | 'hang' }
  | { kind: 'rate_limit' }
  | { kind: 'latency'; ms: number };

export type Endpoint = 'create' | 'retrieve' | 'search';

export interface FaultRule {
  /** Which requests it hits; empty matches any. operationId is metadata[operation_id]. */
  match?: { operationId?: string; customer?: string };
  fault: Fault;
  /** How many requests it hits; default 1, Infinity for every one. */
  count?: number;
  /** Default: create. */
  endpoint?: Endpoint | 'any';
}

export interface EmulatorOptions {
  /** How long a key's first result is kept (Stripe: at least 24 h). */
  idempotencyRetentionMs?: number;
  /** How long after a write it becomes searchable. */
  searchLagMs?: number;
  /** pm_card_processing PaymentIntents succeed this long after creation; unset: only by settle(). */
  processingSettleMs?: number;
  /** Where to POST signed payment_intent.* events (at least once: retried on failure). */
  webhooks?: WebhookTarget;
}

export interface WebhookTarget {
  url: string;
  secret: string;
  /** Delay before each event is sent (a real endpoint hears of a charge after its API response). */
  delayMs?: number;
}

export interface EmulatedEvent {
  id: string;
  object: 'event';
  type: string;
  created: number;
  livemode: false;
  api_version: string;
  data: { object: PaymentIntent };
}

export interface WebhookDelivery {
  eventId: string;
  type: string;
  attempt: number;
  status: number | 'error';
}

export interface PaymentIntent {
  id: string;
  object: 'payment_intent';
  amount: number;
  amount_received: number;
  currency: string;
  customer: string | null;
  payment_method: string | null;
  status: string;
  confirmation_method: 'automatic';
  capture_method: 'automatic';
  created: number;
  livemode: false;
  metadata: Record<string, string>;
  last_payment_error: { code: string; decline_code?: string; message: string; type: string } | null;
}

export interface LedgerEntry {
  paymentIntent: PaymentIntent;
  idempotencyKey: string | null;
  createdAtMs: number;
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

interface StoredResult {
  state: 'executing' | 'done';
  paramsHash: string;
  createdAtMs: number;
  response?: { status: number; body: string };
}

interface ActiveRule extends Required<Omit<FaultRule, 'match'>> {
  id: string;
  match: { operationId?: string; customer?: string };
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

const EVENT_FOR_STATUS: Record<string, string> = {
  succeeded: 'payment_intent.succeeded',
  requires_payment_method: 'payment_intent.payment_failed',
  canceled: 'payment_intent.canceled',
  processing: 'payment_intent.processing',
};

const DAY_MS = 24 * 60 * 60 * 1000;
const id = (prefix: string) => `${prefix}_${randomBytes(12).toString('hex')}`;

export class StripeEmulator {
  private readonly initial: EmulatorOptions;
  private opts!: Required<Omit<EmulatorOptions, 'processingSettleMs' | 'webhooks'>> & Omit<EmulatorOptions, 'idempotencyRetentionMs' | 'searchLagMs'>;
  private readonly events: EmulatedEvent[] = [];
  private readonly deliveries: WebhookDelivery[] = [];
  private clockOffsetMs = 0;
  private searchFrozen = false;
  private readonly intents = new Map<string, LedgerEntry>();
  private readonly indexed = new Set<string>();
  private readonly keys = new Map<string, StoredResult>();
  private readonly rules: ActiveRule[] = [];
  private readonly log: RequestLogEntry[] = [];
  private readonly sockets = new Set<Socket>();
  private server: Server | undefined;
  private nextRule = 1;

  constructor(opts: EmulatorOptions = {}) {
    this.initial = opts;
    this.reset();
  }

  // ─── the handle tests and the control API use ────────────────────────────────────────────────────

  now(): number {
    return Date.now() + this.clockOffsetMs;
  }

  /** Moves the emulator's clock (key expiry, search lag, processing delay) forward. */
  advanceClock(ms: number): void {
    this.clockOffsetMs += ms;
  }

  addFault(rule: FaultRule): string {
    const active: ActiveRule = {
      id: `rule_${this.nextRule++}`,
      match: rule.match ?? {},
      fault: rule.fault,
      count: rule.count ?? 1,
      endpoint: rule.endpoint ?? 'create',
    };
    this.rules.push(active);
    return active.id;
  }

  clearFaults(): void {
    this.rules.length = 0;
  }

  /** Forgets stored idempotency results at least `olderThanMs` old (all of them by default). */
  pruneKeys(olderThanMs = 0): number {
    let pruned = 0;
    for (const [k, v] of this.keys) {
      if (v.state === 'done' && this.now() - v.createdAtMs >= olderThanMs) {
        this.keys.delete(k);
        pruned++;
      }
    }
    return pruned;
  }

  settle(paymentIntentId: string, status: 'succeeded' | 'canceled' | 'requires_payment_method'): PaymentIntent {
    const entry = this.intents.get(paymentIntentId);
    if (!entry) throw new Error(`no payment intent ${paymentIntentId}`);
    entry.paymentIntent.status = status;
    entry.paymentIntent.amount_received = status === 'succeeded' ? entry.paymentIntent.amount : 0;
    this.emit(entry.paymentIntent);
    return entry.paymentIntent;
  }

  configureWebhooks(target: WebhookTarget | undefined): void {
    if (target) this.opts.webhooks = target;
    else delete this.opts.webhooks;
  }

  /** Every event emitted, oldest first. */
  emittedEvents(): EmulatedEvent[] {
    return [...this.events];
  }

  webhookDeliveries(): WebhookDelivery[] {
    return [...this.deliveries];
  }

  /** Sends an event again, as Stripe may: the receiver must acknowledge it without acting twice. */
  async redeliver(eventId: string): Promise<number | 'error'> {
    const event = this.events.find((e) => e.id === eventId);
    if (!event) throw new Error(`no event ${eventId}`);
    return this.deliverEvent(event, 1, false);
  }

  configureSearch(opts: { lagMs?: number; frozen?: boolean }): void {
    if (opts.lagMs !== undefined) this.opts.searchLagMs = opts.lagMs;
    if (opts.frozen !== undefined) {
      if (opts.frozen) this.refreshIndex(); // what was searchable stays searchable
      this.searchFrozen = opts.frozen;
    }
  }

  /** Back to a new emulator's state and options (the listener stays). */
  reset(): void {
    const opts = this.initial;
    this.opts = {
      idempotencyRetentionMs: opts.idempotencyRetentionMs ?? DAY_MS,
      searchLagMs: opts.searchLagMs ?? 0,
      ...(opts.processingSettleMs !== undefined ? { processingSettleMs: opts.processingSettleMs } : {}),
      ...(opts.webhooks ? { webhooks: opts.webhooks } : {}),
    };
    this.events.length = 0;
    this.deliveries.length = 0;
    this.intents.clear();
    this.indexed.clear();
    this.keys.clear();
    this.rules.length = 0;
    this.log.length = 0;
    this.clockOffsetMs = 0;
    this.searchFrozen = false;
  }

  /** Every PaymentIntent ever created, oldest first, with the key it was created under. */
  ledger(): LedgerEntry[] {
    return [...this.intents.values()].map((e) => ({ ...e, paymentIntent: this.current(e) }));
  }

  requests(): RequestLogEntry[] {
    return [...this.log];
  }

  async listen(port = 0, host = '127.0.0.1'): Promise<{ url: string; port: number }> {
    const server = createServer((req, res) => {
      this.route(req, res).catch((err: Error) => {
        if (!res.headersSent) this.sendRaw(res, 500, { error: { type: "api_error", message: err.message } });
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
      at: this.now(),
    };
    this.log.push(entry);

    const apiKey = /^Bearer (sk_test_\S+)$/.exec(header(req, 'authorization') ?? '')?.[1];
    if (!apiKey) {
      return this.respond(res, entry, 401, error('invalid_request_error', 'Invalid API Key provided.'));
    }
    const retrieve = /^\/v1\/payment_intents\/(pi_[A-Za-z0-9]+)$/.exec(url.pathname);
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
    return this.respond(res, entry, 404, error('invalid_request_error', `Unrecognized request URL (${req.method}: ${url.pathname}).`));
  }

  private async create(apiKey: string, params: Record<string, FormValue>, res: ServerResponse, entry: RequestLogEntry) {
    const metadata = isRecord(params.metadata) ? (params.metadata as Record<string, string>) : {};
    entry.operationId = metadata.operation_id ?? null;
    const key = entry.idempotencyKey;
    if (key !== null && key.length > 255) {
      return this.respond(res, entry, 400, error('invalid_request_error', 'Idempotency-Key must be at most 255 characters.'));
    }
    const faults = this.takeFaults('create', entry.operationId, str(params.customer));
    if (await this.preflight(faults, res, entry)) return;
    const invalid = validateCreate(params);
    if (invalid) return this.respond(res, entry, 400, error('invalid_request_error', invalid.message, { param: invalid.param }));

    const storeKey = key === null ? null : `${apiKey}\u0000${key}`;
    const paramsHash = createHash('sha256').update(JSON.stringify(params)).digest('hex');
    if (storeKey !== null) {
      const stored = this.keys.get(storeKey);
      if (stored && stored.state === 'done' && this.now() - stored.createdAtMs >= this.opts.idempotencyRetentionMs) {
        this.keys.delete(storeKey); // expired: the key runs a new request
      } else if (stored) {
        if (stored.paramsHash !== paramsHash) {
          return this.respond(res, entry, 400, error('idempotency_error',
            `Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '${key}' if you meant to execute a different request.`));
        }
        if (stored.state === 'executing') {
          return this.respond(res, entry, 409, error('invalid_request_error',
            'There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): ' + key + '. Please try again later.',
            { code: 'idempotency_key_in_use' }));
        }
        entry.replayed = true;
        res.setHeader('Idempotent-Replayed', 'true');
        return this.deliver(res, entry, stored.response!, faults);
      }
      this.keys.set(storeKey, { state: 'executing', paramsHash, createdAtMs: this.now() });
    }

    const latency = faults.find((f) => f.kind === 'latency');
    if (latency) await sleep(latency.ms);

    // Commit: the charge exists from here on, whatever happens to the response.
    const pi = this.commitPaymentIntent(params, metadata, key);
    const afterCommit = faults.find((f) => f.kind === 'error_after_commit');
    const decline = DECLINES[pi.payment_method ?? ''];
    const response = afterCommit
      ? { status: afterCommit.status, body: json(error('api_error', 'An unknown error occurred on our side.')) }
      : decline
        ? { status: 402, body: json(error('card_error', decline.message, { code: decline.code, ...(decline.decline_code ? { decline_code: decline.decline_code } : {}), payment_intent: pi })) }
        : { status: 200, body: json(pi) };
    if (storeKey !== null) this.keys.set(storeKey, { state: 'done', paramsHash, createdAtMs: this.keys.get(storeKey)!.createdAtMs, response });
    return this.deliver(res, entry, response, faults);
  }

  private async retrieve(piId: string, res: ServerResponse, entry: RequestLogEntry) {
    const found = this.intents.get(piId);
    entry.operationId = found?.paymentIntent.metadata.operation_id ?? null;
    const faults = this.takeFaults('retrieve', entry.operationId, found?.paymentIntent.customer ?? null);
    if (await this.preflight(faults, res, entry)) return;
    await this.latency(faults);
    if (!found) {
      return this.respond(res, entry, 404, error('invalid_request_error', `No such payment_intent: '${piId}'`, { code: 'resource_missing', param: 'intent' }));
    }
    return this.deliver(res, entry, { status: 200, body: json(this.current(found)) }, faults);
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
    const faults = this.takeFaults('search', entry.operationId, clauses.find((c) => c.field === 'customer')?.value ?? null);
    if (await this.preflight(faults, res, entry)) return;
    await this.latency(faults);
    const limit = Math.min(Math.max(Number(url.searchParams.get('limit') ?? 10) || 10, 1), 100);
    const offset = decodePage(url.searchParams.get('page'));
    this.refreshIndex();
    const hits = [...this.intents.values()]
      .filter((e) => this.indexed.has(e.paymentIntent.id))
      .map((e) => this.current(e))
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
  private list(url: URL, res: ServerResponse, entry: RequestLogEntry) {
    const limit = Math.min(Math.max(Number(url.searchParams.get('limit') ?? 10) || 10, 1), 100);
    const gte = Number(url.searchParams.get('created[gte]') ?? 0);
    const all = [...this.intents.values()]
      .map((e) => this.current(e))
      .filter((pi) => pi.created >= gte)
      .sort((a, b) => b.created - a.created || (a.id < b.id ? -1 : 1));
    const after = url.searchParams.get('starting_after');
    const start = after ? all.findIndex((pi) => pi.id === after) + 1 : 0;
    const data = all.slice(start, start + limit);
    return this.deliver(res, entry, {
      status: 200,
      body: json({ object: 'list', data, has_more: start + limit < all.length, url: '/v1/payment_intents' }),
    }, []);
  }

  // ─── faults ──────────────────────────────────────────────────────────────────────────────────────

  /** The faults for one request, rules in the order they were added: one latency, which composes with
   * anything, and at most one fault that changes the answer. A rule is used up only when it applies. */
  private takeFaults(endpoint: Endpoint, operationId: string | null, customer: string | null): Fault[] {
    const hit: Fault[] = [];
    for (const rule of this.rules) {
      if (rule.count <= 0 || (rule.endpoint !== 'any' && rule.endpoint !== endpoint)) continue;
      if (rule.match.operationId && rule.match.operationId !== operationId) continue;
      if (rule.match.customer && rule.match.customer !== customer) continue;
      const isLatency = rule.fault.kind === 'latency';
      if (hit.some((f) => (f.kind === 'latency') === isLatency)) continue;
      rule.count--;
      hit.push(rule.fault);
    }
    return hit;
  }

  /** Faults that answer before anything executes. True when the request was answered. */
  private async preflight(faults: Fault[], res: ServerResponse, entry: RequestLogEntry): Promise<boolean> {
    if (faults.some((f) => f.kind === 'rate_limit')) {
      this.respond(res, entry, 429, error('rate_limit_error', 'Too many requests hit the API too quickly.', { code: 'rate_limit' }));
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

  private deliver(res: ServerResponse, entry: RequestLogEntry, response: { status: number; body: string }, faults: Fault[]) {
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

  private commitPaymentIntent(params: Record<string, FormValue>, metadata: Record<string, string>, key: string | null): PaymentIntent {
    const pm = str(params.payment_method);
    const confirmed = params.confirm === 'true';
    const decline = DECLINES[pm ?? ''];
    const status = !confirmed ? 'requires_confirmation' : decline ? 'requires_payment_method' : pm === 'pm_card_processing' ? 'processing' : 'succeeded';
    const pi: PaymentIntent = {
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
      created: Math.floor(this.now() / 1000),
      livemode: false,
      metadata,
      last_payment_error: decline ? { type: 'card_error', ...decline } : null,
    };
    this.intents.set(pi.id, { paymentIntent: pi, idempotencyKey: key, createdAtMs: this.now() });
    this.emit(pi);
    return pi;
  }

  // ─── webhooks ────────────────────────────────────────────────────────────────────────────────────

  private emit(pi: PaymentIntent): void {
    const type = EVENT_FOR_STATUS[pi.status];
    const target = this.opts.webhooks;
    if (!type || !target) return;
    const event: EmulatedEvent = {
      id: id('evt'),
      object: 'event',
      type,
      created: Math.floor(this.now() / 1000),
      livemode: false,
      api_version: '2025-01-01',
      data: { object: structuredClone(pi) },
    };
    this.events.push(event);
    setTimeout(() => void this.deliverEvent(event, 1, true), target.delayMs ?? 0);
  }

  private async deliverEvent(event: EmulatedEvent, attempt: number, retry: boolean): Promise<number | 'error'> {
    const target = this.opts.webhooks;
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
    const ok = typeof status === 'number' && status >= 200 && status < 300;
    if (!ok && retry && attempt < 3) setTimeout(() => void this.deliverEvent(event, attempt + 1, true), 200 * attempt);
    return status;
  }

  /** The PaymentIntent as of now: a processing one may have finished. */
  private current(entry: LedgerEntry): PaymentIntent {
    const pi = entry.paymentIntent;
    const settleMs = this.opts.processingSettleMs;
    if (pi.status === 'processing' && settleMs !== undefined && this.now() - entry.createdAtMs >= settleMs) {
      this.settle(pi.id, 'succeeded');
    }
    return pi;
  }

  private refreshIndex(): void {
    if (this.searchFrozen) return;
    for (const e of this.intents.values()) {
      if (this.now() - e.createdAtMs >= this.opts.searchLagMs) this.indexed.add(e.paymentIntent.id);
    }
  }

  private respond(res: ServerResponse, entry: RequestLogEntry, status: number, body: object) {
    this.send(res, entry, status, json(body));
  }

  private send(res: ServerResponse, entry: RequestLogEntry, status: number, body: string) {
    entry.status = status;
    res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) });
    res.end(body);
  }

  // ─── control API: the same handle over HTTP, for other processes (chaos, demo, a person) ─────────

  private control(method: string, path: string, body: string, res: ServerResponse): void {
    const input = body ? JSON.parse(body) : {};
    const ok = (value: unknown = { ok: true }) => this.sendRaw(res, 200, value);
    const route = `${method} ${path}`;
    try {
      if (route === 'GET /_emulator/ledger') return ok(this.ledger());
      if (route === 'GET /_emulator/requests') return ok(this.requests());
      if (route === 'POST /_emulator/faults') return ok({ id: this.addFault(input as FaultRule) });
      if (route === 'DELETE /_emulator/faults') return ok(this.clearFaults());
      if (route === 'POST /_emulator/clock/advance') return ok(this.advanceClock(Number(input.ms)));
      if (route === 'POST /_emulator/keys/prune') return ok({ pruned: this.pruneKeys(input.olderThanMs) });
      if (route === 'POST /_emulator/search') return ok(this.configureSearch(input));
      if (route === 'POST /_emulator/reset') return ok(this.reset());
      if (route === 'POST /_emulator/webhooks') return ok(this.configureWebhooks(input.url ? input : undefined));
      if (route === 'GET /_emulator/events') return ok(this.emittedEvents());
      const settle = /^POST \/_emulator\/payment_intents\/(pi_\w+)\/settle$/.exec(route);
      if (settle) return ok(this.settle(settle[1]!, input.status));
      return this.sendRaw(res, 404, { error: `no control route ${route}` });
    } catch (err) {
      return this.sendRaw(res, 400, { error: (err as Error).message });
    }
  }

  private sendRaw(res: ServerResponse, status: number, value: unknown) {
    const body = JSON.stringify(value ?? { ok: true });
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(body);
  }
}

function validateCreate(p: Record<string, FormValue>): { param: string; message: string } | undefined {
  const amount = Number(p.amount);
  if (typeof p.amount !== 'string' || !Number.isSafeInteger(amount) || amount < 1)
    return { param: 'amount', message: 'Invalid positive integer' };
  if (amount > 99_999_999) return { param: 'amount', message: 'Amount must be no more than 99999999' };
  if (typeof p.currency !== 'string' || !/^[a-zA-Z]{3}$/.test(p.currency)) return { param: 'currency', message: 'Invalid currency' };
  if (p.confirm === 'true' && typeof p.payment_method !== 'string')
    return { param: 'payment_method', message: 'You must provide a payment_method to confirm this PaymentIntent.' };
  return undefined;
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
