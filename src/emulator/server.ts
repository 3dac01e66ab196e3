// The emulator's HTTP server: Stripe's API under /v1 (routes.ts) and the control API under /_emulator
// (control.ts), over any state (state.ts): memory, or PostgreSQL (pgState.ts).
import { createServer, type Server } from 'node:http';
import type { Socket } from 'node:net';
import { control } from './control.ts';
import { cancelDeliveries, type Core, type ServerOptions } from './core.ts';
import { readBody, sendRaw } from './http.ts';
import { serveStripe } from './routes.ts';
import type { EmulatorState } from './state.ts';
import { redeliver } from './webhooks.ts';

export class EmulatorServer<S extends EmulatorState = EmulatorState> {
  protected readonly state: S;
  protected readonly core: Core;
  private readonly sockets = new Set<Socket>();
  private server: Server | undefined;

  constructor(state: S, opts: ServerOptions = {}) {
    this.state = state;
    this.core = { state, opts, log: [], deliveries: [], timers: new Set() };
  }

  async listen(port = 0, host = '127.0.0.1'): Promise<{ url: string; port: number }> {
    const server = createServer((req, res) => {
      void (async () => {
        const url = new URL(req.url ?? '/', 'http://emulator');
        const body = await readBody(req);
        if (url.pathname.startsWith('/_emulator/')) return control(this.core, req.method!, url.pathname, body, res);
        return serveStripe(this.core, req, url, body, res);
      })().catch((err: Error) => {
        if (!res.headersSent) sendRaw(res, 500, { error: { type: 'api_error', message: err.message } });
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
    cancelDeliveries(this.core);
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
  }

  /** Sends an event again, as Stripe may: the receiver must acknowledge it without acting twice. */
  redeliver(eventId: string): Promise<number | 'error'> {
    return redeliver(this.core, eventId);
  }
}
