// The emulator is the ledger the chaos runs and the tests check outboxd against, so it must not share
// code with what it judges: every file under src/emulator/ imports only other files there, Node's
// built-ins and the package's runtime dependencies (it runs in production as `outboxd stripe-emulator`).
import { readdirSync, readFileSync } from 'node:fs';
import { builtinModules } from 'node:module';
import { dirname, join, relative, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

const root = resolve(import.meta.dirname, '../..');
const emulatorDir = join(root, 'src/emulator');
const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as { dependencies: Record<string, string> };

/** Every module specifier a TypeScript file names: static imports and re-exports (types included), side-effect and dynamic imports. */
function specifiersOf(source: string): string[] {
  const found: string[] = [];
  const patterns = [
    /\b(?:import|export)\s+(?:type\s+)?[^'";]*?\bfrom\s*['"]([^'"]+)['"]/g,
    /\bimport\s*['"]([^'"]+)['"]/g,
    /\bimport\s*\(\s*['"]([^'"]+)['"]\s*\)/g,
  ];
  for (const p of patterns) for (const m of source.matchAll(p)) found.push(m[1]!);
  return found;
}

/** Why a specifier in `file` leaves the emulator; undefined when it stays inside. */
function violation(file: string, specifier: string): string | undefined {
  if (specifier.startsWith('.') || specifier.startsWith('/')) {
    const target = resolve(dirname(file), specifier);
    return relative(emulatorDir, target).startsWith('..') ? `${specifier} is outside src/emulator/` : undefined;
  }
  if (specifier.startsWith('node:') || builtinModules.includes(specifier)) return undefined;
  const name = specifier.startsWith('@') ? specifier.split('/').slice(0, 2).join('/') : specifier.split('/')[0]!;
  return name in pkg.dependencies && name !== 'outboxd' ? undefined : `${specifier} is not a runtime dependency of the package`;
}

function tsFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true, recursive: true })
    .filter((d) => d.isFile() && d.name.endsWith('.ts'))
    .map((d) => join(d.parentPath, d.name));
}

describe('the emulator imports nothing of outboxd', () => {
  it('finds every kind of import it must judge', () => {
    expect(
      specifiersOf(`import a from 'a';\nimport type { B } from "../../b.ts";\nexport { c } from './c.ts';\nexport * from './d.ts';\nimport './e.ts';\nconst f = await import('./f.ts');\nimport {\n  g,\n  type H,\n} from '../../../g.ts';`),
    ).toEqual(['a', '../../b.ts', './c.ts', './d.ts', '../../../g.ts', './e.ts', './f.ts']);
    expect(violation(join(emulatorDir, 'x.ts'), '../../db/pool.ts')).toBeDefined();
    expect(violation(join(emulatorDir, 'x.ts'), 'vitest')).toBeDefined();
    expect(violation(join(emulatorDir, 'x.ts'), './state.ts')).toBeUndefined();
  });

  it('every file under src/emulator/ imports only src/emulator/, built-ins and runtime dependencies', () => {
    const files = tsFiles(emulatorDir);
    expect(files.map((f) => relative(emulatorDir, f))).toContain('index.ts');
    const found: string[] = [];
    let imports = 0;
    for (const file of files) {
      const source = readFileSync(file, 'utf8');
      // A specifier computed at run time would escape this check.
      if (/\bimport\s*\(\s*[^'"\s]/.test(source) || /\brequire\s*\(|createRequire/.test(source)) found.push(`${relative(root, file)}: a computed import or require`);
      for (const specifier of specifiersOf(source)) {
        imports++;
        const why = violation(file, specifier);
        if (why) found.push(`${relative(root, file)}: ${why}`);
      }
    }
    expect(imports).toBeGreaterThan(files.length);
    expect(found).toEqual([]);
  });
});
