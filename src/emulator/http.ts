// Answers in Stripe's shape, and the small readers of a request every route uses.
import { randomBytes } from 'node:crypto';
import type { IncomingMessage, ServerResponse } from 'node:http';
import type { RequestLogEntry } from './core.ts';
import type { FormValue } from './form.ts';

export const newId = (prefix: string) => `${prefix}_${randomBytes(12).toString('hex')}`;

export function error(type: string, message: string, extra: Record<string, unknown> = {}) {
  return { error: { type, message, ...extra } };
}

/** A 400 invalid_request_error for a parameter that failed validation. */
export const invalidRequest = (invalid: { param: string; message: string; code?: string }) =>
  error('invalid_request_error', invalid.message, { param: invalid.param, ...(invalid.code ? { code: invalid.code } : {}) });

export function respond(res: ServerResponse, entry: RequestLogEntry, status: number, body: object) {
  send(res, entry, status, json(body));
}

export function send(res: ServerResponse, entry: RequestLogEntry, status: number, body: string) {
  entry.status = status;
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) });
  res.end(body);
}

/** A control API answer (not logged as a Stripe request). */
export function sendRaw(res: ServerResponse, status: number, value: unknown) {
  const body = JSON.stringify(value);
  res.writeHead(status, { 'Content-Type': 'application/json' });
  res.end(body);
}

export async function readBody(req: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of req) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}

export const header = (req: IncomingMessage, name: string): string | null => {
  const v = req.headers[name];
  return typeof v === 'string' ? v : null;
};

/** The secret key of a request: `Authorization: Bearer sk_test_…`, or Basic with the key as user (`curl -u sk_test_…:`). */
export function apiKeyOf(authorization: string | null): string | undefined {
  const [scheme, credentials] = (authorization ?? '').split(' ', 2);
  const key = /^basic$/i.test(scheme ?? '') ? Buffer.from(credentials ?? '', 'base64').toString().split(':')[0] : /^bearer$/i.test(scheme ?? '') ? credentials : undefined;
  return key && /^sk_test_\S+$/.test(key) ? key : undefined;
}

export const json = (v: unknown) => JSON.stringify(v);
export const str = (v: FormValue | undefined): string | null => (typeof v === 'string' ? v : null);
export const isRecord = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
