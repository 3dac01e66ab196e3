// The folders' import rules (docs/architecture.md, "The folders"), checked on the import graph esbuild
// resolves from the sources: the same resolution the runtime does, without a second parser of our own
// (TypeScript 7 ships no compiler API to ask). esbuild erases type-only imports, so the graph is what
// loads at run time; the engine's rule also reads its files' own import lines, type-only ones included.
import { spawnSync } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { build, type Metafile } from 'esbuild';
import { beforeAll, describe, expect, it } from 'vitest';
import { BUILT_IN_KINDS } from '../../src/kinds/names.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import type { PaymentGateway } from '../../src/stripe/gateway.ts';

const root = path.resolve(import.meta.dirname, '../..');
const sources = (dir: string): string[] =>
  readdirSync(path.join(root, dir), { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile() && e.name.endsWith('.ts'))
    .map((e) => path.relative(root, path.join(e.parentPath, e.name)));

/** Every module under src/ with the modules it imports statically (dynamic imports load on demand). */
let graph: Map<string, string[]>;
beforeAll(async () => {
  const { metafile } = await build({
    entryPoints: sources('src'),
    bundle: true,
    write: false,
    metafile: true,
    outdir: 'unused',
    platform: 'node',
    format: 'esm',
    packages: 'external',
    logLevel: 'silent',
  });
  graph = new Map(
    Object.entries((metafile as Metafile).inputs)
      .filter(([file]) => file.startsWith('src/'))
      .map(([file, input]) => [file, input.imports.filter((i) => i.kind === 'import-statement' && i.path.startsWith('src/')).map((i) => i.path)]),
  );
});

/** What `file` loads, directly or through others. */
function closure(file: string): Set<string> {
  const seen = new Set<string>();
  const walk = (f: string) => {
    for (const next of graph.get(f) ?? []) if (!seen.has(next)) (seen.add(next), walk(next));
  };
  walk(file);
  return seen;
}

const inFolder = (folder: string) => (file: string) => file.startsWith(`${folder}/`);

describe('folder import rules', () => {
  it('the engine imports no kind, not even a type, and loads none through anything else', () => {
    const engine = sources('src/engine');
    expect(engine.length).toBeGreaterThan(0);
    for (const file of engine) {
      const named = [...readFileSync(path.join(root, file), 'utf8').matchAll(/from '([^']+)'/g)].map((m) => path.join(path.dirname(file), m[1]!));
      expect(named.filter(inFolder('src/kinds')), `${file} names a kind`).toEqual([]);
      expect([...closure(file)].filter(inFolder('src/kinds')), `${file} loads a kind`).toEqual([]);
    }
  });

  it('the leaf of types imports nothing of outboxd outside it', () => {
    for (const file of sources('src/types')) expect((graph.get(file) ?? []).filter((f) => !inFolder('src/types')(f)), file).toEqual([]);
  });

  it('the dispatcher imports neither the console nor HTTP', () => {
    for (const file of sources('src/dispatcher')) {
      expect([...closure(file)].filter((f) => inFolder('src/console')(f) || inFolder('src/http')(f)), file).toEqual([]);
    }
  });

  it('only the composition root, the library and the CLI compose: nothing else imports the runtime wiring', () => {
    const wiring = ['src/runtime/replica.ts', 'src/runtime/worker.ts', 'src/runtime/inProcess.ts', 'src/runtime/open.ts'];
    const composers = (f: string) => inFolder('src/runtime')(f) || inFolder('src/cli')(f) || f === 'src/index.ts' || f === 'src/outboxd.ts';
    for (const [file, imports] of graph) {
      if (composers(file)) continue;
      expect(imports.filter((i) => wiring.includes(i)), `${file} imports runtime wiring`).toEqual([]);
    }
    // The one composition root: both ways of running a replica go through it.
    expect(graph.get('src/runtime/worker.ts')).toContain('src/runtime/replica.ts');
    expect(graph.get('src/runtime/inProcess.ts')).toContain('src/runtime/replica.ts');
    expect([...graph].filter(([, imports]) => imports.includes('src/dispatcher/dispatcher.ts')).map(([f]) => f)).toEqual(['src/runtime/replica.ts']);
  });

  // It is the ledger the chaos runs judge outboxd by, so it must not run outboxd's code
  // (test/unit/emulatorImports.test.ts also refuses type-only and computed imports).
  it('the emulator imports nothing of outboxd', () => {
    expect(sources('src/emulator').length).toBeGreaterThan(0);
    for (const file of sources('src/emulator')) expect((graph.get(file) ?? []).filter((f) => !inFolder('src/emulator')(f)), file).toEqual([]);
  });

  it('the library entry loads no emulator, console or CLI code', () => {
    const probe = `
      import { registerHooks } from 'node:module';
      const loaded = [];
      registerHooks({ resolve(specifier, context, next) { const r = next(specifier, context); loaded.push(r.url); return r; } });
      await import(${JSON.stringify(new URL('../../src/index.ts', import.meta.url).href)});
      console.log(JSON.stringify(loaded));`;
    const run = spawnSync(process.execPath, ['--input-type=module', '--no-warnings', '-e', probe], { encoding: 'utf8', env: { ...process.env, NODE_OPTIONS: '' } });
    expect(run.status, run.stderr).toBe(0);
    const loaded: string[] = JSON.parse(run.stdout.trim().split('\n').at(-1)!);
    const ours = loaded.filter((u) => u.includes('/src/')).map((u) => u.slice(u.indexOf('/src/') + 1));
    expect(ours).toContain('src/outboxd.ts');
    expect(ours.filter((f) => /^src\/(emulator|console|cli)\//.test(f))).toEqual([]);
  });
});

describe('kinds carry themselves', () => {
  it('no code outside a kind branches on a built-in kind by name', () => {
    // The table's checks and partial indexes are the contract (src/db/schema.ts, and the application
    // effects' insert that names its index, src/sql/effects.ts), `outboxd refund` is a command, and each
    // kind's request statements are its own (src/sql/charge.ts, refund.ts, hold.ts). Comments may name kinds.
    const allowed = (f: string) =>
      inFolder('src/kinds')(f) || inFolder('src/emulator')(f) ||
      ['src/db/schema.ts', 'src/cli/main.ts', 'src/sql/charge.ts', 'src/sql/refund.ts', 'src/sql/hold.ts', 'src/sql/effects.ts'].includes(f);
    const code = (f: string) => readFileSync(path.join(root, f), 'utf8').replace(/\/\*[\s\S]*?\*\//g, '').replace(/^\s*\/\/.*$/gm, '');
    const named = sources('src').filter((f) => !allowed(f)).flatMap((f) =>
      BUILT_IN_KINDS.flatMap((kind) => (code(f).match(new RegExp(`['"\`]${kind}['"\`]`, 'g')) ?? []).map(() => `${f}: ${kind}`)));
    expect(named).toEqual([]);
  });

  it('the built-in kinds named for queues and metrics are the ones registered', () => {
    expect(kindsFor({} as PaymentGateway).names).toEqual(BUILT_IN_KINDS);
  });
});
