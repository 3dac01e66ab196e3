import { pino, type Logger } from 'pino';

export type { Logger };

/** JSON logs to stderr, so that a CLI command's stdout carries only its result. */
export function createLogger(level: string, bindings: Record<string, unknown> = {}): Logger {
  return pino({ level, base: { pid: process.pid, ...bindings } }, pino.destination(2));
}
