// A worker replica as a real OS process (`bin/outboxd.js worker`), for the tests, the demo, chaos and
// the benchmark: properties about processes (kill -9, SIGSTOP/SIGCONT, SIGTERM drain) need processes.
import { spawn, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { freePort } from '../src/db/embedded.ts';

const BIN = fileURLToPath(new URL('../bin/outboxd.js', import.meta.url));

export interface Replica {
  proc: ChildProcess;
  port: number;
  logs: Record<string, unknown>[];
  metric(name: string): Promise<number>;
  get(path: string): Promise<{ status: number; body: string }>;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  kill(signal: NodeJS.Signals): void;
  /** The signal to the replica's whole process group (a terminal's Ctrl-C): started with `group`. */
  killGroup(signal: NodeJS.Signals): void;
}

/** entry: the JavaScript the worker runs from instead of bin/outboxd.js (the benchmark runs the compiled
 * dist/cli/main.js, as the image does); nodeArgs: node's own flags before it, as the image's command line;
 * args: the worker command's own (--effects); group: the replica leads a process group of its own. */
export async function startReplica(
  env: Record<string, string>,
  opts: { onLog?: (entry: Record<string, unknown>) => void; entry?: string; nodeArgs?: readonly string[]; args?: readonly string[]; group?: boolean } = {},
): Promise<Replica> {
  // The port is read from the 'worker ready' line, logged at info. A replica asked to be quieter (the
  // benchmark's: a line per call would be work it measures, which the peer does not do) is given a free
  // port (unless env names one) and awaited on its readiness probe.
  const quiet = env.LOG_LEVEL !== undefined && !['info', 'debug', 'trace'].includes(env.LOG_LEVEL);
  const fixedPort = quiet ? Number(env.HTTP_PORT ?? 0) || (await freePort()) : undefined;
  const proc = spawn(process.execPath, [...(opts.nodeArgs ?? []), opts.entry ?? BIN, 'worker', ...(opts.args ?? [])], {
    env: { ...process.env, HTTP_PORT: '0', ...env, ...(fixedPort ? { HTTP_PORT: String(fixedPort) } : {}), LOG_LEVEL: quiet ? env.LOG_LEVEL! : 'info' },
    stdio: ['ignore', 'ignore', 'pipe'],
    detached: opts.group ?? false,
  });
  const logs: Record<string, unknown>[] = [];
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    proc.once('exit', (code, signal) => resolve({ code, signal })),
  );
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`replica did not start: ${JSON.stringify(logs.slice(-5))}`)), 30_000);
    const ready = (port: number) => {
      clearTimeout(timer);
      resolve(port);
    };
    createInterface({ input: proc.stderr! }).on('line', (line) => {
      try {
        const entry = JSON.parse(line);
        logs.push(entry);
        opts.onLog?.(entry);
        if (entry.msg === 'worker ready') ready(entry.httpPort);
      } catch {
        logs.push({ raw: line });
      }
    });
    if (fixedPort !== undefined) {
      void waitUntil(() => fetch(`http://127.0.0.1:${fixedPort}/readyz`).then((r) => r.ok, () => false), 30_000, 'the replica to be ready').then(
        () => ready(fixedPort),
        () => {},
      );
    }
    void exited.then(({ code }) => reject(new Error(`replica exited with ${code} before it was ready: ${JSON.stringify(logs.slice(-5))}`)));
  });
  const get = async (path: string) => {
    const res = await fetch(`http://127.0.0.1:${port}${path}`);
    return { status: res.status, body: await res.text() };
  };
  return {
    proc,
    port,
    logs,
    get,
    exited,
    kill: (signal) => proc.kill(signal),
    killGroup: (signal) => process.kill(-proc.pid!, signal),
    async metric(name) {
      const { body } = await get('/metrics');
      return body
        .split('\n')
        .filter((l) => l.startsWith(name))
        .reduce((sum, l) => sum + Number(l.split(' ').pop()), 0);
    },
  };
}

export async function waitUntil<T>(fn: () => Promise<T> | T, timeoutMs = 30_000, what = 'condition'): Promise<NonNullable<T>> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v as NonNullable<T>;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}
