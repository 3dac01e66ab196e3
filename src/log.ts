import { pino, type Logger } from 'pino';

export type { Logger };

/**
 * JSON logs to stderr, so that a CLI command's stdout carries only its result. Written asynchronously:
 * a synchronous write per line cost the dispatcher about a sixth of its CPU (npm run bench); the price
 * is that a process killed with -9 may lose its last few lines. Flushed on a normal exit.
 */
export function createLogger(level: string, bindings: Record<string, unknown> = {}): Logger {
  return pino({ level, base: { pid: process.pid, ...bindings } }, stderr());
}

let shared: ReturnType<typeof pino.destination> | undefined;
function stderr(): ReturnType<typeof pino.destination> {
  if (!shared) {
    const destination = pino.destination({ dest: 2, sync: false });
    process.once('exit', () => {
      try {
        destination.flushSync();
      } catch {
        // not open yet: nothing was written
      }
    });
    shared = destination;
  }
  return shared;
}
