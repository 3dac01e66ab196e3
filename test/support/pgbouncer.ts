// Debian's PgBouncer in transaction mode (what managed poolers run) in front of a test database: a small
// pool, so that consecutive transactions of one client really land on different server connections.
// Two releases: bookworm's 1.18 (no prepared statement survives a transaction), and trixie's current
// one (>= 1.21: protocol-level named statements with max_prepared_statements, as managed poolers run it),
// from its own Debian root (scripts/ci/pgbouncer-current.sh), run with chroot on the host's network.
import { execFileSync, spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { freePort } from '../../src/db/embedded.ts';
import { waitUntil } from '../../harness/replica.ts';

export const PGBOUNCER = '/usr/sbin/pgbouncer';
/** The Debian root holding the current PgBouncer (scripts/ci/pgbouncer-current.sh makes it). */
export const CURRENT_PGBOUNCER_ROOT = process.env.OUTBOXD_PGBOUNCER_ROOT ?? '/var/cache/outboxd/pgbouncer-trixie';

/** One PgBouncer binary: the host's, or one inside a Debian root of its own. */
export interface PgBouncerRelease {
  /** A Debian root to chroot into; none: the host's binary. */
  root?: string;
  /** `1.18.0`, `1.24.1`. */
  version: string;
  /** From 1.21 on, named statements survive a transaction when max_prepared_statements > 0. */
  preparedStatements: boolean;
}

/** The command line that runs the release's binary with `args`: in its root, when it has one. */
const commandOf = (root: string | undefined, args: string[]): [string, string[]] => (root ? ['chroot', [root, PGBOUNCER, ...args]] : [PGBOUNCER, args]);

function releaseAt(root: string | undefined): PgBouncerRelease | undefined {
  if (!existsSync(path.join(root ?? '/', PGBOUNCER))) return undefined;
  const out = execFileSync(...commandOf(root, ['--version']), { encoding: 'utf8' });
  const version = /PgBouncer (\d+\.\d+\.\d+)/.exec(out)?.[1];
  if (!version) throw new Error(`${root ?? ''}${PGBOUNCER} --version said: ${out}`);
  const [major, minor] = version.split('.').map(Number) as [number, number];
  return { ...(root ? { root } : {}), version, preparedStatements: major > 1 || minor >= 21 };
}

/** Debian bookworm's (apt-get install pgbouncer), when installed. */
export const debianPgBouncer = (): PgBouncerRelease | undefined => releaseAt(undefined);
/** The current release in its own root, when scripts/ci/pgbouncer-current.sh has made it. */
export const currentPgBouncer = (): PgBouncerRelease | undefined => (process.getuid?.() === 0 ? releaseAt(CURRENT_PGBOUNCER_ROOT) : undefined);

export interface RunningPgBouncer {
  /** `url` (a database on the server behind it) through the pooler. */
  through(url: string): string;
  /** Everything it logged (stderr). */
  log(): string;
  stop(): Promise<void>;
}

export async function startPgBouncer(
  serverUrl: string,
  opts: { poolSize?: number; release?: PgBouncerRelease } = {},
): Promise<RunningPgBouncer> {
  const release = opts.release ?? debianPgBouncer();
  if (!release) throw new Error(`${PGBOUNCER} is missing: install Debian's pgbouncer (npm test does, as root)`);
  const server = new URL(serverUrl);
  const port = await freePort();
  // Its files inside its root, where a chrooted PgBouncer finds them at `inside`.
  const dir = await mkdtemp(path.join(release.root ? path.join(release.root, 'tmp') : tmpdir(), 'outboxd-pgbouncer-'));
  const inside = release.root ? path.join('/', path.relative(release.root, dir)) : dir;
  const user = decodeURIComponent(server.username);
  const quote = (s: string) => `"${s.replaceAll('"', '""')}"`;
  await writeFile(path.join(dir, 'userlist.txt'), `${quote(user)} ${quote(decodeURIComponent(server.password))}\n`);
  await writeFile(
    path.join(dir, 'pgbouncer.ini'),
    [
      '[databases]',
      `* = host=${server.hostname} port=${server.port}`,
      '[pgbouncer]',
      'listen_addr = 127.0.0.1',
      `listen_port = ${port}`,
      'unix_socket_dir =',
      'auth_type = plain',
      `auth_file = ${path.join(inside, 'userlist.txt')}`,
      'pool_mode = transaction',
      `default_pool_size = ${opts.poolSize ?? 2}`,
      'max_client_conn = 500',
      // Nothing tolerated beyond what PgBouncer 1.18 knows: a startup parameter outboxd sends that a
      // pooler refuses must fail the test.
      'ignore_startup_parameters =',
      // As managed poolers run a release that has it: the application's named statements work through it.
      ...(release.preparedStatements ? ['max_prepared_statements = 200'] : []),
    ].join('\n'),
  );
  // PgBouncer refuses to run as root; -u drops to an unprivileged user, which must read its files.
  const asRoot = process.getuid?.() === 0;
  if (asRoot) {
    await chmod(dir, 0o755);
    await chmod(path.join(dir, 'userlist.txt'), 0o644);
  }
  const proc = spawn(...commandOf(release.root, [...(asRoot ? ['-u', 'nobody'] : []), path.join(inside, 'pgbouncer.ini')]), { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  proc.stderr.on('data', (d) => (log += d));
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  const accepting = () =>
    new Promise<boolean>((resolve) => {
      const socket = connect(port, '127.0.0.1');
      socket.once('connect', () => (socket.destroy(), resolve(true)));
      socket.once('error', () => resolve(false));
    });
  await waitUntil(accepting, 15_000, `pgbouncer to listen (${log})`);
  return {
    through: (url) => {
      const u = new URL(url);
      u.hostname = '127.0.0.1';
      u.port = String(port);
      return u.toString();
    },
    log: () => log,
    stop: async () => {
      proc.kill('SIGINT');
      await exited;
      await rm(dir, { recursive: true, force: true });
    },
  };
}
