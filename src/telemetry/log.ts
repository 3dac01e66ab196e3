import { pino, type DestinationStream, type Logger } from 'pino';
import { traceLogFields } from './tracing.ts';

export type { Logger };

/** What the asynchronous log holds unwritten at most; lines beyond are dropped. A log that stops draining
 * (a stalled shipper, a full disk) kept every line in memory until the replica ran out of it. */
const MAX_UNWRITTEN_LOG_BYTES = 16 << 20;

/**
 * JSON logs to stderr, so that a CLI command's stdout carries only its result. Written asynchronously:
 * a synchronous write per line cost the dispatcher about a sixth of its CPU (npm run bench); the price
 * is that a process killed with -9 may lose its last few lines, and one whose stderr stops draining its
 * lines past MAX_UNWRITTEN_LOG_BYTES. Flushed on a normal exit.
 * Each line written inside a traced span carries its trace_id and span_id.
 */
export function createLogger(level: string, bindings: Record<string, unknown> = {}, destination: DestinationStream = stderr()): Logger {
  return pino({ level, base: { pid: process.pid, ...bindings }, mixin: traceLogFields }, destination);
}

let shared: ReturnType<typeof pino.destination> | undefined;
function stderr(): ReturnType<typeof pino.destination> {
  if (!shared) {
    const destination = pino.destination({ dest: 2, sync: false, maxLength: MAX_UNWRITTEN_LOG_BYTES });
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
