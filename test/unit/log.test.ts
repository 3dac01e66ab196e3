// The log as a replica writes it: asynchronously to stderr (src/telemetry/log.ts). A stderr that stops
// draining (a stalled log shipper, a full disk) must not take the replica's memory with it: what waits
// to be written is bounded, and lines beyond are dropped.
import { spawn } from 'node:child_process';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

const root = resolve(import.meta.dirname, '../..');

describe('the log, its stderr not drained', () => {
  it('holds at most 16 MiB of unwritten lines: 64 MB written leave the heap about as it was', async () => {
    // 128,000 lines of ~500 B, written while nothing reads the pipe (it takes 64 KiB).
    const script = `
      const { createLogger } = await import(${JSON.stringify(resolve(root, 'src/telemetry/log.ts'))});
      const log = createLogger('info');
      log.info('first');
      globalThis.gc(); const before = process.memoryUsage().heapUsed;
      const filler = 'x'.repeat(400);
      for (let i = 0; i < 128_000; i++) log.warn({ i, filler }, 'a line nobody reads');
      globalThis.gc();
      process.stdout.write(JSON.stringify({ grownMb: (process.memoryUsage().heapUsed - before) / 2 ** 20 }) + '\\n');
      setInterval(() => {}, 1000);`;
    const child = spawn(process.execPath, ['--expose-gc', '--experimental-strip-types', '--no-warnings', '--input-type=module', '-e', script], { cwd: root, stdio: ['ignore', 'pipe', 'pipe'] });
    child.stderr.pause(); // never read: the pipe fills, and the rest waits in the child
    try {
      const out = await new Promise<string>((done, fail) => {
        let text = '';
        child.stdout.on('data', (d) => (text += d) && text.includes('\n') && done(text));
        child.on('exit', (code) => fail(new Error(`exited ${code}: ${text}`)));
      });
      const { grownMb } = JSON.parse(out);
      expect(grownMb).toBeLessThan(24); // without a bound: ~64 MB
    } finally {
      child.kill('SIGKILL');
    }
  });
});
