// Debian's PgBouncer in transaction mode (what managed poolers run) in front of a test database: a small
// pool, so that consecutive transactions of one client really land on different server connections.
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { freePort } from '../../src/db/embedded.ts';
import { waitUntil } from '../../harness/replica.ts';

export const PGBOUNCER = '/usr/sbin/pgbouncer';
export const hasPgBouncer = existsSync(PGBOUNCER);

export interface RunningPgBouncer {
  /** `url` (a database on the server behind it) through the pooler. */
  through(url: string): string;
  /** Everything it logged (stderr). */
  log(): string;
  stop(): Promise<void>;
}

export async function startPgBouncer(serverUrl: string, opts: { poolSize?: number } = {}): Promise<RunningPgBouncer> {
  const server = new URL(serverUrl);
  const port = await freePort();
  const dir = await mkdtemp(path.join(tmpdir(), 'outboxd-pgbouncer-'));
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
      `auth_file = ${path.join(dir, 'userlist.txt')}`,
      'pool_mode = transaction',
      `default_pool_size = ${opts.poolSize ?? 2}`,
      'max_client_conn = 500',
      // Nothing tolerated beyond what PgBouncer 1.18 knows: a startup parameter outboxd sends that a
      // pooler refuses must fail the test.
      'ignore_startup_parameters =',
    ].join('\n'),
  );
  // PgBouncer refuses to run as root; -u drops to an unprivileged user, which must read its files.
  const root = process.getuid?.() === 0;
  if (root) {
    await chmod(dir, 0o755);
    await chmod(path.join(dir, 'userlist.txt'), 0o644);
  }
  const proc = spawn(PGBOUNCER, [...(root ? ['-u', 'nobody'] : []), path.join(dir, 'pgbouncer.ini')], { stdio: ['ignore', 'ignore', 'pipe'] });
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
