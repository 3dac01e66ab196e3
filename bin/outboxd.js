#!/usr/bin/env node
// Thin launcher: the CLI is TypeScript run by Node's own type stripping (on by default from Node 23.6
// and 22.18). On Node 22.15–22.17 it is behind a flag, so re-run this process once with it.
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';

const main = new URL('../src/cli/main.ts', import.meta.url);
if (process.features.typescript) {
  await import(main.href);
} else {
  const child = spawn(process.execPath, ['--experimental-strip-types', '--no-warnings', fileURLToPath(main), ...process.argv.slice(2)], { stdio: 'inherit' });
  for (const signal of ['SIGINT', 'SIGTERM']) process.on(signal, () => child.kill(signal));
  child.on('exit', (code, signal) => process.exit(code ?? (signal ? 128 : 1)));
}
