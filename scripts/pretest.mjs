// `npm test` runs this first (npm's pretest), so that the README's test command works on a fresh machine:
// a Node.js that is too old stops with one line, and the console's browser tests get Debian's chromium,
// installed with apt-get when it is absent and this is root (as on a fresh CI machine); otherwise one
// line says what to install. Plain JavaScript: it must run on any Node.
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { requireSupportedNode } from '../bin/node-version.js';

/** test/support/browser.ts's CHROMIUM (TypeScript, which this file cannot import on an older Node). */
const CHROMIUM = '/usr/bin/chromium';

requireSupportedNode("outboxd's test suite");

if (!existsSync(CHROMIUM)) {
  if (process.getuid?.() !== 0 || !existsSync('/usr/bin/apt-get')) {
    process.stderr.write(`${CHROMIUM} is missing: the console's tests drive Debian's chromium (apt-get install -y chromium)\n`);
    process.exit(1);
  }
  process.stderr.write("installing Debian's chromium for the console's browser tests\n");
  const env = { ...process.env, DEBIAN_FRONTEND: 'noninteractive' };
  execFileSync('apt-get', ['update', '-qq'], { stdio: 'inherit', env });
  execFileSync('apt-get', ['install', '-y', '-qq', 'chromium'], { stdio: ['ignore', 'ignore', 'inherit'], env });
}
