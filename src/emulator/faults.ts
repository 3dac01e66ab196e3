// Faults injected into Stripe requests (rules are kept in the state, see state.ts): answers before
// anything executes, latency, and responses lost after the commit.
import type { ServerResponse } from 'node:http';
import type { RequestLogEntry } from './core.ts';
import { error, isRecord, respond, send } from './http.ts';
import { ENDPOINTS, RATE_LIMIT_CODES, REFUND_STATUSES, type Fault, type FaultRule, type RateLimitCode, type StoredResponse } from './state.ts';

const FAULT_KINDS = new Set<Fault['kind']>(['error_before_commit', 'error_after_commit', 'lose_response_after_commit', 'rate_limit', 'latency', 'refund_status']);

/** Faults that answer before anything executes. True when the request was answered. */
export async function preflight(faults: Fault[], res: ServerResponse, entry: RequestLogEntry): Promise<boolean> {
  const limited = faults.find((f) => f.kind === 'rate_limit');
  if (limited) {
    respond(res, entry, 429, tooManyRequests(limited.code ?? 'rate_limit'));
    return true;
  }
  const before = faults.find((f) => f.kind === 'error_before_commit');
  if (before) {
    await latency(faults);
    respond(res, entry, before.status, serverError(before));
    return true;
  }
  return false;
}

export async function latency(faults: Fault[]): Promise<void> {
  const l = faults.find((f) => f.kind === 'latency');
  if (l) await sleep(l.ms);
}

/** The response a committed request stores for its key: its own, or the error an error_after_commit fault puts in its place. */
export function storedAfterCommit(faults: Fault[], response: StoredResponse): StoredResponse {
  const afterCommit = faults.find((f) => f.kind === 'error_after_commit');
  return afterCommit ? { status: afterCommit.status, body: JSON.stringify(serverError(afterCommit)) } : response;
}

const serverError = (fault: { paymentIntent?: string | undefined }) =>
  error('api_error', 'An unknown error occurred on our side.', fault.paymentIntent ? { payment_intent: { id: fault.paymentIntent, object: 'payment_intent' } } : {});

/** Sends a response, unless a lose_response_after_commit fault loses it. */
export function deliver(res: ServerResponse, entry: RequestLogEntry, response: StoredResponse, faults: Fault[]) {
  const lose = faults.find((f) => f.kind === 'lose_response_after_commit');
  if (!lose) return send(res, entry, response.status, response.body);
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
    case 'trickle_headers':
    case 'trickle_body': {
      // A byte every 200 ms (a proxy or a network gone wrong): never idle long enough for a socket's idle
      // timeout, which is all the SDK's `timeout` is, so only a total deadline ends it.
      entry.status = 'trickled';
      const body = Buffer.from(response.body);
      // Written to the socket itself, and the connection closed after the last byte: the server's response
      // never ends, so no later request may be answered on this connection.
      const head = Buffer.from(`HTTP/1.1 ${response.status} OK\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n`);
      const socket = res.socket!;
      const bytes = lose.mode === 'trickle_body' ? body : Buffer.concat([head, body]);
      if (lose.mode === 'trickle_body') socket.write(head);
      let at = 0;
      const timer = setInterval(() => {
        if (at < bytes.length && !socket.destroyed) return void socket.write(bytes.subarray(at, ++at));
        clearInterval(timer);
        socket.destroySoon();
      }, 200);
      socket.once('close', () => clearInterval(timer));
      return;
    }
  }
}

/** Stripe's 429s: the account's limiter (rate_limit), or another request holding the object (lock_timeout). */
export function tooManyRequests(code: RateLimitCode) {
  return code === 'lock_timeout'
    ? error('invalid_request_error', 'This object is being accessed by another API request right now; retry the request.', { code })
    : error('rate_limit_error', 'Too many requests hit the API too quickly.', { code });
}

/** A rule from the control API, checked. */
export function faultRule(input: Record<string, unknown>): FaultRule {
  const fault = input.fault as Fault | undefined;
  if (!isRecord(fault) || !FAULT_KINDS.has(fault.kind)) throw new Error(`fault.kind must be one of ${[...FAULT_KINDS].join(', ')}`);
  if (fault.kind === 'rate_limit' && fault.code !== undefined && !RATE_LIMIT_CODES.includes(fault.code)) {
    throw new Error(`fault.code must be one of ${RATE_LIMIT_CODES.join(', ')}`);
  }
  if (input.count !== undefined && !(Number.isSafeInteger(input.count) && (input.count as number) > 0)) throw new Error('count must be a positive integer');
  if (input.endpoint !== undefined && !['any', ...ENDPOINTS].includes(input.endpoint as string)) {
    throw new Error(`endpoint must be one of ${[...ENDPOINTS, 'any'].join(', ')}`);
  }
  if ((fault.kind === 'error_before_commit' || fault.kind === 'error_after_commit') && fault.paymentIntent !== undefined && typeof fault.paymentIntent !== 'string') {
    throw new Error('fault.paymentIntent must be a PaymentIntent id');
  }
  if (fault.kind === 'refund_status' && !REFUND_STATUSES.includes(fault.status)) {
    throw new Error(`fault.status must be one of ${REFUND_STATUSES.join(', ')}`);
  }
  return input as unknown as FaultRule;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
