// Stripe's API under /v1: authentication, the account's rate limit, then one handler per endpoint. A
// write goes through faults (faults.ts), the idempotency layer (idempotency.ts), one commit of the object
// with its key's result, and its webhook (webhooks.ts). A request with Stripe-Account acts on that
// connected account: it sees only that account's objects and keys.
import type { IncomingMessage, ServerResponse } from 'node:http';
import { clock, trim, type Core, type RequestLogEntry } from './core.ts';
import { deliver, latency, preflight, storedAfterCommit, tooManyRequests } from './faults.ts';
import { parseForm, type FormValue } from './form.ts';
import { apiKeyOf, error, header, invalidRequest, isRecord, json, newId, respond, send, str } from './http.ts';
import { claimKey, refuseLongKey, underKey } from './idempotency.ts';
import {
  DECLINES,
  cancel,
  capture,
  currentIntent,
  currentIntents,
  currentRefund,
  expandOf,
  listPage,
  newPaymentIntent,
  newRefund,
  present,
  validAccount,
  validateCancel,
  validateCapture,
  validateCreate,
  validateRefund,
} from './resources.ts';
import { matches, parseSearchQuery } from './search.ts';
import { heldByRefunds, type IntentChange, type LedgerEntry, type PaymentIntent, type Refund, type StoredResponse } from './state.ts';
import { emit, emitIntent } from './webhooks.ts';

/** One Stripe request being answered. */
interface Call {
  apiKey: string;
  /** Stripe-Account: the connected account it acts on; null: the platform. */
  account: string | null;
  entry: RequestLogEntry;
  res: ServerResponse;
}

export async function serveStripe(core: Core, req: IncomingMessage, url: URL, body: string, res: ServerResponse): Promise<void> {
  const requestId = newId('req');
  res.setHeader('Request-Id', requestId);
  res.setHeader('Stripe-Version', String(req.headers['stripe-version'] ?? '2025-01-01'));
  const entry: RequestLogEntry = {
    requestId,
    method: req.method!,
    path: url.pathname,
    endpoint: 'other',
    idempotencyKey: header(req, 'idempotency-key'),
    account: header(req, 'stripe-account'),
    operationId: null,
    status: 0,
    replayed: false,
    at: await clock(core),
  };
  core.log.push(entry);
  trim(core, core.log);

  const apiKey = apiKeyOf(header(req, 'authorization'));
  if (!apiKey) {
    return respond(res, entry, 401, error('invalid_request_error', 'Invalid API Key provided.'));
  }
  // A connected account that disconnected the platform refuses it as one that never existed.
  if (!validAccount(entry.account) || (entry.account !== null && (await core.state.accessRevoked(entry.account)))) {
    return respond(res, entry, 403, error('invalid_request_error',
      `The provided key does not have access to account '${entry.account}' (or that account does not exist). Application access may have been revoked.`, { code: 'account_invalid' }));
  }
  const call: Call = { apiKey, account: entry.account, entry, res };
  // The limiter answers before anything else runs, the idempotency layer included. A request on a
  // connected account counts against it and the platform both (what outboxd assumes of Stripe).
  if (!(await core.state.admitRequest(call.account))) return respond(res, entry, 429, tooManyRequests('rate_limit'));
  const retrieveIntent = /^\/v1\/payment_intents\/(pi_[A-Za-z0-9]+)$/.exec(url.pathname);
  const changeIntent = /^\/v1\/payment_intents\/(pi_[A-Za-z0-9]+)\/(capture|cancel)$/.exec(url.pathname);
  const refund = /^\/v1\/refunds\/((?:re|pyr)_[A-Za-z0-9]+)$/.exec(url.pathname);
  if (req.method === 'POST' && url.pathname === '/v1/payment_intents') {
    entry.endpoint = 'create';
    return create(core, call, parseForm(body));
  }
  if (req.method === 'GET' && url.pathname === '/v1/payment_intents/search') {
    entry.endpoint = 'search';
    return search(core, call, url);
  }
  if (req.method === 'GET' && url.pathname === '/v1/payment_intents') {
    entry.endpoint = 'list';
    return list(core, call, url);
  }
  if (req.method === 'GET' && retrieveIntent) {
    entry.endpoint = 'retrieve';
    return retrieve(core, call, retrieveIntent[1]!, expandOf(parseForm(url.search.slice(1))));
  }
  if (req.method === 'POST' && changeIntent) {
    const endpoint = changeIntent[2] as 'capture' | 'cancel';
    entry.endpoint = endpoint;
    return change(core, call, endpoint, changeIntent[1]!, parseForm(body));
  }
  if (req.method === 'POST' && url.pathname === '/v1/refunds') {
    entry.endpoint = 'create_refund';
    return createRefund(core, call, parseForm(body));
  }
  if (req.method === 'GET' && url.pathname === '/v1/refunds') {
    entry.endpoint = 'list_refunds';
    return listRefunds(core, call, url);
  }
  if (req.method === 'GET' && refund) {
    entry.endpoint = 'retrieve_refund';
    return retrieveRefund(core, call, refund[1]!);
  }
  return respond(res, entry, 404, error('invalid_request_error', `Unrecognized request URL (${req.method}: ${url.pathname}).`));
}

const metadataOf = (params: Record<string, FormValue>) => (isRecord(params.metadata) ? (params.metadata as Record<string, string>) : {});

/** A PaymentIntent as the caller's account sees it: another account's (or the platform's) does not exist. */
async function findIntent(core: Core, id: string, account: string | null): Promise<LedgerEntry | undefined> {
  const found = await core.state.intent(id);
  return found && found.account === account ? found : undefined;
}

/** POST /v1/payment_intents. */
async function create(core: Core, call: Call, params: Record<string, FormValue>) {
  const { entry, res } = call;
  const metadata = metadataOf(params);
  entry.operationId = metadata.operation_id ?? null;
  if (refuseLongKey(res, entry)) return;
  const faults = await core.state.takeFaults('create', entry.operationId, str(params.customer));
  if (await preflight(faults, res, entry)) return;
  // A request that fails validation executes nothing and stores nothing under its key.
  const invalid = validateCreate(params, call.account);
  if (invalid) return respond(res, entry, 400, invalidRequest(invalid));

  const claimed = await claimKey(core, call.apiKey, call.account, JSON.stringify(params), res, entry, faults);
  if (!claimed) return;
  const { storeKey } = claimed;
  await underKey(core, storeKey, async () => {
    await latency(faults);
    // Commit: the charge exists from here on, whatever happens to the response.
    const now = await clock(core);
    const pi = newPaymentIntent(params, metadata, now);
    const decline = DECLINES[pi.payment_method ?? ''];
    const response = storedAfterCommit(faults, decline
      ? { status: 402, body: json(error('card_error', decline.message, { code: decline.code, ...(decline.decline_code ? { decline_code: decline.decline_code } : {}), payment_intent: pi })) }
      : { status: 200, body: json(present(pi, expandOf(params))) });
    await core.state.commit({ paymentIntent: pi, idempotencyKey: entry.idempotencyKey, createdAtMs: now, account: call.account }, storeKey === null ? null : { storeKey, response });
    await emitIntent(core, pi, call.account);
    deliver(res, entry, response, faults);
    return true;
  });
}

/**
 * POST /v1/payment_intents/:id/capture and /cancel: decided on the PaymentIntent under its lock (a
 * capture and a cancel racing are decided one after the other), stored with the key's first result.
 * A refusal (the status does not allow it, more than is capturable) stores nothing under the key.
 */
async function change(core: Core, call: Call, endpoint: 'capture' | 'cancel', piId: string, params: Record<string, FormValue>) {
  const { entry, res } = call;
  if (refuseLongKey(res, entry)) return;
  const found = await findIntent(core, piId, call.account);
  entry.operationId = found?.paymentIntent.metadata.operation_id ?? null;
  const faults = await core.state.takeFaults(endpoint, entry.operationId, found?.paymentIntent.customer ?? null);
  if (await preflight(faults, res, entry)) return;
  if (!found) return respond(res, entry, 404, error('invalid_request_error', `No such payment_intent: '${piId}'`, { code: 'resource_missing', param: 'intent' }));
  const invalid = endpoint === 'capture' ? validateCapture(params) : validateCancel(params);
  if (invalid) return respond(res, entry, 400, invalidRequest(invalid));
  // An authorization past its capture_before has expired before this request is decided.
  await currentIntent(core, found);

  const claimed = await claimKey(core, call.apiKey, call.account, JSON.stringify([endpoint, piId, params]), res, entry, faults);
  if (!claimed) return;
  const { storeKey } = claimed;
  await underKey(core, storeKey, async () => {
    await latency(faults);
    const now = await clock(core);
    const respondWith = (pi: PaymentIntent): StoredResponse => storedAfterCommit(faults, { status: 200, body: json(present(pi, expandOf(params))) });
    const decide = (pi: PaymentIntent): IntentChange => (endpoint === 'capture' ? capture(pi, params, respondWith) : cancel(pi, params, now, respondWith));
    const result = (await core.state.changeIntent(piId, decide, storeKey))!;
    if ('refused' in result) {
      send(res, entry, result.refused.status, result.refused.body);
      return false;
    }
    await emitIntent(core, result.paymentIntent, call.account);
    deliver(res, entry, result.response, faults);
    return true;
  });
}

/** POST /v1/refunds: a refund of a succeeded PaymentIntent, at most what it holds unrefunded. */
async function createRefund(core: Core, call: Call, params: Record<string, FormValue>) {
  const { entry, res } = call;
  const metadata = metadataOf(params);
  entry.operationId = metadata.operation_id ?? null;
  if (refuseLongKey(res, entry)) return;
  const piId = str(params.payment_intent);
  const pi = piId ? (await findIntent(core, piId, call.account))?.paymentIntent : undefined;
  const faults = await core.state.takeFaults('create_refund', entry.operationId, pi?.customer ?? null);
  if (await preflight(faults, res, entry)) return;
  const invalid = validateRefund(params, pi);
  if (invalid) return respond(res, entry, 400, invalidRequest(invalid));

  // The key's parameters are the endpoint's too: a charge's key sent to refunds is a mismatch.
  const claimed = await claimKey(core, call.apiKey, call.account, JSON.stringify(['refunds', params]), res, entry, faults);
  if (!claimed) return;
  const { storeKey } = claimed;
  await underKey(core, storeKey, async () => {
    await latency(faults);
    const now = await clock(core);
    const held = heldByRefunds(await core.state.refunds(), pi!.id);
    const status = faults.find((f) => f.kind === 'refund_status')?.status ?? 'succeeded';
    const refund = newRefund(params, pi!, metadata, status, pi!.amount_received - held, now);
    const response: StoredResponse = storedAfterCommit(faults, { status: 200, body: json(refund) });
    // Commit, only if it fits: the refund exists from here on, whatever happens to the response.
    const result = await core.state.commitRefund(
      {
        refund,
        idempotencyKey: entry.idempotencyKey,
        createdAtMs: now,
        account: call.account,
        reverseTransfer: params.reverse_transfer === 'true',
        refundApplicationFee: params.refund_application_fee === 'true',
      },
      storeKey === null ? null : { storeKey, response },
    );
    if (!result.committed) {
      if (result.remaining === 0) respond(res, entry, 400, error('invalid_request_error', `PaymentIntent ${pi!.id} has already been refunded.`, { code: 'charge_already_refunded' }));
      else respond(res, entry, 400, error('invalid_request_error', `Refund amount (${refund.amount}) is greater than unrefunded amount on charge (${result.remaining})`, { code: 'amount_too_large', param: 'amount' }));
      return false;
    }
    await emit(core, 'refund.created', refund, call.account);
    deliver(res, entry, response, faults);
    return true;
  });
}

async function retrieveRefund(core: Core, call: Call, refundId: string) {
  const stored = await core.state.refund(refundId);
  const found = stored && stored.account === call.account ? stored : undefined;
  const customer = found ? ((await core.state.intent(found.refund.payment_intent))?.paymentIntent.customer ?? null) : null;
  const object = found && { operationId: found.refund.metadata.operation_id ?? null, customer, current: () => currentRefund(core, found) };
  return retrieveOne(core, call, 'retrieve_refund', object, { message: `No such refund: '${refundId}'`, param: 'id' });
}

/** A GET of one object: its faults and latency, then the object as it is now, or Stripe's 404. */
async function retrieveOne(
  core: Core,
  { res, entry }: Call,
  endpoint: 'retrieve' | 'retrieve_refund',
  found: { operationId: string | null; customer: string | null; current: () => Promise<object> } | undefined,
  missing: { message: string; param: string },
) {
  entry.operationId = found?.operationId ?? null;
  const faults = await core.state.takeFaults(endpoint, entry.operationId, found?.customer ?? null);
  if (await preflight(faults, res, entry)) return;
  await latency(faults);
  if (!found) return respond(res, entry, 404, error('invalid_request_error', missing.message, { code: 'resource_missing', param: missing.param }));
  return deliver(res, entry, { status: 200, body: json(await found.current()) }, faults);
}

/** GET /v1/refunds: newest first; `payment_intent`, `created[gte]`, `limit`, `starting_after` (a list: read-after-write). */
async function listRefunds(core: Core, { res, entry, account }: Call, url: URL) {
  const paymentIntent = url.searchParams.get('payment_intent');
  const customer = paymentIntent ? ((await findIntent(core, paymentIntent, account))?.paymentIntent.customer ?? null) : null;
  const faults = await core.state.takeFaults('list_refunds', null, customer);
  if (await preflight(faults, res, entry)) return;
  await latency(faults);
  const all: Refund[] = [];
  for (const e of await core.state.refunds()) {
    if (e.account === account && (paymentIntent === null || e.refund.payment_intent === paymentIntent)) all.push(await currentRefund(core, e));
  }
  return deliver(res, entry, { status: 200, body: json(listPage(all, url, '/v1/refunds')) }, faults);
}

async function retrieve(core: Core, call: Call, piId: string, expand: string[]) {
  const found = await findIntent(core, piId, call.account);
  const object = found && {
    operationId: found.paymentIntent.metadata.operation_id ?? null,
    customer: found.paymentIntent.customer ?? null,
    current: async () => present(await currentIntent(core, found), expand),
  };
  return retrieveOne(core, call, 'retrieve', object, { message: `No such payment_intent: '${piId}'`, param: 'intent' });
}

/** The caller's account's PaymentIntents, oldest first. */
const intentsOf = async (core: Core, account: string | null) => (await core.state.intents()).filter((e) => e.account === account);

async function search(core: Core, { res, entry, account }: Call, url: URL) {
  const query = url.searchParams.get('query') ?? '';
  let clauses;
  try {
    clauses = parseSearchQuery(query);
  } catch (err) {
    return respond(res, entry, 400, error('invalid_request_error', (err as Error).message, { param: 'query' }));
  }
  entry.operationId = clauses.find((c) => c.metadataKey === 'operation_id')?.value ?? null;
  const faults = await core.state.takeFaults('search', entry.operationId, clauses.find((c) => c.field === 'customer')?.value ?? null);
  if (await preflight(faults, res, entry)) return;
  await latency(faults);
  const limit = Math.min(Math.max(Number(url.searchParams.get('limit') ?? 10) || 10, 1), 100);
  const offset = decodePage(url.searchParams.get('page'));
  // Indexing lags writes by lagMs; while frozen (an outage) nothing newer than the freeze is indexed.
  const { lagMs, frozenAtMs } = await core.state.searchSettings();
  const indexedUntil = (frozenAtMs ?? (await clock(core))) - lagMs;
  const hits = (await currentIntents(core, (await intentsOf(core, account)).filter((e) => e.createdAtMs <= indexedUntil)))
    .filter((pi) => matches(pi as unknown as Record<string, unknown>, clauses))
    .sort((a, b) => b.created - a.created || (a.id < b.id ? -1 : 1));
  const data = hits.slice(offset, offset + limit);
  const hasMore = offset + limit < hits.length;
  return deliver(res, entry, {
    status: 200,
    body: json({ object: 'search_result', data, has_more: hasMore, next_page: hasMore ? encodePage(offset + limit) : null, url: '/v1/payment_intents/search', total_count: hits.length }),
  }, faults);
}

/** GET /v1/payment_intents: newest first, `created[gte]`, `limit`, `starting_after` (a list, not a search: read-after-write). */
async function list(core: Core, { res, entry, account }: Call, url: URL) {
  const all = await currentIntents(core, await intentsOf(core, account));
  return deliver(res, entry, { status: 200, body: json(listPage(all, url, '/v1/payment_intents')) }, []);
}

const encodePage = (offset: number) => Buffer.from(`offset:${offset}`).toString('base64url');
const decodePage = (page: string | null) => {
  const m = page ? /^offset:(\d+)$/.exec(Buffer.from(page, 'base64url').toString()) : null;
  return m ? Number(m[1]) : 0;
};
