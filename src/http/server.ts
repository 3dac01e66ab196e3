// One HTTP listener per replica: probes, metrics, the admin API and the Stripe webhook inbox.
// The webhook path faces the internet, so no request, however malformed, may stop the process: every
// failure ends as a 4xx/5xx answer or a closed socket, never as an exception outside a handler.
import { createServer, STATUS_CODES, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import type { Logger } from '../telemetry/log.ts';

export interface Request {
  req: IncomingMessage;
  res: ServerResponse;
  url: URL;
  /** Captured groups of the route's path pattern. */
  params: string[];
}

export type Handler = (r: Request) => Promise<void> | void;
/** [method, exact path or pattern, handler] */
export type Route = [method: string, path: string | RegExp, handler: Handler];

export interface HttpServer {
  port: number;
  close(): Promise<void>;
}

export class HttpError extends Error {
  readonly status: number;
  readonly code: string;
  /** Sent as Retry-After (a 429's wait). */
  readonly retryAfterSeconds: number | undefined;
  constructor(status: number, code: string, message: string, options?: ErrorOptions & { retryAfterSeconds?: number }) {
    super(message, options);
    this.status = status;
    this.code = code;
    this.retryAfterSeconds = options?.retryAfterSeconds;
  }
}

export function sendJson(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) });
  res.end(text);
}

/**
 * The request's body, refused past `limitBytes` (413). With `deadlineMs`, a body still arriving then is
 * dropped with its connection (a trickle would hold what it has buffered). With `hold`, each growth of
 * the buffer is first held against a budget shared with other requests (its caller gives it back): the
 * error it returns when the budget refuses it answers the request. Chunks are copied into one buffer,
 * grown by doubling, as they arrive: a chunk kept as the parser gave it holds the socket's read buffer
 * too, and a body sent a byte a chunk held thousands of times its size.
 */
export async function readBody(
  req: IncomingMessage,
  limitBytes = 1 << 20,
  opts: { deadlineMs?: number; hold?: (bytes: number) => HttpError | undefined } = {},
): Promise<Buffer> {
  const tooLarge = () => new HttpError(413, 'too_large', `body over ${limitBytes} bytes`);
  // Refused before a byte is read when the client announces it; counted as it arrives otherwise (chunked).
  if (Number(req.headers['content-length']) > limitBytes) throw tooLarge();
  const { deadlineMs, hold } = opts;
  const late = deadlineMs === undefined ? undefined : setTimeout(() => req.destroy(new HttpError(408, 'too_slow', `body not received within ${deadlineMs} ms`)), deadlineMs);
  let body = Buffer.alloc(0);
  let size = 0;
  try {
    // Leaving the loop early must not destroy the request, or its socket goes before the 413 is sent.
    for await (const chunk of req.iterator({ destroyOnReturn: false })) {
      const bytes = chunk as Buffer;
      if (size + bytes.length > limitBytes) throw tooLarge();
      if (size + bytes.length > body.length) {
        const capacity = Math.min(limitBytes, Math.max(size + bytes.length, 2 * body.length));
        const refused = hold?.(capacity - body.length);
        if (refused) throw refused;
        const grown = Buffer.allocUnsafe(capacity);
        body.copy(grown, 0, 0, size);
        body = grown;
      }
      bytes.copy(body, size);
      size += bytes.length;
    }
  } finally {
    clearTimeout(late);
  }
  return body.subarray(0, size);
}

/** A dot segment (`.`, `..`, percent-encoded or not) or a backslash, which the URL parser reads as `/`. */
const REWRITTEN_PATH = /\\|(^|\/)(\.|%2e){1,2}(\/|$)/i;

/**
 * The request target as a URL on a fixed origin. Only origin-form (`/path?query`) is served; anything
 * else (`*`, absolute-form, garbage) is refused. Prefixing the fixed origin keeps a target like `//x`
 * a path instead of a host, where `new URL(target, base)` would throw. A path the parser would rewrite
 * into another is refused: a proxy that passes on only `/webhooks/stripe…` by its prefix would otherwise
 * let `/webhooks/stripe/../../metrics` through to another route.
 */
function targetUrl(target: string | undefined): URL {
  const url = target?.startsWith('/') ? URL.parse(`http://outboxd${target}`) : null;
  if (!url) throw new HttpError(400, 'bad_request', 'the request target must be a path');
  if (REWRITTEN_PATH.test(target!.split('?', 1)[0]!)) throw new HttpError(400, 'bad_request', 'the path must not hold dot segments or backslashes');
  return url;
}

function decodeParam(s: string | undefined): string {
  try {
    return decodeURIComponent(s ?? '');
  } catch {
    throw new HttpError(400, 'bad_request', 'malformed percent-escape in the path');
  }
}

function match(routes: Route[], method: string, path: string): { handler: Handler; params: string[] } {
  for (const [m, p, handler] of routes) {
    if (m !== method) continue;
    if (typeof p === 'string' && p === path) return { handler, params: [] };
    if (p instanceof RegExp) {
      const found = p.exec(path);
      if (found) return { handler, params: found.slice(1).map(decodeParam) };
    }
  }
  throw new HttpError(404, 'not_found', `no route ${method} ${path}`);
}

/**
 * Answers a failed request. A 5xx is logged and says nothing of its cause: the error's text may name
 * tables, hosts or Stripe objects (a route that wants its text shown throws an HttpError carrying it).
 */
function answerError(req: IncomingMessage, res: ServerResponse, err: unknown, log: Logger | undefined): void {
  // The client went away (mid-body, say): nobody to answer, and nothing went wrong here.
  if (req.socket?.destroyed !== false) {
    log?.debug({ err, method: req.method }, 'HTTP client went away');
    res.destroy();
    return;
  }
  const status = err instanceof HttpError ? err.status : 500;
  if (status >= 500) log?.error({ err, method: req.method, path: req.url }, 'HTTP handler failed');
  // An answer already under way is cut off, so the client sees a broken response, not one that never ends.
  if (res.headersSent) {
    res.destroy();
    return;
  }
  // The rest of a body left unread (oversized, or refused before reading) is not worth reading: close
  // rather than keep the connection.
  if (status === 413 || !req.complete) res.setHeader('Connection', 'close');
  if (err instanceof HttpError && err.retryAfterSeconds !== undefined) res.setHeader('Retry-After', String(err.retryAfterSeconds));
  if (err instanceof HttpError) return sendJson(res, status, { error: err.code, message: err.message });
  sendJson(res, 500, { error: 'internal', message: 'internal error' });
}

/** What Node answers itself to a request it cannot parse, by its parser's error code. */
const CLIENT_ERROR_STATUS: Record<string, number> = {
  HPE_HEADER_OVERFLOW: 431,
  HPE_CHUNK_EXTENSIONS_OVERFLOW: 413,
  ERR_HTTP_REQUEST_TIMEOUT: 408,
};

export async function startHttpServer(port: number, routes: Route[], host = '0.0.0.0', log?: Logger): Promise<HttpServer> {
  const serve = async (req: IncomingMessage, res: ServerResponse) => {
    try {
      const url = targetUrl(req.url);
      const found = match(routes, req.method ?? '', url.pathname);
      await found.handler({ req, res, url, params: found.params });
    } catch (err) {
      answerError(req, res, err, log);
    }
  };
  const server: Server = createServer((req, res) => {
    // Writing to a response whose socket is gone emits 'error' on it; unheard, that would end the process.
    res.on('error', (err) => log?.debug({ err }, 'HTTP response not delivered'));
    // Last resort: a rejection here would be unhandled, and an unhandled rejection ends the process.
    serve(req, res).catch((err) => {
      log?.error({ err }, 'HTTP request failed while answering');
      res.destroy();
    });
  });
  // Bad request lines, unknown methods, oversized headers, a client resetting: answered as Node's default
  // handler would (400, 431, …, then close), logged, and never written onto a socket that already carried
  // a response (where it would corrupt what the client reads).
  server.on('clientError', (err: NodeJS.ErrnoException, socket: Socket) => {
    log?.debug({ code: err.code, reason: err.message }, 'unparseable HTTP request refused');
    if (socket.writable && socket.bytesWritten === 0) {
      const status = CLIENT_ERROR_STATUS[err.code ?? ''] ?? 400;
      socket.write(`HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n`);
    }
    socket.destroy();
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => {
      server.off('error', reject);
      resolve();
    });
  });
  // After listening, an accept failure (EMFILE under a connection flood) is an 'error' event: unheard it
  // would end the process; heard, the server keeps accepting once descriptors are free again.
  server.on('error', (err) => log?.error({ err }, 'HTTP listener error'));
  return {
    port: (server.address() as { port: number }).port,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}
