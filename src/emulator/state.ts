// What the emulator remembers, behind one interface with two homes: memory (the in-process handle that
// tests, chaos and the demo drive synchronously) and PostgreSQL (pgState.ts: one ledger per data
// directory, shared by every process on it and surviving restarts). Methods may answer synchronously
// (memory) or with a promise (PostgreSQL); the HTTP side always awaits.

export type Awaitable<T> = T | Promise<T>;

export type Fault =
  /** Refused before anything executes: no charge, nothing stored for the key. `paymentIntent`: the error
   * names this PaymentIntent, as Stripe's errors of a request about one may. */
  | { kind: 'error_before_commit'; status: number; paymentIntent?: string }
  /** The charge is made, but the key stores (and replays) this error. */
  | { kind: 'error_after_commit'; status: number; paymentIntent?: string }
  /** The charge is made and stored; this response never arrives whole. */
  | { kind: 'lose_response_after_commit'; mode: 'reset' | 'truncate' | 'hang' | 'trickle_headers' | 'trickle_body' }
  /** A 429 before anything executes: `rate_limit` (the default: the account's limit) or `lock_timeout`
   * (another request holds the object). */
  | { kind: 'rate_limit'; code?: RateLimitCode }
  | { kind: 'latency'; ms: number }
  /** A refund created by the request starts in this status instead of succeeded (composes with the others). */
  | { kind: 'refund_status'; status: RefundStatus };

/** PaymentIntents: create, retrieve, search, capture, cancel; refunds: create_refund, retrieve_refund, list_refunds. */
export type Endpoint = 'create' | 'retrieve' | 'search' | 'capture' | 'cancel' | 'create_refund' | 'retrieve_refund' | 'list_refunds';
export const ENDPOINTS: readonly Endpoint[] = ['create', 'retrieve', 'search', 'capture', 'cancel', 'create_refund', 'retrieve_refund', 'list_refunds'];

export const REFUND_STATUSES = ['pending', 'requires_action', 'succeeded', 'failed', 'canceled'] as const;
export type RefundStatus = (typeof REFUND_STATUSES)[number];

export const RATE_LIMIT_CODES = ['rate_limit', 'lock_timeout'] as const;
export type RateLimitCode = (typeof RATE_LIMIT_CODES)[number];

export interface FaultRule {
  /** Which requests it hits; empty matches any. operationId is metadata[operation_id]. */
  match?: { operationId?: string; customer?: string };
  fault: Fault;
  /** How many requests it hits; default 1, Infinity for every one. */
  count?: number;
  /** Default: create (create_refund for a refund_status fault). */
  endpoint?: Endpoint | 'any';
}

export interface ActiveRule extends Required<Omit<FaultRule, 'match'>> {
  id: string;
  match: { operationId?: string; customer?: string };
}

export interface WebhookTarget {
  url: string;
  secret: string;
  /** Delay before each event is sent (a real endpoint hears of a charge after its API response). */
  delayMs?: number;
}

export interface PaymentIntent {
  id: string;
  object: 'payment_intent';
  amount: number;
  /** What a capture may still take (requires_capture); 0 otherwise. Absent from PaymentIntents stored
   * before manual capture existed, as are the fields below it. */
  amount_capturable: number;
  amount_received: number;
  currency: string;
  customer: string | null;
  payment_method: string | null;
  status: string;
  confirmation_method: 'automatic';
  capture_method: 'automatic' | 'manual';
  canceled_at: number | null;
  cancellation_reason: string | null;
  created: number;
  livemode: false;
  metadata: Record<string, string>;
  last_payment_error: { code: string; decline_code?: string; message: string; type: string } | null;
  /** The charge of a confirmed PaymentIntent (resources.ts chargeOf builds it when expanded). */
  latest_charge: string | null;
  transfer_data: { destination: string } | null;
  application_fee_amount: number | null;
}

export interface LedgerEntry {
  paymentIntent: PaymentIntent;
  idempotencyKey: string | null;
  createdAtMs: number;
  /** The connected account it was made on (the request's Stripe-Account); null: the platform's own. */
  account: string | null;
}

export interface Refund {
  id: string;
  object: 'refund';
  amount: number;
  currency: string;
  payment_intent: string;
  status: RefundStatus;
  reason: string | null;
  created: number;
  metadata: Record<string, string>;
  charge: null;
  balance_transaction: null;
  /** The reversal of a destination charge's transfer, made when the refund asked for it (reverse_transfer). */
  transfer_reversal: string | null;
}

export interface RefundEntry {
  refund: Refund;
  idempotencyKey: string | null;
  createdAtMs: number;
  account: string | null;
  /** What the request asked of a Connect charge: Stripe's Refund object does not show both. */
  reverseTransfer: boolean;
  refundApplicationFee: boolean;
}

/** Money taken back from a PaymentIntent: every refund of it but the failed and canceled ones. */
const refundsHold = (r: Refund): boolean => r.status !== 'failed' && r.status !== 'canceled';

/** What the refunds among `entries` hold of PaymentIntent `paymentIntent`. */
export const heldByRefunds = (entries: RefundEntry[], paymentIntent: string): number =>
  entries.filter((e) => e.refund.payment_intent === paymentIntent && refundsHold(e.refund)).reduce((sum, e) => sum + e.refund.amount, 0);

/** A PaymentIntent moved to `status` (the control API's settle): only a succeeded one has received its
 * amount, only one that requires capture holds it; one that failed says why, as a decline does. */
export function setIntentStatus(pi: PaymentIntent, status: string): PaymentIntent {
  pi.status = status;
  pi.amount_received = status === 'succeeded' ? pi.amount : 0;
  pi.amount_capturable = status === 'requires_capture' ? pi.amount : 0;
  if (status === 'requires_payment_method') {
    pi.last_payment_error ??= { type: 'card_error', code: 'card_declined', decline_code: 'generic_decline', message: 'Your card was declined.' };
  }
  return pi;
}

/** What a change of one PaymentIntent (a capture, a cancel) decided: its new body and the response to
 * store under the key, or a refusal that stores nothing. */
export type IntentChange = { paymentIntent: PaymentIntent; response: StoredResponse } | { refused: StoredResponse };

export interface EmulatedEvent {
  id: string;
  object: 'event';
  type: string;
  created: number;
  livemode: false;
  api_version: string;
  /** The connected account the object lives on (Connect webhooks); absent for the platform's own. */
  account?: string;
  data: { object: PaymentIntent | Refund };
}

export interface StoredResponse {
  status: number;
  body: string;
}

/** What an idempotency key says about a request that carries it. */
export type KeyClaim =
  /** This request runs; the key is `executing` until commit or release. */
  | { kind: 'claimed' }
  /** The key's first request still runs (409). */
  | { kind: 'executing' }
  /** The key was first used with other parameters (400 idempotency_error). */
  | { kind: 'mismatch' }
  /** The key's first result, to replay. */
  | { kind: 'done'; response: StoredResponse };

export interface SearchSettings {
  lagMs: number;
  /** While set, only what was searchable at this instant (emulator clock) is searchable. */
  frozenAtMs: number | null;
}

export interface EmulatorState {
  /** The emulator clock's distance from the wall clock (advanceClock moves it). */
  clockOffsetMs(): Awaitable<number>;
  advanceClock(ms: number): Awaitable<void>;
  searchSettings(): Awaitable<SearchSettings>;
  configureSearch(settings: Partial<SearchSettings>): Awaitable<void>;
  webhooks(): Awaitable<WebhookTarget | undefined>;
  configureWebhooks(target: WebhookTarget | undefined): Awaitable<void>;
  /** The platform account's rate limit, requests/s across all requests (null: none), and each connected
   * account's (default: the same): token buckets holding one second's worth, full when set. */
  configureRateLimit(requestsPerSecond: number | null, accountRequestsPerSecond?: number | null): Awaitable<void>;
  /** Takes one request from the platform's limit, and from the connected account's when it is on one
   * (Stripe-Account): false, with neither taken, means answer 429 rate_limit. */
  admitRequest(account: string | null): Awaitable<boolean>;
  /** A connected account that no longer grants the platform access (it disconnected the platform, or was
   * deleted): every request on it is 403 account_invalid, until restored. */
  revokeAccess(account: string, revoked: boolean): Awaitable<void>;
  accessRevoked(account: string): Awaitable<boolean>;

  addFault(rule: FaultRule): Awaitable<string>;
  clearFaults(): Awaitable<void>;
  /** Takes the faults that apply to one request, using each rule up once (see pickFaults). */
  takeFaults(endpoint: Endpoint, operationId: string | null, customer: string | null): Awaitable<Fault[]>;

  /** A key's stored result older than retentionMs (emulator clock) is forgotten first. */
  claimKey(storeKey: string, paramsHash: string, nowMs: number, retentionMs: number): Awaitable<KeyClaim>;
  /** Forgets a claimed key whose request ended before committing anything. */
  releaseKey(storeKey: string): Awaitable<void>;
  /** The charge and the key's first result, together: a key never names a charge that does not exist. */
  commit(entry: LedgerEntry, key: { storeKey: string; response: StoredResponse } | null): Awaitable<void>;
  /** Forgets stored results at least olderThanMs old; returns how many. */
  pruneKeys(olderThanMs: number, nowMs: number): Awaitable<number>;

  intent(id: string): Awaitable<LedgerEntry | undefined>;
  /** Every PaymentIntent, oldest first. */
  intents(): Awaitable<LedgerEntry[]>;
  /** Moves a PaymentIntent to `status`; amount_received follows (the amount once succeeded, else 0). */
  setStatus(id: string, status: string): Awaitable<PaymentIntent | undefined>;
  /** Changes a PaymentIntent under its lock: `change` sees it as stored and decides (see IntentChange);
   * a change that commits stores the key's first result with it. Undefined: no such PaymentIntent. */
  changeIntent(id: string, change: (pi: PaymentIntent) => IntentChange, storeKey: string | null): Awaitable<IntentChange | undefined>;

  /** The refund and the key's first result, together, only when the refund fits in what its PaymentIntent
   * (succeeded) holds unrefunded, checked atomically with the write; otherwise nothing is stored and the
   * answer says what remains. */
  commitRefund(entry: RefundEntry, key: { storeKey: string; response: StoredResponse } | null): Awaitable<{ committed: true } | { committed: false; remaining: number }>;
  refund(id: string): Awaitable<RefundEntry | undefined>;
  /** Every refund, oldest first. */
  refunds(): Awaitable<RefundEntry[]>;
  setRefundStatus(id: string, status: RefundStatus): Awaitable<Refund | undefined>;

  addEvent(event: EmulatedEvent): Awaitable<void>;
  events(): Awaitable<EmulatedEvent[]>;
  event(id: string): Awaitable<EmulatedEvent | undefined>;

  /** Back to an empty ledger and default settings. */
  reset(): Awaitable<void>;
}

/**
 * The faults for one request, rules in the order they were added: one latency and one refund status,
 * which compose with anything, and at most one fault that changes the answer. A rule is used up only
 * when it applies.
 */
export function pickFaults(rules: ActiveRule[], endpoint: Endpoint, operationId: string | null, customer: string | null): ActiveRule[] {
  const hit: ActiveRule[] = [];
  const classOf = (f: Fault) => (f.kind === 'latency' || f.kind === 'refund_status' ? f.kind : 'answer');
  for (const rule of rules) {
    if (rule.count <= 0 || (rule.endpoint !== 'any' && rule.endpoint !== endpoint)) continue;
    if (rule.match.operationId && rule.match.operationId !== operationId) continue;
    if (rule.match.customer && rule.match.customer !== customer) continue;
    if (rule.fault.kind === 'refund_status' && endpoint !== 'create_refund') continue;
    if (hit.some((r) => classOf(r.fault) === classOf(rule.fault))) continue;
    hit.push(rule);
  }
  return hit;
}

/** A rule's endpoint: create unless it says otherwise (create_refund for a refund status). */
export const endpointOf = (rule: FaultRule): Endpoint | 'any' => rule.endpoint ?? (rule.fault.kind === 'refund_status' ? 'create_refund' : 'create');

export function activeRule(id: string, rule: FaultRule): ActiveRule {
  return { id, match: rule.match ?? {}, fault: rule.fault, count: rule.count ?? 1, endpoint: endpointOf(rule) };
}

interface StoredKey {
  state: 'executing' | 'done';
  paramsHash: string;
  createdAtMs: number;
  response?: StoredResponse;
}

/** The in-process state: every method answers synchronously, so the handle's methods can too. */
export class MemoryState implements EmulatorState {
  private offsetMs = 0;
  private search: SearchSettings;
  private target: WebhookTarget | undefined;
  private readonly rules: ActiveRule[] = [];
  private nextRule = 1;
  private readonly keys = new Map<string, StoredKey>();
  private readonly entries = new Map<string, LedgerEntry>();
  private readonly refundEntries = new Map<string, RefundEntry>();
  private readonly emitted: EmulatedEvent[] = [];
  private readonly initial: { searchLagMs?: number; webhooks?: WebhookTarget; rateLimit?: number };
  private limit: { perSecond: number; tokens: number; at: number; accountPerSecond: number; accounts: Map<string, { tokens: number; at: number }> } | null = null;
  private readonly revoked = new Set<string>();

  constructor(initial: { searchLagMs?: number; webhooks?: WebhookTarget; rateLimit?: number } = {}) {
    this.initial = initial;
    this.search = { lagMs: initial.searchLagMs ?? 0, frozenAtMs: null };
    this.target = initial.webhooks;
    this.configureRateLimit(initial.rateLimit ?? null);
  }

  clockOffsetMs(): number {
    return this.offsetMs;
  }

  advanceClock(ms: number): void {
    this.offsetMs += ms;
  }

  searchSettings(): SearchSettings {
    return { ...this.search };
  }

  configureSearch(settings: Partial<SearchSettings>): void {
    this.search = { ...this.search, ...settings };
  }

  webhooks(): WebhookTarget | undefined {
    return this.target;
  }

  configureWebhooks(target: WebhookTarget | undefined): void {
    this.target = target;
  }

  configureRateLimit(requestsPerSecond: number | null, accountRequestsPerSecond: number | null = null): void {
    this.limit =
      requestsPerSecond === null
        ? null
        : { perSecond: requestsPerSecond, tokens: requestsPerSecond, at: performance.now(), accountPerSecond: accountRequestsPerSecond ?? requestsPerSecond, accounts: new Map() };
  }

  revokeAccess(account: string, revoked: boolean): void {
    if (revoked) this.revoked.add(account);
    else this.revoked.delete(account);
  }

  accessRevoked(account: string): boolean {
    return this.revoked.has(account);
  }

  admitRequest(account: string | null): boolean {
    const l = this.limit;
    if (!l) return true;
    const now = performance.now();
    const refill = (b: { tokens: number; at: number }, perSecond: number) => {
      b.tokens = Math.min(perSecond, b.tokens + ((now - b.at) / 1000) * perSecond);
      b.at = now;
    };
    refill(l, l.perSecond);
    let own: { tokens: number; at: number } | undefined;
    if (account !== null) {
      own = l.accounts.get(account);
      if (!own) l.accounts.set(account, (own = { tokens: l.accountPerSecond, at: now }));
      refill(own, l.accountPerSecond);
    }
    if (l.tokens < 1 || (own && own.tokens < 1)) return false;
    l.tokens -= 1;
    if (own) own.tokens -= 1;
    return true;
  }

  addFault(rule: FaultRule): string {
    const active = activeRule(`rule_${this.nextRule++}`, rule);
    this.rules.push(active);
    return active.id;
  }

  clearFaults(): void {
    this.rules.length = 0;
  }

  takeFaults(endpoint: Endpoint, operationId: string | null, customer: string | null): Fault[] {
    return pickFaults(this.rules, endpoint, operationId, customer).map((rule) => {
      rule.count--;
      return rule.fault;
    });
  }

  claimKey(storeKey: string, paramsHash: string, nowMs: number, retentionMs: number): KeyClaim {
    const stored = this.keys.get(storeKey);
    if (stored && !(stored.state === 'done' && nowMs - stored.createdAtMs >= retentionMs)) {
      if (stored.paramsHash !== paramsHash) return { kind: 'mismatch' };
      return stored.state === 'executing' ? { kind: 'executing' } : { kind: 'done', response: stored.response! };
    }
    this.keys.set(storeKey, { state: 'executing', paramsHash, createdAtMs: nowMs });
    return { kind: 'claimed' };
  }

  releaseKey(storeKey: string): void {
    if (this.keys.get(storeKey)?.state === 'executing') this.keys.delete(storeKey);
  }

  commit(entry: LedgerEntry, key: { storeKey: string; response: StoredResponse } | null): void {
    this.entries.set(entry.paymentIntent.id, entry);
    if (!key) return;
    const claimed = this.keys.get(key.storeKey)!;
    this.keys.set(key.storeKey, { ...claimed, state: 'done', response: key.response });
  }

  pruneKeys(olderThanMs: number, nowMs: number): number {
    let pruned = 0;
    for (const [k, v] of this.keys) {
      if (v.state === 'done' && nowMs - v.createdAtMs >= olderThanMs) {
        this.keys.delete(k);
        pruned++;
      }
    }
    return pruned;
  }

  intent(id: string): LedgerEntry | undefined {
    return this.entries.get(id);
  }

  intents(): LedgerEntry[] {
    return [...this.entries.values()];
  }

  setStatus(id: string, status: string): PaymentIntent | undefined {
    const entry = this.entries.get(id);
    return entry && setIntentStatus(entry.paymentIntent, status);
  }

  changeIntent(id: string, change: (pi: PaymentIntent) => IntentChange, storeKey: string | null): IntentChange | undefined {
    const entry = this.entries.get(id);
    if (!entry) return undefined;
    const result = change(structuredClone(entry.paymentIntent));
    if ('refused' in result) return result;
    entry.paymentIntent = result.paymentIntent;
    if (storeKey !== null) this.keys.set(storeKey, { ...this.keys.get(storeKey)!, state: 'done', response: result.response });
    return result;
  }

  commitRefund(entry: RefundEntry, key: { storeKey: string; response: StoredResponse } | null): { committed: true } | { committed: false; remaining: number } {
    const pi = this.entries.get(entry.refund.payment_intent)?.paymentIntent;
    const remaining = (pi?.amount_received ?? 0) - (pi ? heldByRefunds(this.refunds(), pi.id) : 0);
    if (!pi || pi.status !== 'succeeded' || entry.refund.amount > remaining) return { committed: false, remaining: Math.max(remaining, 0) };
    this.refundEntries.set(entry.refund.id, entry);
    if (key) this.keys.set(key.storeKey, { ...this.keys.get(key.storeKey)!, state: 'done', response: key.response });
    return { committed: true };
  }

  refund(id: string): RefundEntry | undefined {
    return this.refundEntries.get(id);
  }

  refunds(): RefundEntry[] {
    return [...this.refundEntries.values()];
  }

  setRefundStatus(id: string, status: RefundStatus): Refund | undefined {
    const entry = this.refundEntries.get(id);
    if (!entry) return undefined;
    entry.refund.status = status;
    return entry.refund;
  }

  addEvent(event: EmulatedEvent): void {
    this.emitted.push(event);
  }

  events(): EmulatedEvent[] {
    return [...this.emitted];
  }

  event(id: string): EmulatedEvent | undefined {
    return this.emitted.find((e) => e.id === id);
  }

  reset(): void {
    this.offsetMs = 0;
    this.search = { lagMs: this.initial.searchLagMs ?? 0, frozenAtMs: null };
    this.target = this.initial.webhooks;
    this.configureRateLimit(this.initial.rateLimit ?? null);
    this.rules.length = 0;
    this.keys.clear();
    this.entries.clear();
    this.refundEntries.clear();
    this.emitted.length = 0;
    this.revoked.clear();
  }
}
