// `npm test` runs this first (npm's pretest), so that the README's test command works on a fresh machine:
// a Node.js that is too old stops with one line, and the Debian packages the suite drives (chromium for
// the console's browser tests, pgbouncer for the pooler's) are installed with apt-get when absent and
// this is root (as on a fresh CI machine); otherwise one line says what to install. Plain JavaScript: it
// must run on any Node.
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { requireSupportedNode } from '../bin/node-version.js';

/** Each package by the file the tests run: test/support/browser.ts's CHROMIUM and test/support/pgbouncer.ts's
 * PGBOUNCER (TypeScript, which this file cannot import on an older Node). */
const PACKAGES = [
  { name: 'chromium', file: '/usr/bin/chromium', for: "the console's browser tests" },
  { name: 'pgbouncer', file: '/usr/sbin/pgbouncer', for: "the pooler's tests" },
];

requireSupportedNode("outboxd's test suite");

const missing = PACKAGES.filter((p) => !existsSync(p.file));
if (missing.length > 0) {
  const names = missing.map((p) => p.name);
  if (process.getuid?.() !== 0 || !existsSync('/usr/bin/apt-get')) {
    for (const p of missing) process.stderr.write(`${p.file} is missing: ${p.for} run Debian's ${p.name}\n`);
    process.stderr.write(`install it: apt-get install -y ${names.join(' ')}\n`);
    process.exit(1);
  }
  process.stderr.write(`installing Debian's ${names.join(' and ')} for ${missing.map((p) => p.for).join(' and ')}\n`);
  const env = { ...process.env, DEBIAN_FRONTEND: 'noninteractive' };
  execFileSync('apt-get', ['update', '-qq'], { stdio: 'inherit', env });
  execFileSync('apt-get', ['install', '-y', '-qq', ...names], { stdio: ['ignore', 'ignore', 'inherit'], env });
}
