// One HTTP listener per replica: probes, metrics, the admin API and the Stripe webhook inbox.
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';

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
  constructor(status: number, code: string, message: string) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function sendJson(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) });
  res.end(text);
}

export async function readBody(req: IncomingMessage, limitBytes = 1 << 20): Promise<Buffer> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req) {
    size += (chunk as Buffer).length;
    if (size > limitBytes) throw new HttpError(413, 'too_large', `body over ${limitBytes} bytes`);
    chunks.push(chunk as Buffer);
  }
  return Buffer.concat(chunks);
}

function match(routes: Route[], method: string, path: string): { handler: Handler; params: string[] } | undefined {
  for (const [m, p, handler] of routes) {
    if (m !== method) continue;
    if (typeof p === 'string' && p === path) return { handler, params: [] };
    if (p instanceof RegExp) {
      const found = p.exec(path);
      if (found) return { handler, params: found.slice(1).map((s) => decodeURIComponent(s ?? '')) };
    }
  }
  return undefined;
}

export async function startHttpServer(port: number, routes: Route[], host = '0.0.0.0'): Promise<HttpServer> {
  const server: Server = createServer(async (req, res) => {
    const url = new URL(req.url ?? '/', 'http://outboxd');
    const found = match(routes, req.method ?? 'GET', url.pathname);
    try {
      if (!found) return sendJson(res, 404, { error: 'not_found', message: `no route ${req.method} ${url.pathname}` });
      await found.handler({ req, res, url, params: found.params });
    } catch (err) {
      if (res.headersSent) return;
      if (err instanceof HttpError) return sendJson(res, err.status, { error: err.code, message: err.message });
      sendJson(res, 500, { error: 'internal', message: (err as Error).message });
    }
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, resolve);
  });
  return {
    port: (server.address() as { port: number }).port,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}
