// Raw TCP requests: what fetch refuses to send (bad request lines, bad escapes, odd methods, broken
// framing, random bytes), and what a server says back or whether it only closes.
import { connect } from 'node:net';

export interface RawAnswer {
  /** The status of the first response, or null when the server closed without answering. */
  status: number | null;
  /** What came back, cut to its first 64 KiB. */
  text: string;
  /** The connection ended (by the server, or after our FIN) before the deadline. */
  closed: boolean;
}

/**
 * Writes `payload` and reads until the server closes. `halfClose` sends FIN after the payload: a
 * truncated or unparseable request then ends (Node aborts it) instead of waiting for bytes that never
 * come. Without it, send `Connection: close` so that the server closes after answering.
 */
export function rawRequest(port: number, payload: string | Buffer, opts: { halfClose?: boolean; timeoutMs?: number } = {}): Promise<RawAnswer> {
  return new Promise((resolve) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const socket = connect(port, '127.0.0.1', () => {
      socket.write(payload);
      if (opts.halfClose) socket.end();
    });
    let done = false;
    const finish = (closed: boolean) => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      socket.destroy();
      const text = Buffer.concat(chunks).toString('latin1');
      const status = /^HTTP\/1\.[01] (\d{3}) /.exec(text);
      resolve({ status: status ? Number(status[1]) : null, text, closed });
    };
    const timer = setTimeout(() => finish(false), opts.timeoutMs ?? 5_000);
    socket.on('data', (d: Buffer) => {
      if (size < 65_536) chunks.push(d);
      size += d.length;
    });
    // A reset after the server refused a request is an end like any other.
    socket.on('error', () => {});
    socket.on('close', () => finish(true));
  });
}
