// One HTTP listener per replica: probes and metrics (and, later, admin routes and the webhook inbox).
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';

export type Handler = (req: IncomingMessage, res: ServerResponse, url: URL) => Promise<void> | void;

export interface HttpServer {
  port: number;
  close(): Promise<void>;
}

export function sendJson(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) });
  res.end(text);
}

/** Routes are "METHOD /path" → handler; anything else is a JSON 404. */
export async function startHttpServer(port: number, routes: Record<string, Handler>, host = '0.0.0.0'): Promise<HttpServer> {
  const server: Server = createServer(async (req, res) => {
    const url = new URL(req.url ?? '/', 'http://outboxd');
    const handler = routes[`${req.method} ${url.pathname}`];
    try {
      if (!handler) return sendJson(res, 404, { error: 'not_found', message: `no route ${req.method} ${url.pathname}` });
      await handler(req, res, url);
    } catch (err) {
      if (!res.headersSent) sendJson(res, 500, { error: 'internal', message: (err as Error).message });
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
