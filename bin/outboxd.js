#!/usr/bin/env node
// Thin launcher. Installed from the package (or in the container image) there is no src/: it runs the
// compiled dist/, since Node does not strip types inside node_modules. In the repository it runs the
// TypeScript sources with Node's own type stripping (on by default from Node 23.6 and 22.18); on Node
// 22.12–22.17 that is behind a flag, so it re-runs this process once with it.
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { requireSupportedNode } from './node-version.js';

requireSupportedNode('outboxd');

const source = new URL('../src/cli/main.ts', import.meta.url);
if (!existsSync(source)) {
  await import(new URL('../dist/cli/main.js', import.meta.url).href);
} else if (process.features.typescript) {
  await import(source.href);
} else {
  const child = spawn(process.execPath, [...process.execArgv, '--experimental-strip-types', '--no-warnings', fileURLToPath(source), ...process.argv.slice(2)], { stdio: 'inherit' });
  for (const signal of ['SIGINT', 'SIGTERM']) process.on(signal, () => child.kill(signal));
  child.on('exit', (code, signal) => process.exit(code ?? (signal ? 128 : 1)));
}
